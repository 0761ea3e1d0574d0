package e2e

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/pkg/plugin"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// TestMigDevicesNodeAnnotation: a DGX H100 in MIG mode annotated
// gpu.gpudra.dev/mig-devices=profiles=3g.40gb publishes, per GPU, the whole
// GPU and the two 3g.40gb placements only (not 25), with their counters;
// the real plugin reads the annotation from its Node as the chart's
// ServiceAccount.
func TestMigDevicesNodeAnnotation(t *testing.T) {
	ctx := context.Background()
	const name = "dgx-h100-3g"
	n, err := cluster.AddNode(ctx, devcluster.NodeOptions{Name: name, Machine: "dgx-h100",
		Annotations: map[string]string{plugin.AnnotationMigDevices: "profiles=3g.40gb"},
		// Kept out of the other tests' way: no pod of theirs lands here.
		Taints: []v1.Taint{{Key: "gpu.gpudra.dev/e2e", Value: "mig-policy", Effect: v1.TaintEffectNoSchedule}}})
	require.NoError(t, err)
	require.NoError(t, n.WaitForSlices(ctx))
	list, err := cluster.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + name})
	require.NoError(t, err)
	profiles := map[string]int{}
	gpus, counterSets := 0, 0
	for _, s := range list.Items {
		counterSets += len(s.Spec.SharedCounters)
		for _, d := range s.Spec.Devices {
			switch *d.Attributes["type"].StringValue {
			case slicebuilder.TypeGPU:
				gpus++
			case slicebuilder.TypeMIG:
				profiles[*d.Attributes["migProfile"].StringValue]++
			}
		}
	}
	assert.Equal(t, 8, gpus, "the whole GPUs stay")
	assert.Equal(t, map[string]int{"3g.40gb": 16}, profiles, "only the annotated profile: two placements per GPU")
	assert.Equal(t, 8, counterSets, "MIG mode: a counter set per GPU")
}
