package gang

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestHandOffNotActedOnIsReported: issue 35, item 8. The Workload API path
// is chosen from API discovery alone; a kube-scheduler that does nothing
// with the PodGroup (no GenericWorkload gate, no GangScheduling plugin)
// leaves the gang Pending in silence. 30 s after the hand-off the gang's
// pods say so (condition, Warning Event, metric); a PodGroup kube-scheduler
// marked unschedulable has its reason on the pods; a gang it acted on is
// left alone.
func TestHandOffNotActedOnIsReported(t *testing.T) {
	for _, tt := range []struct {
		name   string
		after  func(t *testing.T, h *roundHarness)
		reason string
	}{
		{name: "nothing happened", reason: ReasonSchedulerNotActing},
		{name: "the PodGroup is unschedulable", reason: ReasonPodGroupUnschedulable, after: func(t *testing.T, h *roundHarness) {
			pg, err := h.client.SchedulingV1beta1().PodGroups("ns").Get(context.Background(), "g", metav1.GetOptions{})
			require.NoError(t, err)
			pg.Status.Conditions = []metav1.Condition{{Type: podGroupScheduled, Status: metav1.ConditionFalse, Reason: "Unschedulable",
				Message: "0/1 nodes are available: 1 node(s) did not have enough free devices"}}
			_, err = h.client.SchedulingV1beta1().PodGroups("ns").UpdateStatus(context.Background(), pg, metav1.UpdateOptions{})
			require.NoError(t, err)
		}},
		{name: "kube-scheduler tried a pod", after: func(t *testing.T, h *roundHarness) {
			p := h.pod(t, "a")
			p.Status.Conditions = append(p.Status.Conditions, corev1.PodCondition{Type: corev1.PodScheduled, Status: corev1.ConditionFalse, Reason: "Unschedulable"})
			_, err := h.client.CoreV1().Pods("ns").UpdateStatus(context.Background(), p, metav1.UpdateOptions{})
			require.NoError(t, err)
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := newWorkloadHarness(t, grouped(plain("a", "g", "2", "ca")), grouped(plain("b", "g", "2", "cb")), oneGPUClaim("ca"), oneGPUClaim("cb"))
			now := t0
			h.c.opts.Now = func() time.Time { return now }
			require.NoError(t, h.round(t))
			h.syncPodGroups(t)
			require.Equal(t, ReasonPodGroupCreated, gangCond(t, h.pod(t, "a")).Reason)
			if tt.after != nil {
				tt.after(t, h)
				h.syncPodGroups(t)
			}
			now = now.Add(10 * time.Second)
			require.NoError(t, h.round(t))
			assert.Equal(t, ReasonPodGroupCreated, gangCond(t, h.pod(t, "a")).Reason, "kube-scheduler has its grace")

			now = now.Add(schedulerActGrace)
			require.NoError(t, h.round(t))
			c := gangCond(t, h.pod(t, "a"))
			if tt.reason == "" {
				assert.Equal(t, ReasonPodGroupCreated, c.Reason, "acted on: nothing to say")
				return
			}
			assert.Equal(t, tt.reason, c.Reason)
			assert.Equal(t, corev1.ConditionFalse, c.Status)
			assert.Contains(t, c.Message, "PodGroup g")
			assert.Equal(t, 1.0, testutil.ToFloat64(h.c.metrics.handOffsNotPlaced.WithLabelValues(tt.reason)))
			if tt.reason == ReasonPodGroupUnschedulable {
				assert.Contains(t, c.Message, "did not have enough free devices", "kube-scheduler's reason")
			}
		})
	}
}
