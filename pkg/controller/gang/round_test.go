package gang

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2/ktesting"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// roundHarness runs the controller's rounds over a fake API whose calls a
// test can fail; its informers are stand-ins that sync fills from the
// fake API before a round, as the real ones would be by then.
type roundHarness struct {
	c      *Controller
	client *fake.Clientset
	// dynamic, when set (withReservations), holds the GpuReservations.
	dynamic *dynamicfake.FakeDynamicClient
}

func newRoundHarness(t *testing.T, objs ...runtime.Object) *roundHarness {
	t.Helper()
	client := fake.NewClientset(objs...)
	c, err := New(Options{Client: client, Dynamic: dynamicfake.NewSimpleDynamicClient(runtime.NewScheme()), Now: func() time.Time { return t0 }})
	require.NoError(t, err)
	c.pods = cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{gangMemberIndex: memberGang, nominatedIndex: nominatedNode, pendingIndex: pendingWithClaims,
		schedulingGroupIndex: namedPodGroup})
	c.claims = cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{reservationIndex: claimReservation, deviceIndex: claimDevices})
	c.slices, c.classes, c.nodes = cache.NewStore(cache.MetaNamespaceKeyFunc), cache.NewStore(cache.MetaNamespaceKeyFunc), cache.NewStore(cache.MetaNamespaceKeyFunc)
	c.reservations, c.queues = cache.NewStore(cache.MetaNamespaceKeyFunc), cache.NewStore(cache.MetaNamespaceKeyFunc)
	return &roundHarness{c: c, client: client}
}

// round syncs the informers and runs one round.
func (h *roundHarness) round(t *testing.T) error {
	t.Helper()
	ctx := context.Background()
	pods, err := h.client.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	var objs []any
	for i := range pods.Items {
		objs = append(objs, &pods.Items[i])
	}
	require.NoError(t, h.c.pods.Replace(objs, ""))
	claims, err := h.client.ResourceV1().ResourceClaims("").List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	objs = nil
	for i := range claims.Items {
		cl := &claims.Items[i]
		objs = append(objs, cl)
		// The informer's update hook.
		old, _, _ := h.c.claims.GetByKey(cl.Namespace + "/" + cl.Name)
		prev, _ := old.(*resourceapi.ResourceClaim)
		h.c.noteAllocation(prev, cl)
	}
	require.NoError(t, h.c.claims.Replace(objs, ""))
	if h.dynamic != nil {
		list, err := h.dynamic.Resource(gpudrav1.GpuReservations).Namespace("").List(ctx, metav1.ListOptions{})
		require.NoError(t, err)
		objs = nil
		for i := range list.Items {
			objs = append(objs, &list.Items[i])
		}
		require.NoError(t, h.c.reservations.Replace(objs, ""))
	}
	_, ctx = ktesting.NewTestContext(t)
	return h.c.round(ctx)
}

func (h *roundHarness) pod(t *testing.T, name string) *corev1.Pod {
	t.Helper()
	p, err := h.client.CoreV1().Pods("ns").Get(context.Background(), name, metav1.GetOptions{})
	require.NoError(t, err)
	return p
}

func ungated(p *corev1.Pod) *corev1.Pod {
	p.Spec.SchedulingGates = nil
	return p
}

func withPhase(p *corev1.Pod, phase corev1.PodPhase) *corev1.Pod {
	p.Status.Phase = phase
	return p
}

func withUID(p *corev1.Pod) *corev1.Pod {
	p.UID = types.UID("uid-" + p.Name)
	return p
}

// failFirst makes the first call that match answers err, once.
func failFirst(client *fake.Clientset, verb, resource string, match func(k8stesting.Action) bool, err error) *int {
	failed := new(int)
	client.PrependReactor(verb, resource, func(a k8stesting.Action) (bool, runtime.Object, error) {
		if *failed == 0 && match(a) {
			*failed++
			return true, nil, err
		}
		return false, nil, nil
	})
	return failed
}

// TestRoundReleasesAfterAFailedGateLift: the review's first scenario. A
// gang's claims are allocated and its gates are lifted, but one lift fails
// once (a 500). The next round must lift the remaining gate; counting only
// gated pods saw "1 of 2 pods exist" and left that pod gated for ever.
func TestRoundReleasesAfterAFailedGateLift(t *testing.T) {
	h := newRoundHarness(t,
		withUID(plain("a", "g", "2", "ca")), withUID(plain("b", "g", "2", "cb")),
		allocatedClaim("ca", "gpu-0"), allocatedClaim("cb", "gpu-1"))
	failed := failFirst(h.client, "patch", "pods", func(a k8stesting.Action) bool {
		p := a.(k8stesting.PatchAction)
		return p.GetSubresource() == "" && p.GetName() == "a"
	}, apierrors.NewInternalError(errors.New("etcdserver: request timed out")))

	err := h.round(t)
	require.Error(t, err, "the failed lift is reported")
	assert.Contains(t, err.Error(), "lift the gang gate of pod ns/a")
	require.Equal(t, 1, *failed)
	assert.True(t, gated(h.pod(t, "a")), "the lift failed")
	assert.False(t, gated(h.pod(t, "b")), "the other lift went through")

	for i := range 2 { // the informer has seen b's lift by now, or not
		if i == 1 {
			h.c.recent = map[string]time.Time{}
		}
		require.NoError(t, h.round(t), "round %d", i+2)
	}
	assert.False(t, gated(h.pod(t, "a")), "released on the next round")
	assert.Equal(t, corev1.ConditionTrue, gangConditionOf(h.pod(t, "a")).Status)
}

// TestRoundReleasesARecreatedMember: a member of an admitted gang ended and
// its owner (a Job, Grove) made a new pod, which the webhook gated. It is
// released at once: the gang runs already, and it waits for nobody.
func TestRoundReleasesARecreatedMember(t *testing.T) {
	h := newRoundHarness(t,
		withUID(ungated(plain("a", "g", "2", "ca"))), withUID(withPhase(ungated(plain("b", "g", "2", "cb")), corev1.PodFailed)),
		withUID(plain("b2", "g", "2", "cb2")),
		allocatedClaim("ca", "gpu-0"), &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "cb2", Namespace: "ns"}})
	require.NoError(t, h.round(t))
	assert.False(t, gated(h.pod(t, "b2")), "the recreated member is released")
}

func gangConditionOf(p *corev1.Pod) corev1.PodCondition {
	for _, c := range p.Status.Conditions {
		if c.Type == PodConditionGang {
			return c
		}
	}
	return corev1.PodCondition{}
}

// TestReleaseGated: with gangs off, every live pod carrying gpudra's gate
// is released with the reason on its condition; other gates, ended pods
// and pods without the gate are left alone.
func TestReleaseGated(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	other := plain("other", "g", "2")
	other.Spec.SchedulingGates = append(other.Spec.SchedulingGates, corev1.PodSchedulingGate{Name: "example.com/quota"})
	client := fake.NewClientset(plain("a", "g", "2"), other, withPhase(plain("ended", "h", "1"), corev1.PodSucceeded), ungated(plain("free", "i", "1")))
	n, err := ReleaseGated(ctx, client, nil, "the API server does not serve DeviceTaintRules")
	require.NoError(t, err)
	assert.Equal(t, 2, n)
	get := func(name string) *corev1.Pod {
		p, err := client.CoreV1().Pods("ns").Get(ctx, name, metav1.GetOptions{})
		require.NoError(t, err)
		return p
	}
	assert.False(t, gated(get("a")))
	c := gangConditionOf(get("a"))
	assert.Equal(t, ReasonGangsOff, c.Reason)
	assert.Contains(t, c.Message, "DeviceTaintRules")
	assert.Equal(t, []corev1.PodSchedulingGate{{Name: "example.com/quota"}}, get("other").Spec.SchedulingGates, "another gate stays")
	assert.True(t, gated(get("ended")), "an ended pod is left alone")
}

// TestRoundTakesBackAHalfWrittenReservation: the review's failover between
// two claim writes. A reservation of two claims has one allocated (the
// leader died before the second write). The round takes that allocation
// back so that the whole reservation is planned anew; before, it stayed
// Queued for ever, holding the device, its claims refused as already
// allocated.
func TestRoundTakesBackAHalfWrittenReservation(t *testing.T) {
	r := &gpudrav1.GpuReservation{TypeMeta: metav1.TypeMeta{APIVersion: gpudrav1.APIVersion, Kind: gpudrav1.KindGpuReservation},
		ObjectMeta: metav1.ObjectMeta{Name: "r", Namespace: "ns", UID: "uid-r", CreationTimestamp: metav1.NewTime(t0)},
		Spec:       gpudrav1.GpuReservationSpec{DeviceClassName: "gpu.gpudra.dev", Claims: 2, Count: 1, TTL: metav1.Duration{Duration: time.Hour}}}
	owned := func(c *resourceapi.ResourceClaim) *resourceapi.ResourceClaim {
		c.Labels = map[string]string{gpudrav1.LabelReservation: "r"}
		c.OwnerReferences = []metav1.OwnerReference{{APIVersion: gpudrav1.APIVersion, Kind: gpudrav1.KindGpuReservation, Name: "r", UID: "uid-r"}}
		return c
	}
	written := owned(allocatedClaim("r-0", "gpu-0"))
	h := newRoundHarness(t, written)
	u, err := gpudrav1.ToUnstructured(r)
	require.NoError(t, err)
	require.NoError(t, h.c.reservations.Add(u))

	_ = h.round(t) // no slices here: planning the rest would find nothing anyway
	cl, err := h.client.ResourceV1().ResourceClaims("ns").Get(context.Background(), "r-0", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Nil(t, cl.Status.Allocation, "the half-written allocation is taken back")
}

// TestRoundKeepsAReservationClaimWhosePodEnded: a held reservation's claim
// was used by a pod that ended; the claim controller deallocated it. Before
// the TTL, the claim stays, so that the pod's replacement can name it;
// before, it was deleted and the replacement could never start. At the TTL
// it goes.
func TestRoundKeepsAReservationClaimWhosePodEnded(t *testing.T) {
	r := &gpudrav1.GpuReservation{TypeMeta: metav1.TypeMeta{APIVersion: gpudrav1.APIVersion, Kind: gpudrav1.KindGpuReservation},
		ObjectMeta: metav1.ObjectMeta{Name: "r", Namespace: "ns", UID: "uid-r", CreationTimestamp: metav1.NewTime(t0)},
		Spec:       gpudrav1.GpuReservationSpec{DeviceClassName: "gpu.gpudra.dev", Claims: 1, Count: 1, TTL: metav1.Duration{Duration: time.Hour}},
		Status: gpudrav1.GpuReservationStatus{Phase: gpudrav1.ReservationConsumed, HeldAt: metaTime(t0),
			ExpiresAt: metaTime(t0.Add(time.Hour))}}
	deallocated := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "r-0", Namespace: "ns", UID: "uid-r-0",
		Labels:          map[string]string{gpudrav1.LabelReservation: "r"},
		OwnerReferences: []metav1.OwnerReference{{APIVersion: gpudrav1.APIVersion, Kind: gpudrav1.KindGpuReservation, Name: "r", UID: "uid-r"}}}}
	h := newRoundHarness(t, deallocated)
	u, err := gpudrav1.ToUnstructured(r)
	require.NoError(t, err)
	require.NoError(t, h.c.reservations.Add(u))
	ctx := context.Background()

	_ = h.round(t)
	_, err = h.client.ResourceV1().ResourceClaims("ns").Get(ctx, "r-0", metav1.GetOptions{})
	require.NoError(t, err, "kept before the TTL, for the pod's replacement")

	h.c.opts.Now = func() time.Time { return t0.Add(2 * time.Hour) }
	_ = h.round(t)
	_, err = h.client.ResourceV1().ResourceClaims("ns").Get(ctx, "r-0", metav1.GetOptions{})
	assert.True(t, apierrors.IsNotFound(err), "released at the TTL: %v", err)
}

// TestIdleRounds: with nothing waiting and nothing in flight the controller
// is idle: ticks skip rounds and claim or slice events do not run one, so
// that its cost does not follow the cluster (issue 26). A waiting gang, or
// a write of its own, makes it busy again, and a resync still comes.
func TestIdleRounds(t *testing.T) {
	h := newRoundHarness(t)
	now := t0
	h.c.opts.Now = func() time.Time { return now }
	_, ctx := ktesting.NewTestContext(t)
	triggered := func() bool {
		select {
		case <-h.c.trigger:
			return true
		default:
			return false
		}
	}

	require.NoError(t, h.round(t))
	assert.True(t, h.c.idle.Load(), "nothing waits")
	h.c.softKick()
	assert.False(t, triggered(), "a claim or slice event runs no round while idle")
	assert.True(t, h.c.countsStale.Load(), "but makes the counts stale")
	now = now.Add(time.Second)
	assert.True(t, h.c.idleTick(ctx), "a tick is skipped; the stale gauges are set from the counter, without a round")
	assert.False(t, h.c.countsStale.Load())
	now = now.Add(idleResync)
	assert.False(t, h.c.idleTick(ctx), "a round is due at the resync")

	// A gang waiting for its second pod keeps the controller busy.
	_, err := h.client.CoreV1().Pods("ns").Create(ctx, plain("a", "g", "2"), metav1.CreateOptions{})
	require.NoError(t, err)
	require.NoError(t, h.round(t))
	assert.False(t, h.c.idle.Load(), "a gang waits")
	h.c.softKick()
	assert.True(t, triggered(), "events run rounds while busy")
	assert.False(t, h.c.idleTick(ctx))

	// Its own recent write keeps it busy until the informers caught up.
	require.NoError(t, h.client.CoreV1().Pods("ns").Delete(ctx, "a", metav1.DeleteOptions{}))
	h.c.rememberAdmitted("Gang/ns/g")
	require.NoError(t, h.round(t))
	assert.False(t, h.c.idle.Load(), "a recent write")
	now = now.Add(recentTTL + time.Second)
	require.NoError(t, h.round(t))
	assert.True(t, h.c.idle.Load(), "settled")
}
