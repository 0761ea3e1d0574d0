package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpudra/gpudra/pkg/controller"
)

// doublyAllocated lists every exclusive device that two allocated claims of
// the cluster hold ("pool/device: ns/a, ns/b"), or none.
func doublyAllocated(ctx context.Context) ([]string, error) {
	list, err := cluster.Client.ResourceV1().ResourceClaims("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	holders := map[string][]string{}
	for _, cl := range list.Items {
		if cl.Status.Allocation == nil {
			continue
		}
		for _, r := range cl.Status.Allocation.Devices.Results {
			if r.ShareID != nil || (r.AdminAccess != nil && *r.AdminAccess) {
				continue
			}
			d := r.Pool + "/" + r.Device
			holders[d] = append(holders[d], cl.Namespace+"/"+cl.Name)
		}
	}
	var out []string
	for d, cls := range holders {
		if len(cls) > 1 {
			out = append(out, d+": "+strings.Join(cls, ", "))
		}
	}
	return out, nil
}

// allocationWriter is the field manager that wrote a claim's
// status.allocation.
func allocationWriter(cl *resourceapi.ResourceClaim) string {
	for _, mf := range cl.ManagedFields {
		if mf.Subresource == "status" && mf.FieldsV1 != nil && strings.Contains(string(mf.FieldsV1.Raw), `"f:allocation"`) {
			return mf.Manager
		}
	}
	return ""
}

// TestWorkloadPathSharedClaimsNeverDoubleAllocated is issue 35's item 0
// without Grove: one gang of four pods on the Workload API path whose pods
// share two claims in pairs and each hold one more, on one 8-GPU node, round
// after round. kube-scheduler allocating claims that several pods of one
// PodGroup share gave one GPU to two of them (kubernetes/kubernetes#140053,
// #140269); gpudra writes those claims from its own plan before it hands the
// PodGroup over. No device may be in two claims, and every round's pods run.
func TestWorkloadPathSharedClaimsNeverDoubleAllocated(t *testing.T) {
	onGangPath(t, controller.GangModeAuto)
	ns := namespace(t)
	ctx := context.Background()
	create(t, ns, gpus("own-gpu", 1))
	const rounds = 20
	for round := range rounds {
		// Two gangs at once, seven of the node's eight GPUs: pairs-N (four
		// pods, two shared claims, one own claim each) and solo-N (two pods
		// sharing one claim).
		var pods []string
		for _, gang := range []struct {
			name   string
			shared []string
			own    bool
		}{{fmt.Sprintf("pairs-%d", round), []string{"a", "a", "b", "b"}, true}, {fmt.Sprintf("solo-%d", round), []string{"c", "c"}, false}} {
			for _, claim := range []string{gang.shared[0], gang.shared[len(gang.shared)-1]} {
				claimName := fmt.Sprintf("%s-shared-%s", gang.name, claim)
				_, err := cluster.Client.ResourceV1().ResourceClaims(ns).Create(ctx, &resourceapi.ResourceClaim{
					ObjectMeta: metav1.ObjectMeta{Name: claimName},
					Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{Name: "gpu",
						Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.gpudra.dev", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1}}}}},
				}, metav1.CreateOptions{})
				if !apierrors.IsAlreadyExists(err) {
					require.NoError(t, err)
				}
			}
			for i, claim := range gang.shared {
				name := fmt.Sprintf("%s-%d", gang.name, i)
				p := gangPod(name, gang.name, len(gang.shared), "own-gpu", pinned(nomigNode))
				if !gang.own {
					p.Spec.ResourceClaims, p.Spec.Containers[0].Resources.Claims = nil, nil
				}
				p.Spec.ResourceClaims = append(p.Spec.ResourceClaims, v1.PodResourceClaim{Name: "shared", ResourceClaimName: ptr(fmt.Sprintf("%s-shared-%s", gang.name, claim))})
				p.Spec.Containers[0].Resources.Claims = append(p.Spec.Containers[0].Resources.Claims, v1.ResourceClaim{Name: "shared"})
				_, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{})
				require.NoError(t, err)
				pods = append(pods, name)
			}
		}
		var doubles []string
		err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
			var err error
			if doubles, err = doublyAllocated(ctx); err != nil || len(doubles) > 0 {
				return len(doubles) > 0, nil
			}
			list, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, nil
			}
			running := 0
			for _, p := range list.Items {
				if p.Status.Phase == v1.PodRunning {
					running++
				}
			}
			return running == len(pods), nil
		})
		require.Empty(t, doubles, "round %d: devices in two claims: %s", round, podStates(ns))
		require.NoError(t, err, "round %d: the gang's pods run: %s", round, podStates(ns))
		// gpudra wrote the shared claims from its plan; kube-scheduler
		// allocated each pod's own claim.
		pod, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, fmt.Sprintf("pairs-%d-0", round), metav1.GetOptions{})
		require.NoError(t, err)
		require.Len(t, pod.Status.ResourceClaimStatuses, 1, "the pod's own claim, made from its template")
		own, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, *pod.Status.ResourceClaimStatuses[0].ResourceClaimName, metav1.GetOptions{})
		require.NoError(t, err)
		shared, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, fmt.Sprintf("pairs-%d-shared-a", round), metav1.GetOptions{})
		require.NoError(t, err)
		require.NotEmpty(t, allocationWriter(own))
		assert.NotEqual(t, allocationWriter(own), allocationWriter(shared),
			"round %d: the shared claim was allocated by gpudra's controller, not by kube-scheduler (%s)", round, allocationWriter(own))

		// Next round on a free node: the pods and their claims go.
		for _, name := range pods {
			require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: ptr[int64](0)}))
		}
		for _, name := range pods {
			waitPodGone(t, ns, name)
		}
		require.NoError(t, cluster.Client.ResourceV1().ResourceClaims(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}))
		require.NoError(t, wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
			list, err := cluster.Client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, nil
			}
			n := 0
			for _, cl := range list.Items {
				if cl.Status.Allocation != nil {
					n++
				}
			}
			return n == 0, nil
		}), "round %d: claims released", round)
	}
}

// allocatedLike creates claim name with like's spec and gives it like's
// allocation, as kube-scheduler did when it gave one device to two claims;
// age, when not 0, makes the allocation that much older than like's.
func allocatedLike(t *testing.T, ns, name string, like *resourceapi.ResourceClaim, age time.Duration) {
	t.Helper()
	ctx := context.Background()
	cl, err := cluster.Client.ResourceV1().ResourceClaims(ns).Create(ctx, &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Finalizers: []string{resourceapi.Finalizer}}, Spec: like.Spec}, metav1.CreateOptions{})
	require.NoError(t, err)
	cl.Status.Allocation = like.Status.Allocation.DeepCopy()
	if age != 0 {
		cl.Status.Allocation.AllocationTimestamp = ptr(metav1.NewTime(like.Status.Allocation.AllocationTimestamp.Add(-age)))
	}
	_, err = cluster.Client.ResourceV1().ResourceClaims(ns).UpdateStatus(ctx, cl, metav1.UpdateOptions{})
	require.NoError(t, err)
}

// waitTakenBack waits until the claim's allocation is gone.
func waitTakenBack(t *testing.T, ns, name, msg string) {
	t.Helper()
	require.NoError(t, wait.PollUntilContextTimeout(context.Background(), 200*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		cl, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, name, metav1.GetOptions{})
		return err == nil && cl.Status.Allocation == nil, nil
	}), msg)
}

// TestDoubleAllocationRepairedOnAnyPath: a claim that holds a device
// another claim's running pod uses, and that no pod uses (what
// kube-scheduler left behind in issue 35's item 0), is taken back by the
// controller, with a Warning Event, whoever allocated it, and the running
// pod's claim keeps its device.
func TestDoubleAllocationRepairedOnAnyPath(t *testing.T) {
	ns := namespace(t)
	ctx := context.Background()
	running0 := gpuPod("running", "one-gpu")
	pinned(nomigNode)(running0)
	create(t, ns, gpus("one-gpu", 1), running0)
	running := waitRunning(t, ns, "running")
	require.Len(t, running.Status.ResourceClaimStatuses, 1)
	held, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, *running.Status.ResourceClaimStatuses[0].ResourceClaimName, metav1.GetOptions{})
	require.NoError(t, err)

	// A second claim given the same device, as the scheduler did.
	allocatedLike(t, ns, "stale", held, 0)
	waitTakenBack(t, ns, "stale", "the allocation nobody uses is taken back")
	cl, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, held.Name, metav1.GetOptions{})
	require.NoError(t, err)
	require.NotNil(t, cl.Status.Allocation, "the running pod's stays")
	events, err := cluster.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=stale"})
	require.NoError(t, err)
	found := false
	for _, e := range events.Items {
		found = found || (e.Reason == "DoubleAllocationRepaired" && e.Type == v1.EventTypeWarning)
	}
	assert.True(t, found, "a Warning Event on the claim says so: %v", events.Items)

	doubles, err := doublyAllocated(ctx)
	require.NoError(t, err)
	assert.Empty(t, doubles)

	// kube-scheduler's allocated-device set dropped the running pod's GPU
	// when the stale allocation was taken back, though the running claim
	// still holds it: gpudra fences that GPU until the claim ends, so a pod
	// now using "stale" gets another (docs/gangs.md, repair).
	user := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "user"}, Spec: v1.PodSpec{RestartPolicy: v1.RestartPolicyNever,
		NodeSelector: map[string]string{"kubernetes.io/hostname": nomigNode},
		Containers: []v1.Container{{Name: "cuda", Image: "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04",
			Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu"}}}}},
		ResourceClaims: []v1.PodResourceClaim{{Name: "gpu", ResourceClaimName: ptr("stale")}}}}
	create(t, ns, nil, user)
	waitRunning(t, ns, "user")
	reused, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, "stale", metav1.GetOptions{})
	require.NoError(t, err)
	require.NotNil(t, reused.Status.Allocation)
	assert.NotEqual(t, held.Status.Allocation.Devices.Results[0].Device, reused.Status.Allocation.Devices.Results[0].Device,
		"the stale claim's pod is not given the running pod's GPU again")
	require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(ctx, "user", metav1.DeleteOptions{GracePeriodSeconds: ptr[int64](0)}))
	waitPodGone(t, ns, "user")
	// Leave the node clean.
	require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(ctx, "running", metav1.DeleteOptions{GracePeriodSeconds: ptr[int64](0)}))
	waitPodGone(t, ns, "running")
}
