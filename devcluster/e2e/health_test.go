package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/plugin"
)

// A GPU that turns unhealthy: the plugin taints its device (NoExecute on
// this node), the real device-taint eviction controller evicts the pod that
// uses it, the kubelet unprepares the claim, and the next pod gets another
// GPU. When the GPU recovers, the taint goes.
func TestUnhealthyGPUIsTaintedAndItsPodEvicted(t *testing.T) {
	ctx := context.Background()
	const nodeName = "health-0"
	node := cluster.Node(nodeName)
	if node == nil {
		var err error
		node, err = cluster.AddNode(ctx, nodeagent.NodeOptions{Name: nodeName, Machine: "dgx-h100-nomig",
			UnhealthyTaintEffect: resourceapi.DeviceTaintEffectNoExecute,
			Taints:               []v1.Taint{{Key: "gpudra.dev/e2e-health", Value: "true", Effect: v1.TaintEffectNoSchedule}}})
		require.NoError(t, err)
		require.NoError(t, node.WaitForSlices(ctx))
	}
	ns := namespace(t)
	onHealthNode := func(name string) *v1.Pod {
		p := gpuPod(name, "one-gpu")
		p.Spec.NodeSelector = map[string]string{"kubernetes.io/hostname": nodeName}
		p.Spec.Tolerations = []v1.Toleration{{Key: "gpudra.dev/e2e-health", Operator: v1.TolerationOpExists}}
		return p
	}
	create(t, ns, template("one-gpu", resourceapi.DeviceRequest{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.gpudra.dev"}}, nil, nil),
		onHealthNode("victim"))
	pod := waitRunning(t, ns, "victim")
	claim := podClaim(t, pod, "gpu")
	dev := claim.Status.Allocation.Devices.Results[0].Device
	uuid := attr(device(t, nodeName, dev), "uuid")

	require.NoError(t, node.Machine.InjectXID(uuid, "", 48)) // double-bit ECC error
	var taints []resourceapi.DeviceTaint
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 20*time.Second, true, func(ctx context.Context) (bool, error) {
		taints = device(t, nodeName, dev).Taints
		return len(taints) > 0, nil
	})
	require.NoError(t, err, "device %s was not tainted", dev)
	assert.Equal(t, plugin.UnhealthyTaintKey, taints[0].Key)
	assert.Equal(t, "xid-48", taints[0].Value)
	assert.Equal(t, resourceapi.DeviceTaintEffectNoExecute, taints[0].Effect)

	// Evicted by the device-taint eviction controller, then unprepared.
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, "victim", metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	})
	require.NoError(t, err, "the pod on the unhealthy GPU was not evicted")
	assert.False(t, hasSpecFor(t, nodeName, string(claim.UID)), "its claim was unprepared")

	// The next pod lands on a healthy GPU.
	create(t, ns, nil, onHealthNode("survivor"))
	next := podClaim(t, waitRunning(t, ns, "survivor"), "gpu")
	assert.NotEqual(t, dev, next.Status.Allocation.Devices.Results[0].Device)

	// XID 48 (double-bit ECC) needs a GPU reset before the GPU is trusted:
	// the taint stays until then.
	require.ErrorIs(t, node.Machine.RecoverGPU(uuid), sim.ErrResetRequired)
	require.NoError(t, node.Machine.ResetGPU(uuid))
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 20*time.Second, true, func(ctx context.Context) (bool, error) {
		return len(device(t, nodeName, dev).Taints) == 0, nil
	})
	assert.NoError(t, err, "the taint did not go when the GPU recovered")
}
