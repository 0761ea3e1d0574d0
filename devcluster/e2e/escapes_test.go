package e2e

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// shareRequest is a request for a share of the fractional node's GPU.
func shareRequest(name, memory, multiprocessors string) resourceapi.DeviceRequest {
	caps := map[resourceapi.QualifiedName]resource.Quantity{"memory": resource.MustParse(memory)}
	if multiprocessors != "" {
		caps["multiprocessors"] = resource.MustParse(multiprocessors)
	}
	return resourceapi.DeviceRequest{Name: name, Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.gpudra.dev",
		Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: `device.attributes["gpu.gpudra.dev"].sharing == "fractional"`}}},
		Capacity:  &resourceapi.CapacityRequirements{Requests: caps}}}
}

// onFractionalNode puts a pod on the fractional node.
func onFractionalNode(p *v1.Pod) *v1.Pod {
	p.Spec.NodeSelector = map[string]string{"gpu.gpudra.dev/fractional": "true"}
	p.Spec.Tolerations = []v1.Toleration{{Key: "gpu.gpudra.dev/fractional", Operator: v1.TolerationOpExists, Effect: v1.TaintEffectNoSchedule}}
	return p
}

// waitPrepareFailed waits for the pod's FailedPrepareDynamicResources
// event and returns its message. A kubelet that fetches the claim before
// the Node authorizer's graph has seen the pod bound is refused once ("no
// relationship found between node ..."), and retries: that event is not the
// one asked for.
func waitPrepareFailed(t *testing.T, ns, pod string) string {
	t.Helper()
	var msg string
	err := wait.PollUntilContextTimeout(context.Background(), 200*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		events, err := cluster.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		for _, e := range events.Items {
			if e.InvolvedObject.Name == pod && e.Reason == "FailedPrepareDynamicResources" && !strings.Contains(e.Message, "no relationship found between node") {
				msg = e.Message
				return true, nil
			}
		}
		return false, nil
	})
	require.NoError(t, err, "no FailedPrepareDynamicResources event on pod %s", pod)
	return msg
}

// TestEscapeFromAShareIsRefused: the webhook cannot know the share (it is
// allocated after admission), so it accepts these configs; the plugin
// refuses them at prepare, naming the field, with the same validation.
func TestEscapeFromAShareIsRefused(t *testing.T) {
	const head = `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":`
	tests := []struct {
		name    string
		config  string
		wantErr string
	}{
		{"time-slicing", head + `{"strategy":"TimeSlicing","timeSlicing":{"interval":"Long"}}}`,
			"sharing.strategy: Forbidden: TimeSlicing is not allowed on a share of device gpu-0"},
		{"thread-percentage", head + `{"strategy":"MPS","mps":{"activeThreadPercentage":50}}}`,
			"sharing.mps.activeThreadPercentage: Invalid value: 50: exceeds the share of device gpu-0 (33 of 132 multiprocessors: at most 25)"},
		{"pinned-memory", head + `{"strategy":"MPS","mps":{"pinnedMemoryLimit":"20Gi"}}}`,
			`sharing.mps.pinnedMemoryLimit: Invalid value: "20Gi": exceeds the share of device gpu-0 (10240Mi)`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ns := namespace(t)
			tmpl := template("escape", shareRequest("gpu", "10Gi", "33"), nil,
				[]resourceapi.DeviceClaimConfiguration{{DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{
					Driver: slicebuilder.DriverName, Parameters: runtime.RawExtension{Raw: []byte(tt.config)}}}}})
			// Admitted: the webhook validates the static part only.
			create(t, ns, tmpl, onFractionalNode(gpuPod("escape", "escape")))
			msg := waitPrepareFailed(t, ns, "escape")
			assert.Contains(t, msg, tt.wantErr)
			pod, err := cluster.Client.CoreV1().Pods(ns).Get(context.Background(), "escape", metav1.GetOptions{})
			require.NoError(t, err)
			assert.NotEqual(t, v1.PodRunning, pod.Status.Phase)
		})
	}
}

// TestFractionalTwoSharesInOneClaim: two requests of one claim, each a share
// of the one fractional GPU, are two CDI devices and both prepare.
func TestFractionalTwoSharesInOneClaim(t *testing.T) {
	ns := namespace(t)
	tmpl := template("two-shares", shareRequest("first", "10Gi", ""), nil, nil)
	tmpl.Spec.Spec.Devices.Requests = append(tmpl.Spec.Spec.Devices.Requests, shareRequest("second", "12Gi", ""))
	pod := onFractionalNode(gpuPod("two-shares", "two-shares"))
	create(t, ns, tmpl, pod)
	running := waitRunning(t, ns, "two-shares")
	claim := podClaim(t, running, "gpu")
	results := claim.Status.Allocation.Devices.Results
	require.Len(t, results, 2)
	assert.Equal(t, results[0].Device, results[1].Device, "both shares of the one GPU")
	require.NotNil(t, results[0].ShareID)
	require.NotNil(t, results[1].ShareID)
	assert.NotEqual(t, *results[0].ShareID, *results[1].ShareID)

	v := views(t, running)["cuda"]
	var own []string // the claim's own CDI devices (not the node's common driver device)
	for _, id := range v.CDIDevices {
		if strings.Contains(id, "/claim="+string(claim.UID)) {
			own = append(own, id)
		}
	}
	require.Len(t, own, 2, "one CDI device per share: %v", v.CDIDevices)
	assert.NotEqual(t, own[0], own[1])
	assert.Len(t, v.GPUs, 1, "one GPU seen: %v", v.GPUs)
}

// TestAdminAccessBesideARunningClaim: a claim with admin access to a GPU
// that a running pod's claim uses is prepared beside it (not a use of the
// device) and gets the monitoring view: the GPU's device node, no limits.
// It runs on the fractional node: there a GPU in use by a share still
// allocates (allowMultipleAllocations). A whole GPU of a DGX node consumes
// its counter set, and the scheduler's allocator (k8s 1.37) checks counters
// for admin-access requests too, so admin access to a GPU in use there is
// not allocated at all; the plugin side is covered by
// pkg/plugin.TestAdminAccessBesideARunningClaim.
func TestAdminAccessBesideARunningClaim(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t)
	// Admin access is allowed only in namespaces labelled for it.
	nsObj, err := cluster.Client.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
	require.NoError(t, err)
	if nsObj.Labels == nil {
		nsObj.Labels = map[string]string{}
	}
	nsObj.Labels["resource.kubernetes.io/admin-access"] = "true"
	_, err = cluster.Client.CoreV1().Namespaces().Update(ctx, nsObj, metav1.UpdateOptions{})
	require.NoError(t, err)

	user := template("user", shareRequest("gpu", "10Gi", "33"), nil, nil)
	create(t, ns, user, onFractionalNode(gpuPod("user", "user")))
	userPod := waitRunning(t, ns, "user")
	r := podClaim(t, userPod, "gpu").Status.Allocation.Devices.Results[0]
	minor, err := strconv.Atoi(strings.TrimPrefix(r.Device, "gpu-"))
	require.NoError(t, err, "a whole GPU: %s", r.Device)

	yes := true
	admin := template("admin", resourceapi.DeviceRequest{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.gpudra.dev",
		AdminAccess: &yes,
		// The scheduler charges admin access capacity too: without a
		// request it would take the whole GPU's memory (the default).
		Capacity: &resourceapi.CapacityRequirements{Requests: map[resourceapi.QualifiedName]resource.Quantity{"memory": resource.MustParse("1Gi")}},
		Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
			Expression: fmt.Sprintf(`device.attributes["gpu.gpudra.dev"].minor == %d`, minor)}}}}}, nil, nil)
	adminPod := onFractionalNode(gpuPod("admin", "admin"))
	adminPod.Spec.Affinity = &v1.Affinity{NodeAffinity: &v1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &v1.NodeSelector{
		NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchFields: []v1.NodeSelectorRequirement{{Key: "metadata.name", Operator: v1.NodeSelectorOpIn, Values: []string{userPod.Spec.NodeName}}}}}}}}
	create(t, ns, admin, adminPod)
	running := waitRunning(t, ns, "admin")
	ar := podClaim(t, running, "gpu").Status.Allocation.Devices.Results[0]
	assert.Equal(t, r.Device, ar.Device, "the same GPU as the running claim")
	require.NotNil(t, ar.AdminAccess)
	assert.True(t, *ar.AdminAccess)

	v := views(t, running)["cuda"]
	assert.Contains(t, v.DeviceNodes, fmt.Sprintf("/dev/nvidia%d", minor), "the GPU's device node")
	for k := range v.Env {
		assert.False(t, strings.HasPrefix(k, "CUDA_MPS_"), "no limits for admin access: %s", k)
	}
	assert.Contains(t, views(t, userPod)["cuda"].Env, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "the share is capped")
	assert.Equal(t, views(t, userPod)["cuda"].GPUs, v.GPUs, "the GPU the running claim uses")

	// The admin pod goes; the user's pod keeps running.
	require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(ctx, "admin", metav1.DeleteOptions{}))
	waitPodGone(t, ns, "admin")
	still, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, "user", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, v1.PodRunning, still.Status.Phase)
}
