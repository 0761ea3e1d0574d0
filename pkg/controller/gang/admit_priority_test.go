package gang

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// withPriority gives a pod the priority its PriorityClass resolved to.
func withPriority(p *corev1.Pod, class string, value int32) *corev1.Pod {
	p.Spec.PriorityClassName, p.Spec.Priority = class, ptr.To(value)
	return p
}

// TestPriorityConflict: a gang whose pods differ in priority, the value
// kube-scheduler compares, is named with both priorities and pods; one
// priority (or one value under two class names) is no conflict.
func TestPriorityConflict(t *testing.T) {
	for name, tc := range map[string]struct {
		pods []*corev1.Pod
		want []string // substrings; nil: no conflict
	}{
		"no pods":                {},
		"one pod":                {pods: []*corev1.Pod{withPriority(plain("a", "g", "1"), "high", 1000)}},
		"no classes":             {pods: []*corev1.Pod{plain("a", "g", "2"), plain("b", "g", "2")}},
		"one class":              {pods: []*corev1.Pod{withPriority(plain("a", "g", "2"), "high", 1000), withPriority(plain("b", "g", "2"), "high", 1000)}},
		"one value, two classes": {pods: []*corev1.Pod{withPriority(plain("a", "g", "2"), "high", 1000), withPriority(plain("b", "g", "2"), "also-high", 1000)}},
		"a class and none": {pods: []*corev1.Pod{withPriority(plain("a", "g", "2"), "high", 1000), plain("b", "g", "2")},
			want: []string{`gang g: its pods' priorities differ (1000 (PriorityClass "high") of pod a, 0 (no PriorityClass) of pod b)`,
				"give every pod of the gang one PriorityClass"}},
		"the third differs": {pods: []*corev1.Pod{withPriority(plain("a", "g", "3"), "low", 1), withPriority(plain("b", "g", "3"), "low", 1),
			withPriority(plain("c", "g", "3"), "high", 1000)},
			want: []string{`1 (PriorityClass "low") of pod a, 1000 (PriorityClass "high") of pod c`}},
	} {
		t.Run(name, func(t *testing.T) {
			got := priorityConflict(&Gang{Name: "g", Pods: tc.pods})
			if tc.want == nil {
				assert.Empty(t, got)
				return
			}
			for _, w := range tc.want {
				assert.Contains(t, got, w)
			}
		})
	}
}

// TestWorkloadPathHoldsBackAGangOfMixedPriorities: on the Workload API path
// a gang whose pods differ in priority (two made at once both passed the
// webhook) is not handed to kube-scheduler, which would place none of it
// for ever: it is Unsatisfiable, says why, and does not hold its queue (the
// gang behind it is handed over).
func TestWorkloadPathHoldsBackAGangOfMixedPriorities(t *testing.T) {
	// The other gang comes second in the queue, and fits only if the
	// first one's two GPUs are not counted as planned.
	later := func(p *corev1.Pod) *corev1.Pod { p.CreationTimestamp = metav1.NewTime(t0.Add(1e9)); return p }
	h := newWorkloadHarness(t,
		withPriority(grouped(plain("m0", "mixed", "2", "m0")), "high", 1000), grouped(plain("m1", "mixed", "2", "m1")),
		later(withPriority(grouped(plain("s0", "same", "1", "s0")), "high", 1000)),
		oneGPUClaim("m0"), oneGPUClaim("m1"), oneGPUClaim("s0"))
	ctx := context.Background()
	require.NoError(t, h.round(t))
	_, err := h.client.SchedulingV1beta1().PodGroups("ns").Get(ctx, "mixed", metav1.GetOptions{})
	assert.Error(t, err, "no PodGroup for the gang of mixed priorities")
	_, err = h.client.SchedulingV1beta1().Workloads("ns").Get(ctx, "mixed", metav1.GetOptions{})
	assert.Error(t, err, "no Workload either")
	for _, name := range []string{"m0", "m1"} {
		cond := gangCond(t, h.pod(t, name))
		assert.Equal(t, corev1.ConditionFalse, cond.Status)
		assert.Equal(t, gpudrav1.ReasonUnsatisfiable, cond.Reason)
		assert.Contains(t, cond.Message, `gang mixed: its pods' priorities differ (1000 (PriorityClass "high") of pod m0, 0 (no PriorityClass) of pod m1)`)
	}
	_, err = h.client.SchedulingV1beta1().PodGroups("ns").Get(ctx, "same", metav1.GetOptions{})
	assert.NoError(t, err, "the gang behind it is handed over")
}
