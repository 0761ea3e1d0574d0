package karpenter_test

import (
	"context"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpudra/gpudra/devcluster/autoscaler"
)

// TestScaleFromZero: with no GPU node at all, a pending pod of each kind
// of claim brings up a machine of a type whose templates fit it, from the
// NodePool whose NodeClass can serve it; the real plugin on it publishes
// what Karpenter simulated and the pod runs there. Deleting the NodeClaim
// terminates the machine and removes its Node.
func TestScaleFromZero(t *testing.T) {
	tests := []struct {
		example, pod, pool string
		types              []string
	}{
		{example: "single-gpu", pod: "single-gpu", pool: "whole-gpus", types: []string{"p5.48xlarge"}},
		{example: "nvlink-pair", pod: "nvlink-pair", pool: "whole-gpus", types: []string{"p5.48xlarge"}},
		{example: "mig", pod: "mig", pool: "mig", types: []string{"p5.48xlarge"}},
		{example: "fractional", pod: "share-a", pool: "fractional", types: []string{"p5.48xlarge"}},
	}
	for _, tt := range tests {
		t.Run(tt.example, func(t *testing.T) {
			ctx := context.Background()
			before, err := cluster.Client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
			require.NoError(t, err)
			ns := namespace(t)
			tl := watchScaleUp(t, ns, []string{tt.pod})
			apply(t, ns, example(tt.example))
			pod := waitRunning(t, ns, tt.pod, 4*time.Minute)
			waitTimeline(t, tl)
			t.Log(tl.split(t))
			assert.False(t, slices.ContainsFunc(before.Items, func(n v1.Node) bool { return n.Name == pod.Spec.NodeName }),
				"the pod runs on a node bought for it, not on %s", pod.Spec.NodeName)
			nc := nodeClaimOf(t, pod.Spec.NodeName)
			assert.Equal(t, tt.pool, nc.GetLabels()["karpenter.sh/nodepool"])
			assert.Contains(t, tt.types, nc.GetLabels()[v1.LabelInstanceTypeStable])
			require.NoError(t, cluster.Client.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}, metav1.ListOptions{}))
			deleteNodeClaim(t, nc.GetName(), pod.Spec.NodeName)
		})
	}
}

// TestH200MemoryNeverBuysAnH100: a claim only an H200's memory satisfies
// brings up an H200 machine, though the pool's H100 type is cheaper (the
// plain single GPU above got one): Karpenter's simulation evaluated the
// claim's CEL selector against each type's templates. No H100 machine is
// bought, even for a moment.
func TestH200MemoryNeverBuysAnH100(t *testing.T) {
	bought := boughtTypes(t)
	before := nodeClaimNames(t)
	ns := namespace(t)
	apply(t, ns, filepath.Join(examples, "autoscaling", "h200-memory.yaml"))
	pod := waitRunning(t, ns, "long-context", 4*time.Minute)
	nc := nodeClaimOf(t, pod.Spec.NodeName)
	assert.Equal(t, "p5e.48xlarge", nc.GetLabels()[v1.LabelInstanceTypeStable])
	for name, typ := range bought() {
		if !before[name] {
			assert.Equal(t, "p5e.48xlarge", typ, "NodeClaim %s", name)
		}
	}
	cleanUp(t, ns, before)
}

// TestGangOf16GPUsOnTwo8GPUMachines: a gang of two 8-GPU pods, on a pool
// at zero of 8-GPU types, all or nothing through gpudra's gang path. Its
// gated pods are invisible to Karpenter; gpudra publishes them as
// CapacityBuffers; Karpenter buys two machines; gpudra takes the buffers
// back and hands the gang over whole: both pods run, on two new nodes, and
// no buffer is left to keep spare machines.
func TestGangOf16GPUsOnTwo8GPUMachines(t *testing.T) {
	ctx := context.Background()
	before := nodeClaimNames(t)
	ns := namespace(t)
	tl := watchScaleUp(t, ns, []string{"trainer-0", "trainer-1"})
	apply(t, ns, filepath.Join(examples, "autoscaling", "gang-16-gpus.yaml"))
	p0 := waitRunning(t, ns, "trainer-0", 5*time.Minute)
	p1 := waitRunning(t, ns, "trainer-1", time.Minute)
	waitTimeline(t, tl)
	t.Log(tl.split(t))
	assert.NotEqual(t, p0.Spec.NodeName, p1.Spec.NodeName, "8 GPUs each: one machine each")
	for _, p := range []*v1.Pod{p0, p1} {
		nc := nodeClaimOf(t, p.Spec.NodeName)
		assert.False(t, before[nc.GetName()], "pod %s runs on a machine bought for the gang", p.Name)
	}
	err := wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		list, err := dyn(t).Resource(autoscaler.CapacityBufs).Namespace(ns).List(ctx, metav1.ListOptions{})
		return err == nil && len(list.Items) == 0, nil
	})
	require.NoError(t, err, "the gang's CapacityBuffers are taken back once it is handed over")
	assert.Len(t, nodeClaims(t), len(before)+2, "two machines, no spare: %s", nodeClaimsSummary(t))
	cleanUp(t, ns, before)
}
