package karpenter_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
)

var reservations = schema.GroupVersionResource{Group: "gpudra.dev", Version: "v1alpha1", Resource: "gpureservations"}

// TestConsolidationRemovesOnlyEmptyNodes: Karpenter's consolidation
// (WhenEmpty, consolidateAfter 30s) removes a GPU node once its last pod
// is gone, but never a node whose GPUs a held reservation's claims hold:
// such a node has no pod and looks empty to Karpenter, which knows nothing
// of ResourceClaims. gpudra-controller marks it karpenter.sh/do-not-disrupt
// (and Cluster Autoscaler's scale-down-disabled) while the claims are
// allocated, and lifts the marks when they go; then the node goes too.
// The queued reservation itself brought the node up: its demand is a
// CapacityBuffer per claim, as Karpenter sees no pod for it.
func TestConsolidationRemovesOnlyEmptyNodes(t *testing.T) {
	ctx := context.Background()
	before := nodeClaimNames(t)
	ns := namespace(t)

	// An empty node goes.
	apply(t, ns, example("single-gpu"))
	pod := waitRunning(t, ns, "single-gpu", 4*time.Minute)
	empty := pod.Spec.NodeName
	require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(ctx, pod.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}))
	start := time.Now()
	waitNodeGone(t, empty, 3*time.Minute)
	t.Logf("empty node %s removed by consolidation %s after its pod was deleted", empty, time.Since(start).Round(time.Second))

	// A queued reservation brings a node up, and its held claims keep it.
	apply(t, ns, filepath.Join(examples, "autoscaling", "reservation.yaml"))
	held := waitReservationHeld(t, ns, "scale-up", 4*time.Minute)
	node := held.node
	require.NotEmpty(t, node)
	assert.False(t, before[nodeClaimOf(t, node).GetName()], "the reservation's node was bought for it")
	n, err := cluster.Client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, "true", n.Annotations["karpenter.sh/do-not-disrupt"], "gpudra marks the node: %v", n.Annotations)
	assert.Equal(t, "true", n.Annotations["cluster-autoscaler.kubernetes.io/scale-down-disabled"])
	assert.Contains(t, n.Annotations["gpudra.dev/do-not-disrupt"], "k-testconsolidationremovesonlyemptynodes/scale-up-", "the reason names the claims")
	// Twice consolidateAfter, and Karpenter's disruption loop: an
	// unmarked empty node is gone well within this (see above).
	time.Sleep(90 * time.Second)
	_, err = cluster.Client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	require.NoError(t, err, "the node holding the reservation's claims is still there")
	for _, c := range held.claims {
		cl, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, c, metav1.GetOptions{})
		require.NoError(t, err)
		require.NotNil(t, cl.Status.Allocation, "claim %s still allocated", c)
	}

	// The reservation ends: the marks go, and so does the node.
	require.NoError(t, dyn(t).Resource(reservations).Namespace(ns).Delete(ctx, "scale-up", metav1.DeleteOptions{}))
	err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		n, err := cluster.Client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		return err == nil && n.Annotations["gpudra.dev/do-not-disrupt"] == "" && n.Annotations["karpenter.sh/do-not-disrupt"] == "", nil
	})
	require.NoError(t, err, "gpudra lifts its marks once the claims are gone")
	waitNodeGone(t, node, 3*time.Minute)
	assert.Len(t, nodeClaims(t), len(before), "every machine bought here is gone: %s", nodeClaimsSummary(t))
}

type heldReservation struct {
	node   string
	claims []string
}

// waitReservationHeld waits for the reservation to be Held and gives its
// claims and the node their devices are on.
func waitReservationHeld(t *testing.T, ns, name string, timeout time.Duration) heldReservation {
	t.Helper()
	var out heldReservation
	var last *unstructured.Unstructured
	err := wait.PollUntilContextTimeout(context.Background(), 500*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		r, err := dyn(t).Resource(reservations).Namespace(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		last = r
		if phase, _, _ := unstructured.NestedString(r.Object, "status", "phase"); phase != "Held" {
			return false, nil
		}
		claims, err := cluster.Client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		out = heldReservation{}
		for _, c := range claims.Items {
			if len(c.OwnerReferences) == 0 || c.OwnerReferences[0].Name != name || c.Status.Allocation == nil {
				continue
			}
			out.claims = append(out.claims, c.Name)
			for _, r := range c.Status.Allocation.Devices.Results {
				out.node = r.Pool
			}
		}
		return len(out.claims) > 0, nil
	})
	var status any
	if last != nil {
		status = last.Object["status"]
	}
	require.NoError(t, err, "reservation %s/%s not held: %v\nNodeClaims: %s\nKarpenter's log:\n%s", ns, name, status, nodeClaimsSummary(t), karpenter.LogTail(4000))
	return out
}
