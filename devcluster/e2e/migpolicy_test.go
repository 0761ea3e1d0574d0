package e2e

import (
	"context"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpudra/gpudra/devcluster/nodeagent"
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
	n, err := cluster.AddNode(ctx, nodeagent.NodeOptions{Name: name, Machine: "dgx-h100",
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

// TestNarrowedMigPolicyKeepsPreparedMigDevice (issue 35): a node's policy
// narrowed by its annotation while a pod holds a MIG device the plugin
// created (profile 3g.40gb, policy then profiles=1g.10gb) keeps that device
// published at its placement, consuming its counters, until the pod is
// gone: a pod asking for the whole GPU is not offered it meanwhile (it
// would be, and fail at prepare, were the device withdrawn), the first pod
// keeps running, and once it is deleted the device is withdrawn and the
// whole GPU handed out.
func TestNarrowedMigPolicyKeepsPreparedMigDevice(t *testing.T) {
	ctx := context.Background()
	const name, taint = "one-h100-narrowed", "gpu.gpudra.dev/e2e"
	machine := filepath.Join(t.TempDir(), "one-h100-mig.yaml")
	require.NoError(t, os.WriteFile(machine, []byte("name: one-h100-mig\ngpuModel: h100-sxm5\ngpuCount: 1\nnvlink: none\nmigEnabled: all\n"), 0o600))
	node, err := cluster.AddNode(ctx, nodeagent.NodeOptions{Name: name, Machine: machine,
		Taints: []v1.Taint{{Key: taint, Value: "mig-narrowed", Effect: v1.TaintEffectNoSchedule}}})
	require.NoError(t, err)
	require.NoError(t, node.WaitForSlices(ctx))
	ns := namespace(t)
	onNode := func(p *v1.Pod) *v1.Pod {
		p.Spec.NodeSelector = map[string]string{"kubernetes.io/hostname": name}
		p.Spec.Tolerations = []v1.Toleration{{Key: taint, Operator: v1.TolerationOpExists}}
		return p
	}
	create(t, ns, template("mig-3g", resourceapi.DeviceRequest{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{
		DeviceClassName: "mig.gpudra.dev", Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
			Expression: `device.attributes["gpu.gpudra.dev"].migProfile == "3g.40gb"`}}}}}, nil, nil),
		onNode(gpuPod("mig", "mig-3g")))
	mig := waitRunning(t, ns, "mig")
	prepared := podClaim(t, mig, "gpu").Status.Allocation.Devices.Results[0].Device
	migUUID := views(t, mig)["cuda"].VisibleGPUs()[0]

	// Narrow the policy as docs/scale.md says: annotate, restart the plugin.
	patch := `{"metadata":{"annotations":{"` + plugin.AnnotationMigDevices + `":"profiles=1g.10gb"}}}`
	_, err = cluster.Client.CoreV1().Nodes().Patch(ctx, name, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
	require.NoError(t, err)
	require.NoError(t, node.RestartPlugin())
	var published map[string]resourceapi.Device
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		published = nodeDevices(t, name)
		return published["gpu-0-mig-7g-80gb-0"].Name == "" && published["gpu-0-mig-1g-10gb-0"].Name != "", nil
	})
	require.NoError(t, err, "the narrowed policy did not take effect: %v", slices.Sorted(maps.Keys(published)))

	create(t, ns, template("whole", resourceapi.DeviceRequest{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{
		DeviceClassName: "gpu.gpudra.dev"}}, nil, nil), onNode(gpuPod("whole", "whole")))
	// The scheduler's first word on it: unschedulable, and it stays so.
	var whole *v1.Pod
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		whole, err = cluster.Client.CoreV1().Pods(ns).Get(ctx, "whole", metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for _, c := range whole.Status.Conditions {
			if c.Type == v1.PodScheduled {
				return true, nil
			}
		}
		return whole.Spec.NodeName != "", nil
	})
	require.NoError(t, err, "the scheduler did not decide on pod whole: %s", describe(whole))
	time.Sleep(2 * time.Second)
	whole, err = cluster.Client.CoreV1().Pods(ns).Get(ctx, "whole", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Empty(t, whole.Spec.NodeName, "the whole GPU under the running MIG device was handed out: %s", describe(whole))
	assert.Equal(t, v1.PodPending, whole.Status.Phase)
	dev, ok := nodeDevices(t, name)[prepared]
	if assert.True(t, ok, "the prepared %s is still published", prepared) {
		assert.NotEmpty(t, dev.ConsumesCounters, "%s consumes its counters", prepared)
	}
	mig, err = cluster.Client.CoreV1().Pods(ns).Get(ctx, "mig", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, v1.PodRunning, mig.Status.Phase, "the MIG pod keeps running")
	assert.Equal(t, 1, migCount(t, node, migUUID), "its MIG device survives the restart")

	// Released: the device is withdrawn and the whole GPU free.
	require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(ctx, "mig", metav1.DeleteOptions{}))
	waitPodGone(t, ns, "mig")
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, still := nodeDevices(t, name)[prepared]
		return !still, nil
	})
	assert.NoError(t, err, "the released %s is still published", prepared)
	waitRunning(t, ns, "whole")
}

// nodeDevices are the devices the node publishes, by name.
func nodeDevices(t *testing.T, node string) map[string]resourceapi.Device {
	t.Helper()
	list, err := cluster.Client.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{FieldSelector: "spec.nodeName=" + node})
	require.NoError(t, err)
	out := map[string]resourceapi.Device{}
	for _, s := range list.Items {
		for _, d := range s.Spec.Devices {
			out[d.Name] = d
		}
	}
	return out
}
