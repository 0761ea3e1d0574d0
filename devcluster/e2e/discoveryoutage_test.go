package e2e

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpudra/gpudra/pkg/controller"
)

// TestDiscoveryOutageLiftsNoGate is issue 35's item 1 in a real cluster:
// for one minute the API server answers every replica's discovery of
// resource.k8s.io/v1 with a 503, and the replicas restart in it (a rolling
// update during an API server restart), so that none has ever seen
// discovery answer. "Could not tell" is never "absent": no gate is lifted,
// no gang pod schedules early, and a new gang pod is refused with a reason
// rather than admitted ungated. Once discovery answers, the gangs go on.
func TestDiscoveryOutageLiftsNoGate(t *testing.T) {
	onGangPath(t, controller.GangModeGates)
	ns := namespace(t)
	ctx := context.Background()
	create(t, ns, gpus("one-gpu", 1), gangPod("held-0", "held", 2, "one-gpu", nil))
	gangCondition(t, ns, "held-0", v1.ConditionFalse, "")

	cluster.SetDiscoveryOutage("resource.k8s.io/v1")
	defer cluster.SetDiscoveryOutage("")
	require.NoError(t, cluster.SetGangMode(ctx, controller.GangModeGates), "replicas restarted in the outage")
	gangMode = controller.GangModeGates

	_, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, gangPod("late-0", "late", 1, "one-gpu", nil), metav1.CreateOptions{})
	if err == nil {
		t.Log("late-0 admitted during the outage: it must be held like held-0")
	} else {
		assert.Contains(t, err.Error(), "cannot tell", "refused with the reason")
	}
	deadline := time.Now().Add(time.Minute)
	for time.Now().Before(deadline) {
		list, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		require.NoError(t, err)
		for _, p := range list.Items {
			require.True(t, gatedByGpudra(&p), "pod %s lost its gate during the discovery outage: %s", p.Name, podStates(ns))
			require.Empty(t, p.Spec.NodeName, "pod %s scheduled during the discovery outage", p.Name)
		}
		time.Sleep(500 * time.Millisecond)
	}

	// Discovery answers again; the replicas ask again within 10 s. Until
	// then the new pod is still refused, and created again, as a Job would.
	cluster.SetDiscoveryOutage("")
	require.NoError(t, wait.PollUntilContextTimeout(ctx, time.Second, 45*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, gangPod("held-1", "held", 2, "one-gpu", nil), metav1.CreateOptions{})
		return err == nil, nil
	}), "held-1 admitted once discovery answers")
	for _, name := range []string{"held-0", "held-1"} {
		require.NoError(t, wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
			p, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
			return err == nil && p.Status.Phase == v1.PodRunning, nil
		}), fmt.Sprintf("%s runs once discovery answers: %s", name, podStates(ns)))
	}
}
