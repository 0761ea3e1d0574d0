package submit

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"
)

// TestWithKueue: a job Kueue queues shows Kueue's LocalQueue as its queue,
// and until Kueue admits it, waits with Kueue's reason; once admitted,
// gpudra's own word (the gang's) is kept; a job not Kueue's is unchanged.
func TestWithKueue(t *testing.T) {
	workload := func(conditions string) *unstructured.Unstructured {
		u := &unstructured.Unstructured{}
		require.NoError(t, yaml.Unmarshal([]byte("apiVersion: kueue.x-k8s.io/v1beta2\nkind: Workload\nmetadata: {name: job-a2-1, namespace: team-a}\n"+
			"spec: {queueName: gpus}\nstatus: {conditions: "+conditions+"}\n"), &u.Object))
		return u
	}
	const quota = "couldn't assign flavors to pod set main: insufficient unused quota for gpudra.dev/gpu in flavor gpudra-gpus, 2 more needed"
	pending := workload(`[{type: QuotaReserved, status: "False", reason: Pending, message: "` + quota + `"}]`)
	admitted := workload(`[{type: QuotaReserved, status: "True"}, {type: Admitted, status: "True"}]`)
	gangWaits := JobStatus{Name: "a2", State: StateWaiting, Queue: "default", Position: 2, Reason: "WaitingForDevices", Message: "2 GPUs"}
	for name, tc := range map[string]struct {
		in         JobStatus
		localQueue string
		w          *unstructured.Unstructured
		want       JobStatus
	}{
		"not Kueue's": {in: gangWaits, want: gangWaits},
		"pending for quota, with Kueue's reason": {in: JobStatus{Name: "a2", State: StateWaiting, Queue: "default"}, localQueue: "gpus", w: pending,
			want: JobStatus{Name: "a2", State: StateWaiting, Queue: "kueue/gpus", Reason: "KueuePending", Message: quota}},
		"admitted, waiting for gpudra's devices": {in: gangWaits, localQueue: "gpus", w: admitted,
			want: JobStatus{Name: "a2", State: StateWaiting, Queue: "kueue/gpus", Reason: "WaitingForDevices", Message: "2 GPUs"}},
		"no Workload read": {in: JobStatus{Name: "a2", State: StateWaiting}, localQueue: "gpus",
			want: JobStatus{Name: "a2", State: StateWaiting, Queue: "kueue/gpus", Reason: "KueueNoWorkload", Message: "Kueue has not made the job's Workload yet (is Kueue running?)"}},
		"succeeded stays so": {in: JobStatus{Name: "a2", State: StateSucceeded}, localQueue: "gpus", w: pending,
			want: JobStatus{Name: "a2", State: StateSucceeded, Queue: "kueue/gpus"}},
	} {
		t.Run(name, func(t *testing.T) {
			assert.Equal(t, tc.want, WithKueue(tc.in, tc.localQueue, tc.w))
		})
	}
}
