package dashboard

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// waitView waits until the source's View satisfies ok.
func waitSourceView(t *testing.T, src Source, within time.Duration, ok func(v *View) bool) *View {
	t.Helper()
	deadline := time.After(within)
	for {
		v, changed := src.Current()
		if ok(v) {
			return v
		}
		select {
		case <-changed:
		case <-deadline:
			t.Fatalf("no such view within %s; last: revision %d, notes %v", within, v.Revision, v.Notes)
		}
	}
}

func gpuState(v *View, node, gpu string) string {
	for _, d := range v.Domains {
		for _, n := range d.Nodes {
			for _, g := range n.GPUs {
				if n.Name == node && g.Name == gpu {
					return g.State
				}
			}
		}
	}
	return ""
}

func dynClient(t *testing.T, objs ...any) *dynamicfake.FakeDynamicClient {
	t.Helper()
	var us []runtime.Object
	for _, o := range objs {
		u, err := gpudrav1.ToUnstructured(o)
		require.NoError(t, err)
		us = append(us, u)
	}
	return dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), map[schema.GroupVersionResource]string{
		gpudrav1.GpuQueues: "GpuQueueList", gpudrav1.GpuReservations: "GpuReservationList"}, us...)
}

func forbid(resource string, cond func(a k8stesting.Action) bool) k8stesting.ReactionFunc {
	return func(a k8stesting.Action) (bool, runtime.Object, error) {
		if cond != nil && !cond(a) {
			return false, nil, nil
		}
		return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: resource}, "", fmt.Errorf("RBAC: no"))
	}
}

// TestClusterSourceForbidden: a resource the user may not list is a note
// and not watched (never "empty"); claims still show their devices; pods
// forbidden cluster-wide fall back to the kubeconfig's namespace.
func TestClusterSourceForbidden(t *testing.T) {
	claim := allocatedClaim("team-a", "mine", "node-a", []string{"gpu-0"}, "runner")
	client := fake.NewClientset(claim, testPod("team-a", "runner", nil), testPod("team-b", "other", withClaim("x")))
	var sliceLists atomic.Int32
	client.PrependReactor("list", "resourceslices", func(k8stesting.Action) (bool, runtime.Object, error) {
		sliceLists.Add(1)
		return forbid("resourceslices", nil)(nil)
	})
	client.PrependReactor("list", "pods", forbid("pods", func(a k8stesting.Action) bool { return a.GetNamespace() == "" }))
	dyn := dynClient(t)
	dyn.PrependReactor("list", "gpuqueues", forbid("gpuqueues", nil))
	src := NewClusterSource(ClusterConfig{Client: client, Dynamic: dyn, FallbackNamespace: "team-a", Context: "kind-user", Debounce: 10 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx) }()
	defer func() { cancel(); require.NoError(t, <-done) }()

	v := waitSourceView(t, src, 5*time.Second, func(v *View) bool { return gpuState(v, "node-a", "gpu-0") == StateAllocated })
	notes := strings.Join(v.Notes, "\n")
	assert.Contains(t, notes, "ResourceSlices: forbidden")
	assert.Contains(t, notes, "pods: forbidden in all namespaces: showing namespace team-a only")
	assert.Contains(t, notes, "GpuQueues: forbidden")
	assert.NotContains(t, notes, "reading the cluster")
	assert.Equal(t, "kind-user", v.Context)
	assert.Equal(t, int32(1), sliceLists.Load(), "tried once, never watched")
	for _, q := range v.Queues {
		for _, it := range q.Items {
			assert.NotEqual(t, "team-b", it.Namespace, "pods are read in team-a only")
		}
	}
	assert.Equal(t, []string{"runner"}, findHolder(v).Pods)
}

func findHolder(v *View) Holder {
	for _, d := range v.Domains {
		for _, n := range d.Nodes {
			for _, g := range n.GPUs {
				if len(g.Holders) > 0 {
					return g.Holders[0]
				}
			}
		}
	}
	return Holder{}
}

// TestClusterSourcePublishesAClaimChange: an allocation shows well within
// 2 s, and a burst of changes is one rebuild or a few, not one each.
func TestClusterSourcePublishesAClaimChange(t *testing.T) {
	client := fake.NewClientset(pendingClaim("team-a", "job", 1))
	for _, s := range nodeSlices(t, "node-a", twoGPUs, slicebuilder.Options{}) {
		_, err := client.ResourceV1().ResourceSlices().Create(context.Background(), s, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	queue := &gpudrav1.GpuQueue{ObjectMeta: metav1.ObjectMeta{Name: "default"}, Spec: gpudrav1.GpuQueueSpec{Policy: gpudrav1.FairShare}}
	src := NewClusterSource(ClusterConfig{Client: client, Dynamic: dynClient(t, queue, testReservation("team-a", "r", "", 1, 0)), Debounce: 100 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx) }()
	defer func() { cancel(); require.NoError(t, <-done) }()

	v := waitSourceView(t, src, 5*time.Second, func(v *View) bool { return gpuState(v, "node-a", "gpu-0") == StateFree })
	assert.Empty(t, v.Notes)
	require.Len(t, v.Queues, 1)
	assert.Equal(t, "FairShare", v.Queues[0].Policy, "GpuQueues through the dynamic informer")
	require.Len(t, v.Queues[0].Items, 1)
	assert.Equal(t, "GpuReservation", v.Queues[0].Items[0].Kind)
	assert.Equal(t, "seen", v.Allocation.Source)
	before := v.Revision

	c := allocatedClaim("team-a", "job", "node-a", []string{"gpu-0"}, "p")
	start := time.Now()
	_, err := client.ResourceV1().ResourceClaims("team-a").UpdateStatus(ctx, c, metav1.UpdateOptions{})
	require.NoError(t, err)
	v = waitSourceView(t, src, 2*time.Second, func(v *View) bool { return gpuState(v, "node-a", "gpu-0") == StateAllocated })
	assert.Less(t, time.Since(start), 2*time.Second)
	assert.Equal(t, []string{"team-a"}, v.Filters.Namespaces)
	require.NotEmpty(t, v.Allocation.Series, "the seen history counts the allocation")
	assert.Equal(t, "team-a", v.Allocation.Series[0].Owner)

	// A burst of 20 changes within the debounce.
	mid, _ := src.Current()
	for i := range 20 {
		cl := pendingClaim("team-a", fmt.Sprintf("burst-%d", i), 1)
		_, err := client.ResourceV1().ResourceClaims("team-a").Create(ctx, cl, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	time.Sleep(600 * time.Millisecond)
	last, _ := src.Current()
	assert.Greater(t, last.Revision, mid.Revision)
	assert.LessOrEqual(t, last.Revision-mid.Revision, uint64(5), "debounced: not one View per change")
	assert.Greater(t, mid.Revision, before)
}
