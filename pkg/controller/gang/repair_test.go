package gang

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// reservedFor reserves a claim for a pod.
func reservedFor(cl *resourceapi.ResourceClaim, p *corev1.Pod) *resourceapi.ResourceClaim {
	cl.Status.ReservedFor = append(cl.Status.ReservedFor, resourceapi.ResourceClaimConsumerReference{Resource: "pods", Name: p.Name, UID: p.UID})
	return cl
}

func allocatedAtTime(cl *resourceapi.ResourceClaim, at time.Time) *resourceapi.ResourceClaim {
	cl.Status.Allocation.AllocationTimestamp = ptr.To(metav1.NewTime(at))
	return cl
}

// writtenFor makes a claim's allocation one the controller wrote for item
// at (memory.go), as any leader's write leaves it.
func writtenFor(cl *resourceapi.ResourceClaim, item string, at time.Time) *resourceapi.ResourceClaim {
	stamp := allocationStamp(at)
	cl.Status.Allocation.AllocationTimestamp = &stamp
	markWritten(cl, item, stamp)
	return cl
}

func boundTo(p *corev1.Pod, node string) *corev1.Pod {
	p.Spec.NodeName = node
	return p
}

func TestDecideRepair(t *testing.T) {
	claim := func(name string, at time.Time) *resourceapi.ResourceClaim {
		return allocatedAtTime(allocatedClaim(name, "gpu-0"), at)
	}
	old, young := t0.Add(-time.Hour), t0.Add(-time.Second)
	tests := []struct {
		name       string
		facts      []claimFacts
		keep       string
		takeBack   []string
		unrepaired int
	}{
		{name: "this controller's unused write goes, the scheduler's reserved one stays",
			facts: []claimFacts{{claim: claim("ours", old), written: true, item: "GpuReservation/ns/r"}, {claim: claim("theirs", young), use: useReserved}},
			keep:  "theirs", takeBack: []string{"ours"}},
		{name: "two of the scheduler's: the one in use stays, the unused one goes (every path)",
			facts: []claimFacts{{claim: claim("a", old)}, {claim: claim("b", young), use: useInUse}},
			keep:  "b", takeBack: []string{"a"}},
		{name: "neither used: the older allocation stays",
			facts: []claimFacts{{claim: claim("young", young)}, {claim: claim("old", old)}},
			keep:  "old", takeBack: []string{"young"}},
		{name: "both in use: nothing can be taken back",
			facts: []claimFacts{{claim: claim("a", old), use: useInUse}, {claim: claim("b", young), use: useInUse}},
			keep:  "a", unrepaired: 1},
		{name: "a released gang's claim keeps its plan; the scheduler's unused one goes",
			facts: []claimFacts{{claim: claim("gang", young), written: true, item: "Gang/ns/g", released: true}, {claim: claim("theirs", old)}},
			keep:  "gang", takeBack: []string{"theirs"}},
		{name: "a released gang's claim against one in use: unrepaired, the gang is not moved off its plan",
			facts: []claimFacts{{claim: claim("gang", young), written: true, item: "Gang/ns/g", released: true}, {claim: claim("theirs", old), use: useInUse}},
			keep:  "theirs", unrepaired: 1},
		{name: "reserved for unbound pods: to be taken back (takeBackClaim checks its grace)",
			facts: []claimFacts{{claim: claim("bound", old), use: useInUse}, {claim: claim("stuck", t0.Add(-time.Minute)), use: useReserved}},
			keep:  "bound", takeBack: []string{"stuck"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := decideRepair(tt.facts)
			assert.Equal(t, tt.keep, d.keep.Name)
			var got []string
			for _, f := range d.takeBack {
				got = append(got, f.claim.Name)
			}
			assert.Equal(t, tt.takeBack, got)
			assert.Len(t, d.unrepaired, tt.unrepaired)
		})
	}
}

// withReservations gives the harness a dynamic client holding the
// reservations, which round syncs into the informer stand-in.
func (h *roundHarness) withReservations(t *testing.T, rs ...*gpudrav1.GpuReservation) {
	t.Helper()
	var objs []runtime.Object
	for _, r := range rs {
		u, err := gpudrav1.ToUnstructured(r)
		require.NoError(t, err)
		objs = append(objs, u)
	}
	h.dynamic = dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(),
		map[schema.GroupVersionResource]string{gpudrav1.GpuReservations: "GpuReservationList"}, objs...)
	h.c.opts.Dynamic = h.dynamic
}

func (h *roundHarness) reservation(t *testing.T, name string) *gpudrav1.GpuReservation {
	t.Helper()
	u, err := h.dynamic.Resource(gpudrav1.GpuReservations).Namespace("ns").Get(context.Background(), name, metav1.GetOptions{})
	require.NoError(t, err)
	r, err := gpudrav1.FromUnstructured[gpudrav1.GpuReservation](u)
	require.NoError(t, err)
	return r
}

func (h *roundHarness) getClaim(t *testing.T, name string) *resourceapi.ResourceClaim {
	t.Helper()
	cl, err := h.client.ResourceV1().ResourceClaims("ns").Get(context.Background(), name, metav1.GetOptions{})
	require.NoError(t, err)
	return cl
}

// TestRoundRepairsADoubleAllocation: a device is in two claims, one the
// scheduler's (reserved for its bound pod), one this controller wrote for a
// held reservation, which no pod uses yet. The round takes its own back,
// counts it, and leaves the scheduler's; the reservation goes back to its
// queue, keeps its place, and holds devices again (issue 35, item 2: before,
// it stayed Held holding nothing until its TTL).
func TestRoundRepairsADoubleAllocation(t *testing.T) {
	queuedAt := metav1.NewTime(t0.Add(-time.Hour))
	r := &gpudrav1.GpuReservation{TypeMeta: metav1.TypeMeta{APIVersion: gpudrav1.APIVersion, Kind: gpudrav1.KindGpuReservation},
		ObjectMeta: metav1.ObjectMeta{Name: "r", Namespace: "ns", UID: "uid-r", CreationTimestamp: metav1.NewTime(t0.Add(-2 * time.Hour))},
		Spec:       gpudrav1.GpuReservationSpec{DeviceClassName: "gpu.gpudra.dev", Claims: 1, Count: 1, TTL: metav1.Duration{Duration: time.Hour}},
		Status: gpudrav1.GpuReservationStatus{Phase: gpudrav1.ReservationHeld, Reason: gpudrav1.ReasonAllocated, QueuedAt: &queuedAt,
			HeldAt: metaTime(t0), ExpiresAt: metaTime(t0.Add(time.Hour))}}
	// The claim as the controller makes it for the reservation.
	ours := reservationClaims(r, func(string, string) *resourceapi.ResourceClaim { return nil })[0]
	require.Equal(t, "r-0", ours.Name)
	ours.UID = "uid-r-0"
	ours.Status.Allocation = allocatedClaim("r-0", "gpu-0").Status.Allocation
	writtenFor(ours, "GpuReservation/ns/r", t0.Add(-time.Minute))
	p := boundTo(withUID(ungated(plain("p", "", "", "theirs"))), "n0")
	theirs := reservedFor(allocatedClaim("theirs", "gpu-0"), p)
	h := newRoundHarness(t, p, theirs, ours)
	h.addTwoGPUNode(t)
	h.withReservations(t, r)

	require.NoError(t, h.round(t))
	assert.NotNil(t, h.getClaim(t, "theirs").Status.Allocation, "the scheduler's, in use, stays")
	assert.Equal(t, 1.0, testutil.ToFloat64(h.c.metrics.doubles.WithLabelValues("repaired")))
	got := h.reservation(t, "r")
	assert.Equal(t, gpudrav1.ReservationQueued, got.Status.Phase, "back in its queue: %s", got.Status.Message)
	require.NotNil(t, got.Status.QueuedAt)
	assert.True(t, queuedAt.Equal(got.Status.QueuedAt), "keeps its place")

	for range 3 {
		h.c.recent = map[string]time.Time{}
		require.NoError(t, h.round(t))
	}
	got = h.reservation(t, "r")
	assert.Equal(t, gpudrav1.ReservationHeld, got.Status.Phase, "planned again: %s", got.Status.Message)
	cl := h.getClaim(t, "r-0")
	require.NotNil(t, cl.Status.Allocation, "the reservation holds devices again")
	assert.Equal(t, "gpu-1", cl.Status.Allocation.Devices.Results[0].Device, "on the free GPU")
}

// TestRoundRepairsTheSchedulersDoubleAllocation: on the Workload API path
// kube-scheduler alone gave one GPU to two claims (item 0). The claim whose
// pods are not bound, written more than the grace ago, is taken back,
// reservation and allocation both, so that its pods schedule again; the one
// in use stays. Both in use: counted as unrepaired, and an Event says so.
func TestRoundRepairsTheSchedulersDoubleAllocation(t *testing.T) {
	running := boundTo(withUID(ungated(plain("running", "", "", "rep-gpu"))), "n0")
	pending := withUID(ungated(plain("frontend", "", "", "all-shared-gpu")))
	inUse := reservedFor(allocatedClaim("rep-gpu", "gpu-2"), running)
	stuck := allocatedAtTime(reservedFor(allocatedClaim("all-shared-gpu", "gpu-2"), pending), t0.Add(-time.Minute))
	h := newRoundHarness(t, running, pending, inUse, stuck)
	require.NoError(t, h.round(t))
	cl := h.getClaim(t, "all-shared-gpu")
	assert.Nil(t, cl.Status.Allocation, "taken back from the claim nobody uses")
	assert.Empty(t, cl.Status.ReservedFor, "its unbound pod is scheduled again")
	assert.NotNil(t, h.getClaim(t, "rep-gpu").Status.Allocation)
	assert.Equal(t, 1.0, testutil.ToFloat64(h.c.metrics.doubles.WithLabelValues("repaired")))

	other := boundTo(withUID(ungated(plain("other", "", "", "b"))), "n0")
	h = newRoundHarness(t, running, other, inUse, reservedFor(allocatedClaim("b", "gpu-2"), other))
	require.NoError(t, h.round(t))
	assert.Equal(t, 1.0, testutil.ToFloat64(h.c.metrics.doubles.WithLabelValues("unrepaired")))
	assert.NotNil(t, h.getClaim(t, "b").Status.Allocation, "in use: left")

	// Seen once: the repair does not look at it again every round.
	require.NoError(t, h.round(t))
	assert.Equal(t, 1.0, testutil.ToFloat64(h.c.metrics.doubles.WithLabelValues("unrepaired")))
}

// TestNoteAllocation: the repair looks only at claims whose allocation
// appeared or changed since it last looked.
func TestNoteAllocation(t *testing.T) {
	h := newRoundHarness(t)
	a := allocatedClaim("a", "gpu-0")
	h.c.noteAllocation(nil, &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "unallocated", Namespace: "ns"}})
	h.c.noteAllocation(a, allocatedClaim("a", "gpu-0")) // a status update that kept the devices
	assert.Zero(t, h.c.takeFresh().Len())
	h.c.noteAllocation(nil, a)
	h.c.noteAllocation(allocatedClaim("b", "gpu-0"), allocatedClaim("b", "gpu-1"))
	assert.ElementsMatch(t, []string{"ns/a", "ns/b"}, h.c.takeFresh().UnsortedList())
	assert.Zero(t, h.c.takeFresh().Len(), "taken")
}

// TestGangWritesTakenBackBeforeRelease: on the gate path kube-scheduler
// writes a device of the gang's plan into another claim after the check
// (it decided before the fence reached it). The controller looks again one
// settle after its writes and, before lifting any gate, takes the gang's
// writes back and plans again (issue 35, item 2): released, its pods would
// have let kube-scheduler allocate the cleared claim outside the gang's
// plan.
func TestGangWritesTakenBackBeforeRelease(t *testing.T) {
	h := newWorkloadHarness(t, plain("a", "g", "2", "ca"), plain("b", "g", "2", "cb"), oneGPUClaim("ca"), oneGPUClaim("cb"))
	h.c.opts.Path = PathGates
	h.c.committer.settle = time.Millisecond
	injected := false
	h.client.PrependReactor("update", "resourceclaims", func(a k8stesting.Action) (bool, runtime.Object, error) {
		u := a.(k8stesting.UpdateAction)
		cl := u.GetObject().(*resourceapi.ResourceClaim)
		if injected || u.GetSubresource() != "status" || cl.Name != "ca" || cl.Status.Allocation == nil {
			return false, nil, nil
		}
		injected = true
		theirs := allocatedClaim("theirs", cl.Status.Allocation.Devices.Results[0].Device)
		require.NoError(t, h.client.Tracker().Create(resourceapi.SchemeGroupVersion.WithResource("resourceclaims"), theirs, "ns"))
		return false, nil, nil
	})
	_ = h.round(t)
	require.True(t, injected)
	assert.True(t, gated(h.pod(t, "a")) && gated(h.pod(t, "b")), "no gate lifted on a plan that is not the gang's alone")
	assert.Nil(t, h.getClaim(t, "ca").Status.Allocation, "the gang's writes are taken back")
	assert.Nil(t, h.getClaim(t, "cb").Status.Allocation)
	assert.Equal(t, 1.0, testutil.ToFloat64(h.c.metrics.doubles.WithLabelValues("repaired")))
}

// TestWorkloadPathWritesSharedClaimsBeforeHandOff: issue 35, item 0. On
// the Workload API path a claim that two pods of the gang share is written
// by the controller from its plan, behind the fence, before the PodGroup
// exists; a claim one pod uses is left to kube-scheduler.
func TestWorkloadPathWritesSharedClaimsBeforeHandOff(t *testing.T) {
	h := newWorkloadHarness(t, grouped(plain("a", "g", "2", "shared", "own")), grouped(plain("b", "g", "2", "shared")),
		oneGPUClaim("shared"), oneGPUClaim("own"))
	h.c.committer.settle = time.Millisecond
	sharedAllocatedFirst := false
	h.client.PrependReactor("create", "podgroups", func(k8stesting.Action) (bool, runtime.Object, error) {
		obj, err := h.client.Tracker().Get(resourceapi.SchemeGroupVersion.WithResource("resourceclaims"), "ns", "shared")
		sharedAllocatedFirst = err == nil && obj.(*resourceapi.ResourceClaim).Status.Allocation != nil
		return false, nil, nil
	})
	require.NoError(t, h.round(t))
	_, err := h.client.SchedulingV1beta1().PodGroups("ns").Get(context.Background(), "g", metav1.GetOptions{})
	require.NoError(t, err, "handed over")
	assert.True(t, sharedAllocatedFirst, "the shared claim is allocated before the PodGroup exists")
	assert.Nil(t, h.getClaim(t, "own").Status.Allocation, "a claim of one pod is kube-scheduler's to allocate")
}

// TestHalfWrittenGangPlannedWhole: issue 35, item 8. The gang's shared
// claim was written, then the PodGroup's create failed (a 500). The next
// round does not plan the gang around that write (it could leave its NVLink
// domain): the write is taken back and the whole gang planned anew, then
// handed over.
func TestHalfWrittenGangPlannedWhole(t *testing.T) {
	h := newWorkloadHarness(t, grouped(plain("a", "g", "2", "shared", "own")), grouped(plain("b", "g", "2", "shared")),
		oneGPUClaim("shared"), oneGPUClaim("own"))
	h.c.committer.settle = time.Millisecond
	failFirst(h.client, "create", "podgroups", func(k8stesting.Action) bool { return true }, apierrors.NewInternalError(errors.New("etcdserver: leader changed")))
	require.Error(t, h.round(t), "the hand-off failed")
	require.NotNil(t, h.getClaim(t, "shared").Status.Allocation, "written before the hand-off")

	_ = h.round(t)
	assert.Nil(t, h.getClaim(t, "shared").Status.Allocation, "taken back: the gang is planned whole")
	_, err := h.client.SchedulingV1beta1().PodGroups("ns").Get(context.Background(), "g", metav1.GetOptions{})
	assert.True(t, apierrors.IsNotFound(err), "not handed over on a plan made around the old write")

	h.c.recent = map[string]time.Time{}
	require.NoError(t, h.round(t))
	_, err = h.client.SchedulingV1beta1().PodGroups("ns").Get(context.Background(), "g", metav1.GetOptions{})
	assert.NoError(t, err, "handed over once planned whole")
	assert.NotNil(t, h.getClaim(t, "shared").Status.Allocation)
}
