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
	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/allocator"
)

// Issue 47, points 1 to 4 and 10: what the repair remembers lives in the
// API, a round that changed nothing does not kick the next, a blocked
// hand-off writes nothing, one rule for "in use", and a kept device is
// fenced.

// newLeader is the harness after a leader change: a new controller, with
// nothing in memory, over the same API and informer contents.
func (h *roundHarness) newLeader(t *testing.T) *roundHarness {
	t.Helper()
	c, err := New(Options{Client: h.client, Dynamic: h.c.opts.Dynamic, Now: h.c.opts.Now, Path: h.c.opts.Path})
	require.NoError(t, err)
	c.pods, c.claims, c.slices, c.classes, c.nodes = h.c.pods, h.c.claims, h.c.slices, h.c.classes, h.c.nodes
	c.reservations, c.queues, c.podGroups, c.workloads, c.taintRules = h.c.reservations, h.c.queues, h.c.podGroups, h.c.workloads, h.c.taintRules
	c.committer.settle = h.c.committer.settle
	// As Run does: the old leader's fences of plans being written go.
	require.NoError(t, sweepFences(context.Background(), h.client, t0, 0))
	// The new leader's informers list every claim: each is looked at once.
	for _, obj := range c.claims.List() {
		c.noteAllocation(nil, obj.(*resourceapi.ResourceClaim))
	}
	return &roundHarness{c: c, client: h.client, dynamic: h.dynamic}
}

// kicked says whether the round asked for another at once, and forgets it.
func (h *roundHarness) kicked() bool {
	select {
	case <-h.c.trigger:
		return true
	default:
		return false
	}
}

// addDomainNode adds node n0 whose GPUs are in the NVLink domains given
// (device name to domain), and the gpu.gpudra.dev class.
func (h *roundHarness) addDomainNode(t *testing.T, domains map[string]string) {
	t.Helper()
	var devices []resourceapi.Device
	for _, name := range sortedKeys(domains) {
		devices = append(devices, resourceapi.Device{Name: name, Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			"type": {StringValue: ptr.To("gpu")}, "nvlinkDomain": {StringValue: ptr.To(domains[name])}}})
	}
	require.NoError(t, h.c.slices.Add(&resourceapi.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: "n0-gpus"}, Spec: resourceapi.ResourceSliceSpec{
		Driver: allocator.DriverName, NodeName: ptr.To("n0"), Pool: resourceapi.ResourcePool{Name: "n0", ResourceSliceCount: 1}, Devices: devices}}))
	require.NoError(t, h.c.classes.Add(&resourceapi.DeviceClass{ObjectMeta: metav1.ObjectMeta{Name: "gpu.gpudra.dev"}, Spec: resourceapi.DeviceClassSpec{
		Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: `device.attributes["gpu.gpudra.dev"].type == "gpu"`}}}}}))
	require.NoError(t, h.c.nodes.Add(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n0", Labels: map[string]string{"kubernetes.io/hostname": "n0"}}}))
}

// queuedReservationInUse is a harness holding reservation r, Queued again,
// of two one-GPU claims in one NVLink domain: r-0, written by the
// controller, on gpu-a0 and used by the running pod, and r-1, taken back;
// node n0 has the GPUs of domains.
func queuedReservationInUse(t *testing.T, domains map[string]string) *roundHarness {
	t.Helper()
	r := &gpudrav1.GpuReservation{TypeMeta: metav1.TypeMeta{APIVersion: gpudrav1.APIVersion, Kind: gpudrav1.KindGpuReservation},
		ObjectMeta: metav1.ObjectMeta{Name: "r", Namespace: "ns", UID: "uid-r", CreationTimestamp: metav1.NewTime(t0.Add(-time.Hour))},
		Spec: gpudrav1.GpuReservationSpec{DeviceClassName: "gpu.gpudra.dev", Claims: 2, Count: 1, SameNVLinkDomain: true,
			TTL: metav1.Duration{Duration: time.Hour}},
		Status: gpudrav1.GpuReservationStatus{Phase: gpudrav1.ReservationQueued, Reason: gpudrav1.ReasonWaitingForDevices}}
	claims := reservationClaims(r, func(string, string) *resourceapi.ResourceClaim { return nil })
	running := boundTo(withUID(ungated(plain("running", "", "", "r-0"))), "n0")
	used, lost := claims[0], claims[1]
	used.UID, lost.UID = "uid-r-0", "uid-r-1"
	used.Status.Allocation = allocatedClaim("r-0", "gpu-a0").Status.Allocation
	writtenFor(used, "GpuReservation/ns/r", t0.Add(-time.Hour))
	reservedFor(used, running)
	h := newRoundHarness(t, running, used, lost)
	h.addDomainNode(t, domains)
	h.withReservations(t, r)
	return h
}

// TestRequeuedReservationWithAClaimInUseIsPlannedAroundIt: point 1. A held
// reservation of two claims, one consumed by a running pod; the repair took
// the other back, and the reservation is Queued again. Before, each round
// called it half written, took nothing back (the claim in use was skipped,
// silently) and kicked the next round at once, for ever: the lost claim was
// never allocated again though a GPU was free. Now the claim in use stays,
// the lost one is planned around it, in its NVLink domain, and a round that
// changes nothing asks for no other.
func TestRequeuedReservationWithAClaimInUseIsPlannedAroundIt(t *testing.T) {
	// gpu-b0 sorts first: planned without the domain, the lost claim
	// could land there, away from the one in use.
	h := queuedReservationInUse(t, map[string]string{"gpu-a0": "A", "gpu-a1": "A", "gpu-b0": "B"})

	require.NoError(t, h.round(t))
	got := h.getClaim(t, "r-1")
	require.NotNil(t, got.Status.Allocation, "the lost claim is allocated again")
	assert.Equal(t, "gpu-a1", got.Status.Allocation.Devices.Results[0].Device, "beside the claim in use, in its NVLink domain")
	assert.Equal(t, "uid-running", string(h.getClaim(t, "r-0").Status.ReservedFor[0].UID), "the claim in use is untouched")
	assert.Equal(t, gpudrav1.ReservationHeld, h.reservation(t, "r").Status.Phase)

	h.c.recent = map[string]time.Time{}
	h.kicked()
	require.NoError(t, h.round(t))
	assert.Equal(t, gpudrav1.ReservationConsumed, h.reservation(t, "r").Status.Phase, "%s", h.reservation(t, "r").Status.Message)
	require.NoError(t, h.round(t))
	assert.False(t, h.kicked(), "a round that changed nothing does not ask for another")
}

// TestQueuedReservationInUseWaitsQuietly: point 1's spin. The same
// reservation with no free GPU in its domain waits, says so, and no round
// asks for the next.
func TestQueuedReservationInUseWaitsQuietly(t *testing.T) {
	h := queuedReservationInUse(t, map[string]string{"gpu-a0": "A", "gpu-b0": "B"})
	for range 3 {
		require.NoError(t, h.round(t))
		assert.False(t, h.kicked(), "no round asks for the next: nothing changed")
	}
	assert.Nil(t, h.getClaim(t, "r-1").Status.Allocation, "not planned outside the domain of the claim in use")
	got := h.reservation(t, "r")
	assert.Equal(t, gpudrav1.ReservationQueued, got.Status.Phase)
	assert.Contains(t, got.Status.Message, "waiting for 1 free devices")
}

// TestNewLeaderNeverTakesBackAReleasedGangsClaim: point 2. A gang's claim
// written and released by the old leader (its pods not bound yet) and a
// claim of kube-scheduler's, reserved for a pod not bound, past its grace,
// hold one GPU. The old leader knew the gang's claim from memory; a new
// leader knows it from the claim's annotations, and takes back the other.
func TestNewLeaderNeverTakesBackAReleasedGangsClaim(t *testing.T) {
	member := withUID(ungated(plain("member", "g", "1", "gang-claim")))
	pending := withUID(ungated(plain("pending", "", "", "theirs")))
	gangClaim := writtenFor(allocatedClaim("gang-claim", "gpu-0"), "Gang/ns/g", t0.Add(-time.Minute))
	theirs := allocatedAtTime(reservedFor(allocatedClaim("theirs", "gpu-0"), pending), t0.Add(-2*time.Minute))
	old := newRoundHarness(t, member, pending, gangClaim, theirs)
	old.addTwoGPUNode(t)
	h := old.newLeader(t)
	require.NoError(t, h.round(t))
	assert.NotNil(t, h.getClaim(t, "gang-claim").Status.Allocation, "the released gang keeps its plan")
	assert.Nil(t, h.getClaim(t, "theirs").Status.Allocation, "kube-scheduler's unused claim is taken back")
	assert.Equal(t, 1.0, testutil.ToFloat64(h.c.metrics.doubles.WithLabelValues("repaired")))
}

// TestNewLeaderTakesBackAHalfWrittenGang: point 2, the half-written-gang
// check. The old leader wrote the gang's shared claim and stopped before
// its hand-off (the PodGroup's create failed). A new leader sees the write
// from the claim's annotations, takes it back, and plans the gang whole.
func TestNewLeaderTakesBackAHalfWrittenGang(t *testing.T) {
	old := newWorkloadHarness(t, grouped(plain("a", "g", "2", "shared", "own")), grouped(plain("b", "g", "2", "shared")),
		oneGPUClaim("shared"), oneGPUClaim("own"))
	old.c.committer.settle = time.Millisecond
	old.c.workloads = cache.NewStore(cache.MetaNamespaceKeyFunc)
	failFirst(old.client, "create", "podgroups", func(k8stesting.Action) bool { return true }, apierrors.NewInternalError(errors.New("etcdserver: leader changed")))
	require.Error(t, old.round(t), "the hand-off failed")
	require.NotNil(t, old.getClaim(t, "shared").Status.Allocation, "written before the hand-off")
	w, ok := writtenBy(old.getClaim(t, "shared"))
	require.True(t, ok, "the write is remembered in the API")
	assert.Equal(t, "Gang/ns/g", w.item)

	h := old.newLeader(t)
	_ = h.round(t)
	assert.Nil(t, h.getClaim(t, "shared").Status.Allocation, "the new leader takes the old leader's write back")
	_, err := h.client.SchedulingV1beta1().PodGroups("ns").Get(context.Background(), "g", metav1.GetOptions{})
	assert.True(t, apierrors.IsNotFound(err), "not handed over on a plan made around the old write")
	require.NoError(t, h.round(t))
	_, err = h.client.SchedulingV1beta1().PodGroups("ns").Get(context.Background(), "g", metav1.GetOptions{})
	assert.NoError(t, err, "handed over once planned whole")
}

// TestBlockedHandOffWritesNothing: point 3. An object of the gang's name
// blocks its hand-off (a PodGroup of an earlier gang still Terminating, a
// Workload not gpudra's, a pod of no gang that names its PodGroup and would
// join it, made before the gang's pods, when the webhook could not tell). The gang waits and says why, with nothing
// written: before, every round wrote its shared claims behind a fence,
// failed the hand-off, and took them back the next.
func TestBlockedHandOffWritesNothing(t *testing.T) {
	now := metav1.NewTime(t0)
	tests := []struct {
		name    string
		blocker runtime.Object
		want    string
	}{
		{name: "a PodGroup being deleted", want: "being deleted",
			blocker: &schedulingv1beta1.PodGroup{ObjectMeta: metav1.ObjectMeta{Name: "g", Namespace: "ns", DeletionTimestamp: &now,
				Finalizers: []string{"x"}, Labels: map[string]string{gpudrav1.LabelGang: "g"}}}},
		{name: "a Workload that is not gpudra's", want: "is not gpudra's",
			blocker: &schedulingv1beta1.Workload{ObjectMeta: metav1.ObjectMeta{Name: "g", Namespace: "ns"}}},
		{name: "a pod of no gang that names the gang's PodGroup", want: "pod ns/intruder names PodGroup g in spec.schedulingGroup but is not a member",
			blocker: func() *corev1.Pod {
				p := withUID(ungated(pod("intruder", nil, nil)))
				p.Spec.SchedulingGroup = &corev1.PodSchedulingGroup{PodGroupName: ptr.To("g")}
				return p
			}()},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newWorkloadHarness(t, grouped(plain("a", "g", "2", "shared")), grouped(plain("b", "g", "2", "shared")), oneGPUClaim("shared"), tt.blocker)
			h.c.committer.settle = time.Millisecond
			h.c.workloads = cache.NewStore(cache.MetaNamespaceKeyFunc)
			if wl, ok := tt.blocker.(*schedulingv1beta1.Workload); ok {
				require.NoError(t, h.c.workloads.Add(wl))
			}
			h.syncPodGroups(t)
			for range 3 {
				_ = h.round(t)
				assert.Nil(t, h.getClaim(t, "shared").Status.Allocation, "nothing written while the hand-off is blocked")
			}
			for _, a := range h.client.Actions() {
				assert.False(t, a.Matches("create", "devicetaintrules"), "no fence")
				assert.False(t, a.Matches("update", "resourceclaims"), "no claim written")
			}
			assert.Equal(t, ReasonHandOffBlocked+": gang ns/g: ", h.c.reported["ns/g"][:len(ReasonHandOffBlocked)+len(": gang ns/g: ")])
			assert.Contains(t, h.c.reported["ns/g"], tt.want)
		})
	}
}

// TestTakeBackClaimRule: point 4, the one rule for "in use", asked of the
// API server before the write, and the grace of a claim reserved for pods
// not bound yet when upstream left allocationTimestamp unset.
func TestTakeBackClaimRule(t *testing.T) {
	pending := withUID(ungated(plain("pending", "", "", "c")))
	reserved := func() *resourceapi.ResourceClaim { return reservedFor(allocatedClaim("c", "gpu-0"), pending) }
	statusWrite := func(at time.Time) []metav1.ManagedFieldsEntry {
		return []metav1.ManagedFieldsEntry{{Manager: "kube-scheduler", Subresource: "status", Time: ptr.To(metav1.NewTime(at))}}
	}
	tests := []struct {
		name string
		// api is the claim as the API server has it; apiPod the pod.
		api    *resourceapi.ResourceClaim
		apiPod *corev1.Pod
		took   bool
		err    error
	}{
		{name: "nobody uses it: taken back", api: allocatedClaim("c", "gpu-0"), took: true},
		{name: "its pod was bound after the informer looked: in use", api: reserved(), apiPod: boundTo(withUID(ungated(plain("pending", "", "", "c"))), "n0"),
			err: errInUse},
		{name: "its pod is gone from the API: in use until the claim controller says so", api: reserved(), err: errInUse},
		{name: "reserved, written a minute ago: taken back", api: allocatedAtTime(reserved(), t0.Add(-time.Minute)), apiPod: pending, took: true},
		{name: "reserved, written a second ago: its grace", api: allocatedAtTime(reserved(), t0.Add(-time.Second)), apiPod: pending, err: errInGrace},
		{name: "no timestamp, status written a second ago (made an hour ago): its grace", apiPod: pending, err: errInGrace,
			api: func() *resourceapi.ResourceClaim {
				c := reserved()
				c.CreationTimestamp = metav1.NewTime(t0.Add(-time.Hour))
				c.ManagedFields = statusWrite(t0.Add(-time.Second))
				return c
			}()},
		{name: "no timestamp, status written a minute ago: taken back", apiPod: pending, took: true,
			api: func() *resourceapi.ResourceClaim {
				c := reserved()
				c.ManagedFields = statusWrite(t0.Add(-time.Minute))
				return c
			}()},
		{name: "no timestamp, nothing says when: its grace", api: reserved(), apiPod: pending, err: errInGrace},
		{name: "another allocation meanwhile: left", api: allocatedClaim("c", "gpu-1")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			objs := []runtime.Object{tt.api}
			if tt.apiPod != nil {
				objs = append(objs, tt.apiPod)
			}
			client := fake.NewClientset(objs...)
			seen := tt.api.DeepCopy()
			seen.Status.Allocation = allocatedClaim("c", "gpu-0").Status.Allocation
			took, err := takeBackClaim(context.Background(), client, seen, t0)
			assert.Equal(t, tt.took, took)
			if tt.err != nil {
				assert.ErrorIs(t, err, tt.err)
			} else {
				assert.NoError(t, err)
			}
			cur, gerr := client.ResourceV1().ResourceClaims("ns").Get(context.Background(), "c", metav1.GetOptions{})
			require.NoError(t, gerr)
			assert.Equal(t, tt.took, cur.Status.Allocation == nil, "cleared exactly when taken back")
		})
	}
}

// TestRepairFencesTheKeptDevice: point 10. kube-scheduler's record of
// allocated devices forgets the device of the claim taken back, though the
// claim that kept it still holds it: the kept device is fenced until that
// claim ends, by whichever leader sees it end.
func TestRepairFencesTheKeptDevice(t *testing.T) {
	running := boundTo(withUID(ungated(plain("running", "", "", "kept"))), "n0")
	kept := reservedFor(allocatedClaim("kept", "gpu-0"), running)
	stray := allocatedAtTime(allocatedClaim("stray", "gpu-0"), t0.Add(-time.Minute))
	h := newRoundHarness(t, running, kept, stray)
	h.addTwoGPUNode(t)
	h.c.taintRules = cache.NewStore(cache.MetaNamespaceKeyFunc)
	require.NoError(t, h.round(t))
	require.Nil(t, h.getClaim(t, "stray").Status.Allocation)
	rules, err := h.client.ResourceV1().DeviceTaintRules().List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	require.Len(t, rules.Items, 1, "the kept device is fenced")
	r := rules.Items[0]
	assert.Equal(t, "gpu-0", ptr.Deref(r.Spec.DeviceSelector.Device, ""))
	assert.Equal(t, resourceapi.DeviceTaintEffectNoSchedule, r.Spec.Taint.Effect, "the kept claim's pod is not evicted")
	assert.Equal(t, "uid-kept", r.Labels[LabelKeptFor])

	// Still held: a new leader keeps the fence.
	require.NoError(t, h.c.taintRules.Add(&r))
	h2 := h.newLeader(t)
	require.NoError(t, h2.round(t))
	_, err = h.client.ResourceV1().DeviceTaintRules().Get(context.Background(), r.Name, metav1.GetOptions{})
	require.NoError(t, err, "kept while its claim holds the device")

	// The claim ends: the fence goes.
	require.NoError(t, h.client.ResourceV1().ResourceClaims("ns").Delete(context.Background(), "kept", metav1.DeleteOptions{}))
	require.NoError(t, h2.round(t))
	_, err = h.client.ResourceV1().DeviceTaintRules().Get(context.Background(), r.Name, metav1.GetOptions{})
	assert.True(t, apierrors.IsNotFound(err), "lifted once its claim ended: %v", err)
}
