package e2e

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/controller"
)

// TestNoDoubleAllocationWhileTheSchedulerAndTheControllerRace: the
// scheduler places a stream of single-GPU pods while the controller holds
// reservations, over many rounds, close to the cluster's capacity. A
// watcher lists every allocated claim every 50 ms: no device may ever be in
// two of them.
func TestNoDoubleAllocationWhileTheSchedulerAndTheControllerRace(t *testing.T) {
	onGangPath(t, controller.GangModeGates)
	ns := namespace(t)
	ctx := context.Background()
	create(t, ns, gpus("one", 1))

	var mu sync.Mutex
	bySource := map[string]int{}
	doubles := watchDoubleAllocations(t, func(c *resourceapi.ResourceClaim) {
		if c.Namespace != ns {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		if c.Labels[gpudrav1.LabelReservation] != "" {
			bySource["controller"]++
		} else {
			bySource["scheduler"]++
		}
	})

	const rounds, podsPerRound, reservationsPerRound = 6, 6, 2
	for round := range rounds {
		var wg sync.WaitGroup
		for i := range podsPerRound {
			wg.Go(func() {
				_, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, gpuPod(fmt.Sprintf("r%d-pod-%d", round, i), "one"), metav1.CreateOptions{})
				assert.NoError(t, err)
			})
		}
		for i := range reservationsPerRound {
			wg.Go(func() {
				createReservation(t, ns, &gpudrav1.GpuReservation{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("r%d-res-%d", round, i)},
					Spec: gpudrav1.GpuReservationSpec{DeviceClassName: "gpu.gpudra.dev", Claims: 2, Count: 2, TTL: metav1.Duration{Duration: time.Minute}}})
			})
		}
		wg.Wait()
		// Let both sides place what fits.
		require.NoError(t, wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
			pods, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, nil
			}
			for _, p := range pods.Items {
				if p.Status.Phase != v1.PodRunning && !unschedulable(&p) {
					return false, nil
				}
			}
			return true, nil
		}))
		time.Sleep(time.Second)
		// Clear the round: pods, then reservations (their claims go with them).
		deleteAllPods(t, ns)
		for i := range reservationsPerRound {
			_ = dyn(t).Resource(gpudrav1.GpuReservations).Namespace(ns).Delete(ctx, fmt.Sprintf("r%d-res-%d", round, i), metav1.DeleteOptions{})
		}
		require.NoError(t, wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
			claims, err := cluster.Client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
			return err == nil && len(claims.Items) == 0, nil
		}), "round %d: claims not released", round)
	}
	assert.Empty(t, doubles(), "devices in two claims at once")
	mu.Lock()
	defer mu.Unlock()
	assert.Positive(t, bySource["scheduler"], "the scheduler allocated")
	assert.Positive(t, bySource["controller"], "the controller allocated")
}

func unschedulable(p *v1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == v1.PodScheduled && c.Status == v1.ConditionFalse && c.Reason == v1.PodReasonUnschedulable {
			return true
		}
	}
	return false
}
