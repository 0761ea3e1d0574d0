package gang

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	fakediscovery "k8s.io/client-go/discovery/fake"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// demandHarness is a round harness whose API serves CapacityBuffers: the
// publisher's discovery is the fake clientset's, its buffers live in a
// fake dynamic client, and its informers are stand-ins that each round
// fills from the fake API first. log records the API calls of both fakes in
// order, as "verb resource[/subresource]".
type demandHarness struct {
	*roundHarness
	buffers *dynamicfake.FakeDynamicClient
	disc    *fakediscovery.FakeDiscovery
	stores  *demandStores
	log     *[]string
}

// servedBuffers is discovery's answer where CapacityBuffers are served.
var servedBuffers = &metav1.APIResourceList{GroupVersion: CapacityBuffers.GroupVersion().String(),
	APIResources: []metav1.APIResource{{Name: "capacitybuffers", Namespaced: true, Kind: "CapacityBuffer"}}}

func withDemand(t *testing.T, h *roundHarness, existing ...runtime.Object) *demandHarness {
	t.Helper()
	h.c.committer.settle = time.Millisecond
	d := &demandHarness{roundHarness: h, log: new([]string)}
	d.buffers = dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(),
		map[schema.GroupVersionResource]string{CapacityBuffers: "CapacityBufferList"}, existing...)
	d.disc = h.client.Discovery().(*fakediscovery.FakeDiscovery)
	d.disc.Resources = []*metav1.APIResourceList{servedBuffers}
	record := func(a k8stesting.Action) (bool, runtime.Object, error) {
		what := a.GetVerb() + " " + a.GetResource().Resource
		if a.GetSubresource() != "" {
			what += "/" + a.GetSubresource()
		}
		if n, ok := a.(interface{ GetName() string }); ok && n.GetName() != "" {
			what += " " + n.GetName()
		}
		if c, ok := a.(k8stesting.CreateAction); ok {
			if m, ok := c.GetObject().(metav1.Object); ok {
				what += " " + m.GetName()
			}
		}
		*d.log = append(*d.log, what)
		return false, nil, nil
	}
	h.client.PrependReactor("*", "*", record)
	d.buffers.PrependReactor("*", "*", record)
	d.stores = &demandStores{buffers: cache.NewStore(cache.MetaNamespaceKeyFunc), templates: cache.NewStore(cache.MetaNamespaceKeyFunc),
		claims: cache.NewStore(cache.MetaNamespaceKeyFunc), synced: func() bool { return true }, stop: func() {}}
	p := newDemandPublisher(Options{Client: h.client, Dynamic: d.buffers, Now: h.c.opts.Now}, h.c.metrics)
	p.start = func(context.Context) *demandStores { return d.stores }
	h.c.autoscaler = p
	return d
}

// round fills the stand-in informers from the fake API and runs a round.
func (d *demandHarness) round(t *testing.T) error {
	t.Helper()
	ctx := context.Background()
	bufs, err := d.buffers.Resource(CapacityBuffers).Namespace("").List(ctx, metav1.ListOptions{LabelSelector: LabelDemandFor})
	require.NoError(t, err)
	var objs []any
	for i := range bufs.Items {
		objs = append(objs, &bufs.Items[i])
	}
	require.NoError(t, d.stores.buffers.Replace(objs, ""))
	tmpls, err := d.client.CoreV1().PodTemplates("").List(ctx, metav1.ListOptions{LabelSelector: LabelDemandFor})
	require.NoError(t, err)
	objs = nil
	for i := range tmpls.Items {
		objs = append(objs, &tmpls.Items[i])
	}
	require.NoError(t, d.stores.templates.Replace(objs, ""))
	claims, err := d.client.ResourceV1().ResourceClaims("").List(ctx, metav1.ListOptions{LabelSelector: LabelDemandFor})
	require.NoError(t, err)
	objs = nil
	for i := range claims.Items {
		objs = append(objs, &claims.Items[i])
	}
	require.NoError(t, d.stores.claims.Replace(objs, ""))
	*d.log = nil
	return d.roundHarness.round(t)
}

// bufferNames are the CapacityBuffers in the fake API.
func (d *demandHarness) bufferNames(t *testing.T) []string {
	t.Helper()
	list, err := d.buffers.Resource(CapacityBuffers).Namespace("").List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	var out []string
	for _, b := range list.Items {
		out = append(out, b.GetName())
	}
	slices.Sort(out)
	return out
}

func (d *demandHarness) template(t *testing.T, name string) *corev1.PodTemplate {
	t.Helper()
	pt, err := d.client.CoreV1().PodTemplates("ns").Get(context.Background(), name, metav1.GetOptions{})
	require.NoError(t, err)
	return pt
}

// index is where the first logged call starting with prefix is, -1 for none.
func (d *demandHarness) index(prefix string) int {
	return slices.IndexFunc(*d.log, func(s string) bool { return strings.HasPrefix(s, prefix) })
}

// demandCalls are the logged calls that write demand objects.
func (d *demandHarness) demandCalls() []string {
	var out []string
	for _, s := range *d.log {
		verb, rest, _ := strings.Cut(s, " ")
		if (verb == "create" || verb == "delete") && (strings.HasPrefix(rest, "capacitybuffers") || strings.HasPrefix(rest, "podtemplates") ||
			strings.HasPrefix(rest, "resourceclaims "+demandPrefix)) {
			out = append(out, s)
		}
	}
	return out
}

// fromTemplate makes the pod's claim "gpu" from ResourceClaimTemplate
// one-gpu; made (not nil) is the claim the claim controller made for it.
func fromTemplate(p *corev1.Pod, made *string) *corev1.Pod {
	p.Spec.ResourceClaims = append(p.Spec.ResourceClaims, corev1.PodResourceClaim{Name: "gpu", ResourceClaimTemplateName: ptr.To("one-gpu")})
	p.Spec.Containers = []corev1.Container{{Name: "main", Image: "train", Resources: corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: "gpu"}}}}}
	if made != nil {
		p.Status.ResourceClaimStatuses = []corev1.PodResourceClaimStatus{{Name: "gpu", ResourceClaimName: made}}
	}
	return p
}

// busyGPUs takes n0's two GPUs, for a claim nobody will release.
func busyGPUs() *resourceapi.ResourceClaim {
	c := allocatedClaim("busy", "gpu-0", "gpu-1")
	c.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: "running", UID: "uid-running"}}
	return c
}

// TestWaitingGangPublishesOneBufferPerPod: on the gate path a complete
// gang whose devices do not fit now (n0's GPUs are taken) gets, per pod, a
// PodTemplate and a CapacityBuffer of one replica naming it; the template
// is the pod's spec without the gate, each claim named by the claim that
// exists (a template's, from the pod's status); all labelled with the gang
// and owned by the pod. A second round changes nothing.
func TestWaitingGangPublishesOneBufferPerPod(t *testing.T) {
	a := withUID(fromTemplate(plain("a", "train", "2"), ptr.To("a-gpu-x7")))
	a.Spec.EphemeralContainers = []corev1.EphemeralContainer{{EphemeralContainerCommon: corev1.EphemeralContainerCommon{Name: "debugger", Image: "busybox"}}}
	a.Spec.Containers = []corev1.Container{{Name: "worker", Image: "cuda:12.8"}}
	slim, err := dropUnread(a) // as the pod informer keeps it
	require.NoError(t, err)
	a = slim.(*corev1.Pod)
	b := withUID(plain("b", "train", "2", "cb"))
	h := newRoundHarness(t, a, b, oneGPUClaim("a-gpu-x7"), oneGPUClaim("cb"), busyGPUs())
	h.addTwoGPUNode(t)
	d := withDemand(t, h)

	require.NoError(t, d.round(t))
	assert.Equal(t, gpudrav1.ReasonWaitingForDevices, gangConditionOf(h.pod(t, "a")).Reason)
	assert.Equal(t, []string{"gpudra-demand-pod-a", "gpudra-demand-pod-b"}, d.bufferNames(t))
	buf, err := d.buffers.Resource(CapacityBuffers).Namespace("ns").Get(context.Background(), "gpudra-demand-pod-a", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, map[string]any{"provisioningStrategy": ActiveProvisioningStrategy, "podTemplateRef": map[string]any{"name": "gpudra-demand-pod-a"},
		"replicas": int64(1)}, buf.Object["spec"])
	assert.Nil(t, buf.Object["status"], "the status is the autoscaler's buffer controller's")
	assert.Equal(t, map[string]string{LabelDemandFor: "train", LabelDemandKind: "gang"}, buf.GetLabels())
	require.Len(t, buf.GetOwnerReferences(), 1)
	assert.Equal(t, metav1.OwnerReference{APIVersion: "v1", Kind: "Pod", Name: "a", UID: a.UID}, buf.GetOwnerReferences()[0])

	ta := d.template(t, "gpudra-demand-pod-a")
	assert.Empty(t, ta.Template.Spec.SchedulingGates)
	assert.Empty(t, ta.Template.Spec.EphemeralContainers, "a PodTemplate may have none")
	require.NotEmpty(t, ta.Template.Spec.Containers)
	for _, c := range ta.Template.Spec.Containers {
		assert.NotEmpty(t, c.Image, "the API refuses a PodTemplate's container without an image (the informer's pods have none: dropUnread)")
	}
	assert.Equal(t, []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimName: ptr.To("a-gpu-x7")}}, ta.Template.Spec.ResourceClaims,
		"the claim made from the template, by name: a virtual pod has no status")
	assert.Equal(t, a.Labels, ta.Template.Labels)
	assert.Equal(t, "train", ta.Labels[LabelDemandFor])
	assert.Equal(t, a.UID, ta.OwnerReferences[0].UID)
	assert.Equal(t, []corev1.PodResourceClaim{{Name: "cb", ResourceClaimName: ptr.To("cb")}}, d.template(t, "gpudra-demand-pod-b").Template.Spec.ResourceClaims)
	assert.Equal(t, 2.0, testutil.ToFloat64(h.c.metrics.demandBuffers))

	require.NoError(t, d.round(t))
	assert.Empty(t, d.demandCalls(), "published already: nothing to write")
}

// TestWorkloadPathGangDemandClaims: on the Workload API path a waiting
// gang's claims are not made yet (the claim controller waits for the
// PodGroup); each pod's template names a standalone demand claim of the
// ResourceClaimTemplate's spec, made before the buffer.
func TestWorkloadPathGangDemandClaims(t *testing.T) {
	h := newWorkloadHarness(t, fromTemplate(grouped(plain("a0", "g", "2")), nil), fromTemplate(grouped(plain("a1", "g", "2")), nil), busyGPUs())
	h.c.templates = cache.NewStore(cache.MetaNamespaceKeyFunc)
	require.NoError(t, h.c.templates.Add(&resourceapi.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Name: "one-gpu", Namespace: "ns"},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: oneGPUClaim("x").Spec}}))
	d := withDemand(t, h)

	require.NoError(t, d.round(t))
	assert.Equal(t, []string{"gpudra-demand-pod-a0", "gpudra-demand-pod-a1"}, d.bufferNames(t))
	tmpl := d.template(t, "gpudra-demand-pod-a0")
	assert.Nil(t, tmpl.Template.Spec.SchedulingGroup, "the virtual pod is in no PodGroup")
	assert.Equal(t, []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimName: ptr.To("gpudra-demand-pod-a0.gpu")}}, tmpl.Template.Spec.ResourceClaims)
	cl := h.getClaim(t, "gpudra-demand-pod-a0.gpu")
	assert.Equal(t, oneGPUClaim("x").Spec, cl.Spec)
	assert.Equal(t, "g", cl.Labels[LabelDemandFor])
	assert.Nil(t, cl.Status.Allocation)
	assert.Less(t, d.index("create resourceclaims gpudra-demand-pod-a0.gpu"), d.index("create capacitybuffers gpudra-demand-pod-a0"),
		"the claim before the buffer that needs it: %v", *d.log)
}

// TestNoDemandForGangsWaitingForOtherReasons: an incomplete gang and one
// behind another in its queue are held back by gpudra, not by the
// cluster's size: more nodes would not start them, and none is asked for.
// The gang ahead, waiting for devices, is.
func TestNoDemandForGangsWaitingForOtherReasons(t *testing.T) {
	later := func(p *corev1.Pod) *corev1.Pod { p.CreationTimestamp = metav1.NewTime(t0.Add(time.Second)); return p }
	h := newRoundHarness(t,
		withUID(plain("a0", "first", "1", "ca0")),
		later(withUID(plain("b0", "second", "1", "cb0"))),
		withUID(plain("c0", "short", "2", "cc0")),
		oneGPUClaim("ca0"), oneGPUClaim("cb0"), oneGPUClaim("cc0"), busyGPUs())
	h.addTwoGPUNode(t)
	d := withDemand(t, h)

	require.NoError(t, d.round(t))
	assert.Equal(t, gpudrav1.ReasonBehindInQueue, gangConditionOf(h.pod(t, "b0")).Reason)
	assert.Equal(t, ReasonWaitingForPods, gangConditionOf(h.pod(t, "c0")).Reason)
	assert.Equal(t, []string{"gpudra-demand-pod-a0"}, d.bufferNames(t), "only the head, which waits for devices")
}

// TestQueuedReservationDemand: a queued reservation whose devices do not
// fit gets a buffer per claim; its claims do not exist while it is queued,
// so each template names a demand claim of the claim's spec, and tolerates
// every taint (a reservation is planned on any node).
func TestQueuedReservationDemand(t *testing.T) {
	h := newRoundHarness(t, busyGPUs())
	h.addTwoGPUNode(t)
	h.withReservations(t, &gpudrav1.GpuReservation{ObjectMeta: metav1.ObjectMeta{Name: "r", Namespace: "ns", UID: "uid-r", CreationTimestamp: metav1.NewTime(t0)},
		Spec: gpudrav1.GpuReservationSpec{DeviceClassName: "gpu.gpudra.dev", Claims: 2, Count: 1, TTL: metav1.Duration{Duration: time.Hour}}})
	d := withDemand(t, h)

	require.NoError(t, d.round(t))
	assert.Equal(t, gpudrav1.ReasonWaitingForDevices, h.reservation(t, "r").Status.Reason)
	assert.Equal(t, []string{"gpudra-demand-res-r-0", "gpudra-demand-res-r-1"}, d.bufferNames(t))
	tmpl := d.template(t, "gpudra-demand-res-r-0")
	assert.Equal(t, []corev1.Toleration{{Operator: corev1.TolerationOpExists}}, tmpl.Template.Spec.Tolerations)
	assert.Equal(t, []corev1.PodResourceClaim{{Name: "devices", ResourceClaimName: ptr.To("gpudra-demand-res-r-0")}}, tmpl.Template.Spec.ResourceClaims)
	assert.Equal(t, map[string]string{LabelDemandFor: "r", LabelDemandKind: "reservation"}, tmpl.Labels)
	assert.Equal(t, gpudrav1.KindGpuReservation, tmpl.OwnerReferences[0].Kind)
	cl := h.getClaim(t, "gpudra-demand-res-r-0")
	assert.EqualValues(t, 1, cl.Spec.Devices.Requests[0].Exactly.Count)
	_, err := h.client.ResourceV1().ResourceClaims("ns").Get(context.Background(), "r-0", metav1.GetOptions{})
	assert.True(t, apierrors.IsNotFound(err), "the reservation's own claim is made only when it is held: %v", err)
}

// TestDemandTakenBackBeforeTheGangIsWritten: once the gang fits (the busy
// claim ended), its buffers, templates and demand claims are deleted
// before its allocation is written and its gates lifted (gate path), or
// its PodGroup made (Workload API path).
func TestDemandTakenBackBeforeTheGangIsWritten(t *testing.T) {
	ctx := context.Background()
	t.Run("gates", func(t *testing.T) {
		h := newRoundHarness(t, withUID(plain("a", "g", "2", "ca")), withUID(plain("b", "g", "2", "cb")), oneGPUClaim("ca"), oneGPUClaim("cb"), busyGPUs())
		h.addTwoGPUNode(t)
		d := withDemand(t, h)
		require.NoError(t, d.round(t))
		require.Len(t, d.bufferNames(t), 2)

		require.NoError(t, h.client.ResourceV1().ResourceClaims("ns").Delete(ctx, "busy", metav1.DeleteOptions{}))
		require.NoError(t, d.round(t))
		assert.Empty(t, d.bufferNames(t))
		del, write, lift := d.index("delete capacitybuffers"), d.index("update resourceclaims/status"), d.index("patch pods")
		require.True(t, del >= 0 && write >= 0 && lift >= 0, "calls: %v", *d.log)
		assert.Less(t, del, write, "buffers deleted before the allocation is written: %v", *d.log)
		assert.Less(t, d.index("delete podtemplates"), write, "templates too: %v", *d.log)
		assert.False(t, gated(h.pod(t, "a")))
	})
	t.Run("workload", func(t *testing.T) {
		h := newWorkloadHarness(t, fromTemplate(grouped(plain("a0", "g", "2")), nil), fromTemplate(grouped(plain("a1", "g", "2")), nil), busyGPUs())
		h.c.templates = cache.NewStore(cache.MetaNamespaceKeyFunc)
		require.NoError(t, h.c.templates.Add(&resourceapi.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Name: "one-gpu", Namespace: "ns"},
			Spec: resourceapi.ResourceClaimTemplateSpec{Spec: oneGPUClaim("x").Spec}}))
		d := withDemand(t, h)
		require.NoError(t, d.round(t))
		require.Len(t, d.bufferNames(t), 2)

		require.NoError(t, h.client.ResourceV1().ResourceClaims("ns").Delete(ctx, "busy", metav1.DeleteOptions{}))
		require.NoError(t, d.round(t))
		assert.Empty(t, d.bufferNames(t))
		del, claim, group := d.index("delete capacitybuffers"), d.index("delete resourceclaims gpudra-demand-"), d.index("create podgroups")
		require.True(t, del >= 0 && claim >= 0 && group >= 0, "calls: %v", *d.log)
		assert.Less(t, del, group, "buffers deleted before the PodGroup is made: %v", *d.log)
		assert.Less(t, claim, group, "demand claims too: %v", *d.log)
	})
}

// TestFailedTakeBackHoldsTheAdmission: a buffer that cannot be deleted (a
// 500) keeps the gang waiting, nothing written; the next round deletes it
// and admits the gang.
func TestFailedTakeBackHoldsTheAdmission(t *testing.T) {
	h := newRoundHarness(t, withUID(plain("a", "g", "1", "ca")), oneGPUClaim("ca"), busyGPUs())
	h.addTwoGPUNode(t)
	d := withDemand(t, h)
	require.NoError(t, d.round(t))
	require.Len(t, d.bufferNames(t), 1)

	require.NoError(t, h.client.ResourceV1().ResourceClaims("ns").Delete(context.Background(), "busy", metav1.DeleteOptions{}))
	failed := 0
	d.buffers.PrependReactor("delete", "capacitybuffers", func(k8stesting.Action) (bool, runtime.Object, error) {
		if failed == 0 {
			failed++
			return true, nil, apierrors.NewInternalError(errors.New("etcdserver: request timed out"))
		}
		return false, nil, nil
	})
	err := d.round(t)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "admit Gang/ns/g: delete autoscaler demand capacitybuffers ns/gpudra-demand-pod-a")
	assert.True(t, gated(h.pod(t, "a")), "not admitted while its buffer may remain")
	assert.Nil(t, h.getClaim(t, "ca").Status.Allocation)
	assert.Equal(t, 1.0, testutil.ToFloat64(h.c.metrics.demandWriteFailures.WithLabelValues("delete")))

	require.NoError(t, d.round(t))
	assert.Empty(t, d.bufferNames(t))
	assert.False(t, gated(h.pod(t, "a")), "admitted once its buffer is gone")
}

// staleDemand is what a leader published for a gang pod before it
// stopped: a buffer and its template, owned by the pod.
func staleDemand(p *corev1.Pod) (*unstructured.Unstructured, *corev1.PodTemplate) {
	owner := metav1.OwnerReference{APIVersion: "v1", Kind: "Pod", Name: p.Name, UID: p.UID}
	labels := demandItemLabels(demandKindGang, p.Labels[gpudrav1.LabelGang])
	buf := demandBuffer(demandName("pod-"+p.Name), "ns", labels, owner)
	buf.SetUID("uid-buffer")
	tmpl := &corev1.PodTemplate{ObjectMeta: demandMeta(demandName("pod-"+p.Name), "ns", labels, owner)}
	tmpl.UID = "uid-template"
	return buf, tmpl
}

// TestNewLeaderDeletesStaleDemand: a leader published a gang's demand,
// admitted it and stopped before deleting it. A new controller, with no
// memory of it, finds it in the API and deletes it: the gang no longer
// waits for devices.
func TestNewLeaderDeletesStaleDemand(t *testing.T) {
	a := withUID(ungated(plain("a", "g", "1", "ca")))
	buf, tmpl := staleDemand(a)
	h := newRoundHarness(t, a, allocatedClaim("ca", "gpu-0"), tmpl)
	h.addTwoGPUNode(t)
	d := withDemand(t, h, buf)

	require.NoError(t, d.round(t))
	assert.Empty(t, d.bufferNames(t), "the admitted gang's buffer is deleted")
	_, err := h.client.CoreV1().PodTemplates("ns").Get(context.Background(), "gpudra-demand-pod-a", metav1.GetOptions{})
	assert.True(t, apierrors.IsNotFound(err), "and its template: %v", err)
	assert.Less(t, d.index("delete capacitybuffers"), d.index("delete podtemplates"), "the buffer first: %v", *d.log)
}

// TestDemandDiscovery: discovery that cannot tell (a 500) is neither
// "served" nor "absent": a controller that never had an answer writes and
// deletes nothing (a waiting gang gets no buffer; a stale one stays), and
// counts the failure; once discovery answers, it publishes. A later
// failure keeps the last answer. A 404 means absent: nothing, no failure.
func TestDemandDiscovery(t *testing.T) {
	a := withUID(plain("a", "g", "1", "ca"))
	stale := withUID(ungated(plain("s", "old", "1")))
	buf, tmpl := staleDemand(stale)
	h := newRoundHarness(t, a, oneGPUClaim("ca"), busyGPUs(), stale, tmpl)
	h.addTwoGPUNode(t)
	now := t0
	h.c.opts.Now = func() time.Time { return now }
	d := withDemand(t, h, buf)
	d.c.autoscaler.now = h.c.opts.Now
	down := true
	d.disc.PrependReactor("get", "resource", func(k8stesting.Action) (bool, runtime.Object, error) {
		if down {
			return true, nil, apierrors.NewInternalError(errors.New("discovery unavailable"))
		}
		return false, nil, nil
	})

	require.NoError(t, d.round(t))
	assert.Empty(t, d.demandCalls(), "could not tell: nothing written or deleted")
	assert.Equal(t, []string{"gpudra-demand-pod-s"}, d.bufferNames(t), "the stale buffer stays")
	assert.Equal(t, 1.0, testutil.ToFloat64(h.c.metrics.demandDiscoveryFailures))

	down = false
	now = now.Add(demandRecheckEvery)
	require.NoError(t, d.round(t))
	assert.Contains(t, d.demandCalls(), "create capacitybuffers gpudra-demand-pod-a", "served: the waiting gang's buffer")
	assert.Contains(t, d.demandCalls(), "delete capacitybuffers gpudra-demand-pod-s", "and the admitted gang's stale one goes")

	down = true
	now = now.Add(demandCheckEvery)
	require.NoError(t, d.round(t))
	assert.True(t, d.c.autoscaler.active(context.Background()), "a failure keeps the last answer")

	d.disc.Resources = nil
	down = false
	now = now.Add(demandRecheckEvery)
	require.NoError(t, d.round(t))
	assert.False(t, d.c.autoscaler.active(context.Background()), "404: absent")
	assert.Empty(t, d.demandCalls())
	assert.Equal(t, 2.0, testutil.ToFloat64(h.c.metrics.demandDiscoveryFailures))
}

// TestDemandNames: names and labels hold any item name: a long one is
// shortened with a hash, and stays a valid name and label value.
func TestDemandNames(t *testing.T) {
	long := strings.Repeat("a", 70)
	l := demandItemLabels(demandKindGang, long)[LabelDemandFor]
	assert.LessOrEqual(t, len(l), 63)
	assert.NotEqual(t, l, demandItemLabels(demandKindGang, long+"b")[LabelDemandFor])
	assert.Equal(t, "train", demandItemLabels(demandKindGang, "train")[LabelDemandFor])
	n := demandName("pod-" + strings.Repeat("p", 300))
	assert.Len(t, n, 253)
	assert.True(t, strings.HasPrefix(n, demandPrefix))
	assert.Equal(t, "gpudra-demand-pod-a", demandName("pod-a"))
	assert.NotEqual(t, demandName("pod-a.b-c"), demandName("pod-a-b.c"))
}

// TestUnsatisfiableForLackOfDevicesPublishesDemand: a pool scaled to zero
// has no GPU node, so a gang would not fit even on the empty cluster
// (Unsatisfiable), yet more nodes are exactly what it needs: its demand is
// published. A gang Unsatisfiable for a policy (its pods' priorities
// differ, on the Workload API path) gets none: no node would start it.
func TestUnsatisfiableForLackOfDevicesPublishesDemand(t *testing.T) {
	t.Run("no GPU node", func(t *testing.T) {
		h := newRoundHarness(t, withUID(plain("a", "g", "1", "ca")), oneGPUClaim("ca"))
		require.NoError(t, h.c.classes.Add(&resourceapi.DeviceClass{ObjectMeta: metav1.ObjectMeta{Name: "gpu.gpudra.dev"}}))
		d := withDemand(t, h)
		require.NoError(t, d.round(t))
		assert.Equal(t, gpudrav1.ReasonUnsatisfiable, gangConditionOf(h.pod(t, "a")).Reason)
		assert.Equal(t, []string{"gpudra-demand-pod-a"}, d.bufferNames(t))
	})
	t.Run("mixed priorities", func(t *testing.T) {
		h := newWorkloadHarness(t, withPriority(grouped(plain("a0", "g", "2", "ca0")), "high", 1000), grouped(plain("a1", "g", "2", "ca1")),
			oneGPUClaim("ca0"), oneGPUClaim("ca1"), busyGPUs())
		d := withDemand(t, h)
		require.NoError(t, d.round(t))
		assert.Equal(t, gpudrav1.ReasonUnsatisfiable, gangConditionOf(h.pod(t, "a0")).Reason)
		assert.Empty(t, d.bufferNames(t))
	})
}

// TestDemandInformers: the real informers, started once buffers are
// served, show the labelled demand objects and nothing else.
func TestDemandInformers(t *testing.T) {
	p := withUID(plain("a", "g", "1"))
	buf, tmpl := staleDemand(p)
	other := &corev1.PodTemplate{ObjectMeta: metav1.ObjectMeta{Name: "users-own", Namespace: "ns"}}
	h := newRoundHarness(t, tmpl, other, oneGPUClaim("plain"))
	d := withDemand(t, h, buf)
	pub := newDemandPublisher(Options{Client: h.client, Dynamic: d.buffers, Discovery: d.disc, Now: h.c.opts.Now}, h.c.metrics)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	require.Eventually(t, func() bool { return pub.active(ctx) }, 10*time.Second, 10*time.Millisecond)
	defer pub.stores.stop()
	var got []string
	for _, o := range pub.existing() {
		got = append(got, o.resource+"/"+o.name)
	}
	slices.Sort(got)
	assert.Equal(t, []string{"capacitybuffers/gpudra-demand-pod-a", "podtemplates/gpudra-demand-pod-a"}, got)
}
