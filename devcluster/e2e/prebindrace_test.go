package e2e

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpudra/gpudra/devcluster/controlplane"
	"github.com/gpudra/gpudra/pkg/controller"
)

// watchDoubleAllocations lists every allocated claim every 50 ms until the
// returned function is called, which returns each exclusive device seen in
// two claims at once; each (nil: none) sees every allocated claim of every
// pass.
func watchDoubleAllocations(t *testing.T, each func(*resourceapi.ResourceClaim)) func() []string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var mu sync.Mutex
	var doubles []string
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-ctx.Done():
				return
			case <-time.After(50 * time.Millisecond):
			}
			list, err := cluster.Client.ResourceV1().ResourceClaims("").List(ctx, metav1.ListOptions{})
			if err != nil {
				continue
			}
			owner := map[string]string{}
			for i := range list.Items {
				c := &list.Items[i]
				if c.Status.Allocation == nil {
					continue
				}
				if each != nil {
					each(c)
				}
				for _, r := range c.Status.Allocation.Devices.Results {
					if r.ShareID != nil || (r.AdminAccess != nil && *r.AdminAccess) {
						continue
					}
					key := r.Pool + "/" + r.Device
					if other, ok := owner[key]; ok && other != c.Namespace+"/"+c.Name {
						mu.Lock()
						doubles = append(doubles, fmt.Sprintf("%s in %s and %s/%s", key, other, c.Namespace, c.Name))
						mu.Unlock()
					}
					owner[key] = c.Namespace + "/" + c.Name
				}
			}
		}
	})
	stop := func() []string {
		cancel()
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()
		return doubles
	}
	t.Cleanup(func() { stop() })
	return stop
}

// freeGPUs counts the node's whole GPUs (8 on the MIG-off DGX) that no
// claim holds.
func freeGPUs(ctx context.Context, node string) int {
	claims, err := cluster.Client.ResourceV1().ResourceClaims("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return 0
	}
	used := map[string]bool{}
	for _, c := range claims.Items {
		if c.Status.Allocation == nil {
			continue
		}
		for _, r := range c.Status.Allocation.Devices.Results {
			if r.Pool == node {
				used[r.Device] = true
			}
		}
	}
	return 8 - len(used)
}

// TestPreBindWindowRaceOnTheGatePath forces the window the review found:
// kube-scheduler chooses devices at Reserve and writes them at PreBind,
// here 3 s later (a PreBind plugin that waits, as a slow volume would).
// Single-GPU pods (four on an empty node) are in that window on a node of
// 8 GPUs when a gang of 2 pods x 2 GPUs pinned to the same node arrives,
// filling it: the controller's
// snapshot and its check against the API server both see 8 free GPUs, and
// its planner picks the same first devices the scheduler picked. The
// controller must wait for the pods the scheduler is binding to that node
// (it nominated them), then plan around their devices: every pod ends
// Running and no device is ever in two claims. With that wait removed
// (committer.binding), the gang's claims were written with the singles'
// devices: the watcher saw them in two claims and the gang's pods never
// became ready (see the closing note of issue 25).
func TestPreBindWindowRaceOnTheGatePath(t *testing.T) {
	onGangPath(t, controller.GangModeGates)
	ns := namespace(t)
	ctx := context.Background()
	create(t, ns, gpus("one", 1))
	create(t, ns, gpus("two", 2))
	doubles := watchDoubleAllocations(t, nil)
	// Earlier tests may still hold GPUs there for a moment: the singles fill
	// what the gang (4 GPUs) leaves, so that the node ends full.
	var free int
	require.NoError(t, wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		free = freeGPUs(ctx, nomigNode)
		return free >= 6, nil
	}), "node %s: only %d GPUs free", nomigNode, free)
	singles := free - 4
	var names []string
	for i := range singles {
		p := gpuPod(fmt.Sprintf("single-%d", i), "one")
		pinned(nomigNode)(p)
		p.Annotations = map[string]string{controlplane.PreBindDelayAnnotation: "3s"}
		create(t, ns, nil, p)
		names = append(names, p.Name)
	}
	// All four chosen and nominated, none written yet.
	require.NoError(t, wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		pods, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		n := 0
		for _, p := range pods.Items {
			if p.Status.NominatedNodeName == nomigNode && p.Spec.NodeName == "" {
				n++
			}
		}
		return n == singles, nil
	}), "the scheduler did not nominate the %d pods: %s", singles, podStates(ns))
	create(t, ns, nil, gangPod("gang-0", "gang", 2, "two", pinned(nomigNode)), gangPod("gang-1", "gang", 2, "two", pinned(nomigNode)))

	for _, name := range append(names, "gang-0", "gang-1") {
		waitRunning(t, ns, name)
	}
	assert.Empty(t, doubles(), "devices in two claims at once")
	// The window was hit: the controller said why it waited.
	events, err := cluster.Client.EventsV1().Events(ns).List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	waited := false
	for _, e := range events.Items {
		waited = waited || strings.Contains(e.Note, "kube-scheduler is binding pod")
	}
	assert.True(t, waited, "the controller waited for the pods the scheduler was binding")
}
