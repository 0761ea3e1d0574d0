package karpenter_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
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
			apply(t, ns, example(tt.example))
			pod := waitRunning(t, ns, tt.pod, 4*time.Minute)
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
