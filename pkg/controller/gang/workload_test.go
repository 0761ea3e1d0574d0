package gang

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/allocator"
)

// grouped is a gang pod as the webhook admits it on the Workload API path:
// no gate, spec.schedulingGroup naming the gang's PodGroup.
func grouped(p *corev1.Pod) *corev1.Pod {
	p = withUID(ungated(p))
	p.Spec.SchedulingGroup = &corev1.PodSchedulingGroup{PodGroupName: ptr.To(p.Labels[gpudrav1.LabelGang])}
	return p
}

// oneGPUClaim is an unallocated claim for one whole GPU.
func oneGPUClaim(name string) *resourceapi.ResourceClaim {
	return &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", UID: types.UID("uid-" + name)},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{Name: "gpu",
			Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.gpudra.dev", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1}}}}}}
}

// newWorkloadHarness is a round harness on the Workload API path with one
// node n0 of two GPUs.
func newWorkloadHarness(t *testing.T, objs ...runtime.Object) *roundHarness {
	t.Helper()
	h := newRoundHarness(t, objs...)
	h.c.opts.Path = PathWorkload
	h.c.podGroups = cache.NewStore(cache.MetaNamespaceKeyFunc)
	h.addTwoGPUNode(t)
	return h
}

// addTwoGPUNode adds node n0 with two whole GPUs, and the gpu.gpudra.dev
// class, to the informer stand-ins.
func (h *roundHarness) addTwoGPUNode(t *testing.T) {
	t.Helper()
	gpu := func(name string) resourceapi.Device {
		return resourceapi.Device{Name: name, Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"type": {StringValue: ptr.To("gpu")}}}
	}
	require.NoError(t, h.c.slices.Add(&resourceapi.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: "n0-gpus"}, Spec: resourceapi.ResourceSliceSpec{
		Driver: allocator.DriverName, NodeName: ptr.To("n0"), Pool: resourceapi.ResourcePool{Name: "n0", ResourceSliceCount: 1},
		Devices: []resourceapi.Device{gpu("gpu-0"), gpu("gpu-1")}}}))
	require.NoError(t, h.c.classes.Add(&resourceapi.DeviceClass{ObjectMeta: metav1.ObjectMeta{Name: "gpu.gpudra.dev"}, Spec: resourceapi.DeviceClassSpec{
		Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: `device.attributes["gpu.gpudra.dev"].type == "gpu"`}}}}}))
	require.NoError(t, h.c.nodes.Add(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n0", Labels: map[string]string{"kubernetes.io/hostname": "n0"}}}))
}

// syncPodGroups fills the PodGroup informer stand-in from the fake API.
func (h *roundHarness) syncPodGroups(t *testing.T) {
	t.Helper()
	list, err := h.client.SchedulingV1beta1().PodGroups("").List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	var objs []any
	for i := range list.Items {
		objs = append(objs, &list.Items[i])
	}
	require.NoError(t, h.c.podGroups.Replace(objs, ""))
}

// TestWorkloadPathHandsOverInQueueOrder: on the Workload API path a
// complete gang becomes a Workload and a gang PodGroup (minCount = its
// size); no claim is written and no fence is made (the scheduler
// allocates). The gang behind it in the queue wants the same two GPUs: it
// is not handed over while the first one's plan is not yet allocated, so
// the scheduler is not handed two gangs for one set of devices.
func TestWorkloadPathHandsOverInQueueOrder(t *testing.T) {
	later := func(p *corev1.Pod) *corev1.Pod { p.CreationTimestamp = metav1.NewTime(t0.Add(1e9)); return p }
	h := newWorkloadHarness(t,
		grouped(plain("a0", "first", "2", "a0")), grouped(plain("a1", "first", "2", "a1")),
		later(grouped(plain("b0", "second", "2", "b0"))), later(grouped(plain("b1", "second", "2", "b1"))),
		oneGPUClaim("a0"), oneGPUClaim("a1"), oneGPUClaim("b0"), oneGPUClaim("b1"))
	ctx := context.Background()
	require.NoError(t, h.round(t))

	pg, err := h.client.SchedulingV1beta1().PodGroups("ns").Get(ctx, "first", metav1.GetOptions{})
	require.NoError(t, err, "the first gang is handed over")
	require.NotNil(t, pg.Spec.SchedulingPolicy.Gang)
	assert.EqualValues(t, 2, pg.Spec.SchedulingPolicy.Gang.MinCount)
	require.NotNil(t, pg.Spec.WorkloadRef)
	assert.Equal(t, "first", pg.Spec.WorkloadRef.WorkloadName)
	wl, err := h.client.SchedulingV1beta1().Workloads("ns").Get(ctx, "first", metav1.GetOptions{})
	require.NoError(t, err)
	require.Len(t, wl.Spec.PodGroupTemplates, 1)
	assert.EqualValues(t, 2, wl.Spec.PodGroupTemplates[0].SchedulingPolicy.Gang.MinCount)
	assert.Equal(t, "Workload", metav1.GetControllerOf(pg).Kind)
	require.NotNil(t, pg.Spec.SchedulingConstraints, "planned on one node: kept on one node")
	assert.Equal(t, []schedulingv1beta1.TopologyConstraint{{Key: TopologyKeyNode}}, pg.Spec.SchedulingConstraints.Topology)

	_, err = h.client.SchedulingV1beta1().PodGroups("ns").Get(ctx, "second", metav1.GetOptions{})
	assert.Error(t, err, "the second gang waits: the first one's devices are not allocated yet")
	cl, err := h.client.ResourceV1().ResourceClaims("ns").Get(ctx, "a0", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Nil(t, cl.Status.Allocation, "no claim written on the Workload API path")
	rules, err := h.client.ResourceV1().DeviceTaintRules().List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	assert.Empty(t, rules.Items, "no fence on the Workload API path")
	assert.Equal(t, ReasonPodGroupCreated, gangCond(t, h.pod(t, "a0")).Reason)
	assert.Equal(t, gpudrav1.ReasonWaitingForDevices, gangCond(t, h.pod(t, "b0")).Reason)

	// The informer shows the PodGroup; the scheduler has not allocated
	// yet: the second gang still waits.
	h.syncPodGroups(t)
	require.NoError(t, h.round(t))
	_, err = h.client.SchedulingV1beta1().PodGroups("ns").Get(ctx, "second", metav1.GetOptions{})
	assert.Error(t, err, "still behind the first gang")

	// The first gang ended: its claims go; the second is handed over.
	for _, n := range []string{"a0", "a1"} {
		require.NoError(t, h.client.CoreV1().Pods("ns").Delete(ctx, n, metav1.DeleteOptions{}))
		require.NoError(t, h.client.ResourceV1().ResourceClaims("ns").Delete(ctx, n, metav1.DeleteOptions{}))
	}
	require.NoError(t, h.round(t))
	_, err = h.client.SchedulingV1beta1().PodGroups("ns").Get(ctx, "second", metav1.GetOptions{})
	assert.NoError(t, err, "handed over once the devices are free")
}

// TestWorkloadPathFinishesAHalfWrittenHandOff: a leader stopped between
// creating a gang's Workload and its PodGroup. The next leader's round
// creates the PodGroup; before it existed the gang's pods would wait for
// ever.
func TestWorkloadPathFinishesAHalfWrittenHandOff(t *testing.T) {
	wl := &schedulingv1beta1.Workload{ObjectMeta: metav1.ObjectMeta{Name: "g", Namespace: "ns", UID: "uid-wl", Labels: map[string]string{gpudrav1.LabelGang: "g"}}}
	h := newWorkloadHarness(t, grouped(plain("a", "g", "2", "ca")), grouped(plain("b", "g", "2", "cb")),
		oneGPUClaim("ca"), oneGPUClaim("cb"), wl)
	require.NoError(t, h.round(t))
	pg, err := h.client.SchedulingV1beta1().PodGroups("ns").Get(context.Background(), "g", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, types.UID("uid-wl"), metav1.GetControllerOf(pg).UID, "owned by the Workload that was there")

	// A Workload of the gang's name that gpudra did not make (no label) is
	// not adopted: the gang is not handed over on somebody else's terms.
	foreign := wl.DeepCopy()
	foreign.Labels = nil
	h = newWorkloadHarness(t, grouped(plain("a", "g", "2", "ca")), grouped(plain("b", "g", "2", "cb")),
		oneGPUClaim("ca"), oneGPUClaim("cb"), foreign)
	err = h.round(t)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "is not gpudra's")
	_, err = h.client.SchedulingV1beta1().PodGroups("ns").Get(context.Background(), "g", metav1.GetOptions{})
	assert.True(t, apierrors.IsNotFound(err), "no PodGroup for a Workload gpudra did not make")
}

// TestWorkloadPathLeavesOtherPods: a gang pod that names somebody else's
// scheduling group, and a gated pod, do not wait on gpudra on this path.
func TestWorkloadPathLeavesOtherPods(t *testing.T) {
	h := newWorkloadHarness(t)
	own := grouped(plain("a", "g", "1", "ca"))
	other := grouped(plain("b", "g", "1", "cb"))
	other.Spec.SchedulingGroup.PodGroupName = ptr.To("users-own")
	assert.True(t, h.c.waitsOnGpudra(own))
	assert.False(t, h.c.waitsOnGpudra(other))
	assert.False(t, h.c.waitsOnGpudra(plain("c", "g", "1", "cc")), "a gated pod without a scheduling group")
	gone := metav1.NewTime(t0)
	require.NoError(t, h.c.podGroups.Add(&schedulingv1beta1.PodGroup{ObjectMeta: metav1.ObjectMeta{Name: "g", Namespace: "ns", DeletionTimestamp: &gone}}))
	assert.True(t, h.c.waitsOnGpudra(own), "an earlier gang's PodGroup being deleted is not this gang's: it still waits")
	require.NoError(t, h.c.podGroups.Update(&schedulingv1beta1.PodGroup{ObjectMeta: metav1.ObjectMeta{Name: "g", Namespace: "ns"}}))
	assert.False(t, h.c.waitsOnGpudra(own), "its PodGroup exists: handed over")
}

func gangCond(t *testing.T, p *corev1.Pod) corev1.PodCondition {
	t.Helper()
	for _, c := range p.Status.Conditions {
		if c.Type == PodConditionGang {
			return c
		}
	}
	require.Failf(t, "no gang condition", "pod %s: %+v", p.Name, p.Status.Conditions)
	return corev1.PodCondition{}
}

// TestWorkloadPathPlansFromTemplates: the claim controller makes a grouped
// pod's claims from their templates only once the PodGroup exists, so the
// gang is planned from the templates and handed over; waiting for the
// claims, as the gate path does, would wait for ever.
func TestWorkloadPathPlansFromTemplates(t *testing.T) {
	fromTemplate := func(p *corev1.Pod) *corev1.Pod {
		p.Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: ptr.To("one-gpu")}}
		return p
	}
	h := newWorkloadHarness(t, grouped(fromTemplate(plain("a", "g", "2"))), grouped(fromTemplate(plain("b", "g", "2"))))
	h.c.templates = cache.NewStore(cache.MetaNamespaceKeyFunc)
	require.NoError(t, h.round(t))
	_, err := h.client.SchedulingV1beta1().PodGroups("ns").Get(context.Background(), "g", metav1.GetOptions{})
	require.Error(t, err, "no template yet: nothing to plan")
	assert.Contains(t, gangCond(t, h.pod(t, "a")).Message, "ResourceClaimTemplate one-gpu")

	require.NoError(t, h.c.templates.Add(&resourceapi.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Name: "one-gpu", Namespace: "ns"},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: oneGPUClaim("x").Spec}}))
	h.c.reported = map[string]string{}
	require.NoError(t, h.round(t))
	_, err = h.client.SchedulingV1beta1().PodGroups("ns").Get(context.Background(), "g", metav1.GetOptions{})
	require.NoError(t, err, "planned from the template and handed over")
}

// TestGangPriorityClass: the PodGroup takes its pods' PriorityClass; a
// PodGroup without it, for pods with one, is refused by kube-scheduler
// (seen in e2e: "all pods in a single pod group should have the same
// priority as the pod group's priority, got 1000 and 0").
func TestGangPriorityClass(t *testing.T) {
	prio := func(p *corev1.Pod, class string, v int32) *corev1.Pod {
		p.Spec.PriorityClassName, p.Spec.Priority = class, ptr.To(v)
		return p
	}
	assert.Equal(t, "", gangPriorityClass(&Gang{Pods: []*corev1.Pod{plain("a", "g", "2"), plain("b", "g", "2")}}))
	assert.Equal(t, "high", gangPriorityClass(&Gang{Pods: []*corev1.Pod{prio(plain("a", "g", "2"), "high", 1000), prio(plain("b", "g", "2"), "high", 1000)}}))
	assert.Equal(t, "high", gangPriorityClass(&Gang{Pods: []*corev1.Pod{prio(plain("a", "g", "2"), "low", 1), prio(plain("b", "g", "2"), "high", 1000)}}))
}

// TestRoundAdmitsInOneBatch: on the gate path, two reservations that fit in
// one round are written behind one fence and one settle: one check of the
// claims against the API server for both, not one each (each admission
// waited for the one before it: at most one per second cluster-wide).
func TestRoundAdmitsInOneBatch(t *testing.T) {
	h := newWorkloadHarness(t)
	h.c.opts.Path = PathGates
	h.c.committer.settle = 10 * time.Millisecond
	for _, name := range []string{"a", "b"} {
		r := &gpudrav1.GpuReservation{TypeMeta: metav1.TypeMeta{APIVersion: gpudrav1.APIVersion, Kind: gpudrav1.KindGpuReservation},
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", UID: types.UID("uid-" + name), CreationTimestamp: metav1.NewTime(t0)},
			Spec:       gpudrav1.GpuReservationSpec{DeviceClassName: "gpu.gpudra.dev", Claims: 1, Count: 1, TTL: metav1.Duration{Duration: time.Hour}}}
		u, err := gpudrav1.ToUnstructured(r)
		require.NoError(t, err)
		require.NoError(t, h.c.reservations.Add(u))
	}
	lists := 0
	h.client.PrependReactor("list", "resourceclaims", func(k8stesting.Action) (bool, runtime.Object, error) {
		lists++
		return false, nil, nil
	})
	_ = h.round(t) // the fake dynamic client has no reservations to write statuses to
	lists--        // the harness's own sync
	assert.Equal(t, 1, lists, "one check for the round's batch")
	for _, name := range []string{"a-0", "b-0"} {
		cl, err := h.client.ResourceV1().ResourceClaims("ns").Get(context.Background(), name, metav1.GetOptions{})
		require.NoError(t, err)
		assert.NotNil(t, cl.Status.Allocation, "claim %s written", name)
	}
}

// TestCommitWaitsForAPodTheSchedulerIsBinding: kube-scheduler chose a
// device for pod "single" at Reserve and nominated its node, but has not
// written the claim yet (its PreBind waits on a slow volume). The gate
// path's check against the API server cannot see that choice: the commit
// waits (planned again) until the pod is bound and its claim written, and
// then plans around it. Without the wait, the gang's claim would have been
// written with the device the scheduler is about to write too.
func TestCommitWaitsForAPodTheSchedulerIsBinding(t *testing.T) {
	single := withUID(ungated(pod("single", nil, nil, "cs")))
	single.Status.NominatedNodeName = "n0"
	h := newWorkloadHarness(t, withUID(plain("a", "g", "1", "ca")), single, oneGPUClaim("ca"), oneGPUClaim("cs"))
	h.c.opts.Path = PathGates
	h.c.committer.settle = 0
	h.c.committer.binding = h.c.binding
	ctx := context.Background()
	require.NoError(t, h.round(t))
	cl, err := h.client.ResourceV1().ResourceClaims("ns").Get(ctx, "ca", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Nil(t, cl.Status.Allocation, "not written while the scheduler binds a pod to the node")
	assert.Contains(t, gangCond(t, h.pod(t, "a")).Message, "kube-scheduler is binding pod ns/single")

	// The scheduler wrote gpu-0 into its claim and bound the pod.
	cs := allocatedClaim("cs", "gpu-0")
	_, err = h.client.ResourceV1().ResourceClaims("ns").UpdateStatus(ctx, cs, metav1.UpdateOptions{})
	require.NoError(t, err)
	single.Spec.NodeName = "n0"
	_, err = h.client.CoreV1().Pods("ns").Update(ctx, single, metav1.UpdateOptions{})
	require.NoError(t, err)
	h.c.reported = map[string]string{}
	require.NoError(t, h.round(t))
	cl, err = h.client.ResourceV1().ResourceClaims("ns").Get(ctx, "ca", metav1.GetOptions{})
	require.NoError(t, err)
	require.NotNil(t, cl.Status.Allocation, "planned around the scheduler's device")
	assert.Equal(t, "gpu-1", cl.Status.Allocation.Devices.Results[0].Device)
}
