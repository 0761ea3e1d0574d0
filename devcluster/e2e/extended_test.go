package e2e

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// A DeviceClass with extendedResourceName (the chart's
// deviceClasses.gpu.extendedResourceName) serves pods that ask for a plain
// extended resource through DRA: the scheduler makes the claim, the kubelet
// prepares it with the plugin, the container sees one GPU.
func TestExtendedResourceServedByDRA(t *testing.T) {
	ctx := context.Background()
	class := &resourceapi.DeviceClass{
		ObjectMeta: metav1.ObjectMeta{Name: "extended.gpudra.dev"},
		Spec: resourceapi.DeviceClassSpec{
			Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
				Expression: `device.driver == "gpu.gpudra.dev" && device.attributes["gpu.gpudra.dev"].type == "gpu" && !("sharing" in device.attributes["gpu.gpudra.dev"])`}}},
			ExtendedResourceName: ptr("gpudra.dev/gpu"),
		},
	}
	_, err := cluster.Client.ResourceV1().DeviceClasses().Create(ctx, class, metav1.CreateOptions{})
	require.NoError(t, err)
	defer func() {
		_ = cluster.Client.ResourceV1().DeviceClasses().Delete(ctx, class.Name, metav1.DeleteOptions{})
	}()

	ns := namespace(t)
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "plain-request"},
		Spec: v1.PodSpec{RestartPolicy: v1.RestartPolicyNever, Containers: []v1.Container{{
			Name: "cuda", Image: "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04",
			Resources: v1.ResourceRequirements{
				Requests: v1.ResourceList{"gpudra.dev/gpu": resource.MustParse("1")},
				Limits:   v1.ResourceList{"gpudra.dev/gpu": resource.MustParse("1")},
			},
		}}},
	}
	create(t, ns, nil, pod)
	running := waitRunning(t, ns, "plain-request")
	require.NotNil(t, running.Status.ExtendedResourceClaimStatus, "the scheduler made a claim for the extended resource")
	assert.Len(t, views(t, running)["cuda"].VisibleGPUs(), 1, "the container sees one GPU")
}
