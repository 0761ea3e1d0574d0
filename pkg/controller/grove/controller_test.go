package grove

import (
	"context"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"
)

const mpsConfig = `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS"}}`

type harness struct {
	client   *fake.Clientset
	recorder *events.FakeRecorder
	registry *prometheus.Registry
	ctrl     *Controller
}

func start(t *testing.T, objs ...runtime.Object) *harness {
	t.Helper()
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithCancel(ctx)
	h := &harness{client: fake.NewClientset(objs...), recorder: events.NewFakeRecorder(100), registry: prometheus.NewRegistry()}
	h.recorder.Verbose = true
	ctrl, err := New(Options{Client: h.client, Recorder: h.recorder, Registerer: h.registry, Now: func() time.Time { return t0 }})
	require.NoError(t, err)
	h.ctrl = ctrl
	done := make(chan error)
	go func() { done <- ctrl.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	return h
}

// nextEvents waits for n Events and returns them.
func (h *harness) nextEvents(t *testing.T, n int) []string {
	t.Helper()
	var out []string
	for len(out) < n {
		select {
		case e := <-h.recorder.Events:
			out = append(out, e)
		case <-time.After(10 * time.Second):
			t.Fatalf("got %d Events, want %d: %q", len(out), n, out)
		}
	}
	return out
}

// noEvents checks that nothing is reported for a while.
func (h *harness) noEvents(t *testing.T) {
	t.Helper()
	select {
	case e := <-h.recorder.Events:
		t.Fatalf("unexpected Event %q", e)
	case <-time.After(500 * time.Millisecond):
	}
}

func (h *harness) gauge(t *testing.T, reason string) func() float64 {
	return func() float64 { return testutil.ToFloat64(h.ctrl.metrics.problems.WithLabelValues(reason)) }
}

func TestControllerReportsOnceOnClaimAndOwner(t *testing.T) {
	ctx := context.Background()
	primary := consumer("primary", boundTo("node-a"), runAsUser(ptr.To[int64](1000), nil))
	shadow := consumer("shadow", boundTo("node-a"), runAsUser(ptr.To[int64](2000), nil))
	claim := groveClaim(allocated("node-a"), config(mpsConfig), reservedFor(primary, shadow))
	h := start(t, claim, primary, shadow, node("node-a", nil))

	got := h.nextEvents(t, 2)
	assert.Contains(t, got[0], "Warning MPSUsersDiffer Share claim grove-demo-0-engine-0-engine-gpu shares through MPS")
	assert.True(t, strings.HasSuffix(got[0], "{kind=ResourceClaim,apiVersion=resource.k8s.io/v1} {kind=PodCliqueScalingGroup,apiVersion=grove.io/v1alpha1}"), got[0])
	assert.Contains(t, got[1], "Warning MPSUsersDiffer Share claim grove-demo-0-engine-0-engine-gpu: claim grove-demo-0-engine-0-engine-gpu shares")
	assert.True(t, strings.HasSuffix(got[1], "{kind=PodCliqueScalingGroup,apiVersion=grove.io/v1alpha1} {kind=ResourceClaim,apiVersion=resource.k8s.io/v1}"), got[1])
	assert.Equal(t, 1.0, h.gauge(t, ReasonMPSUsersDiffer)())
	assert.Equal(t, 1.0, testutil.ToFloat64(h.ctrl.metrics.groups))
	assert.Equal(t, 2.0, testutil.ToFloat64(h.ctrl.metrics.consumers))

	// A change that leaves the problem as it is reports nothing.
	primary.Annotations = map[string]string{"touched": "yes"}
	_, err := h.client.CoreV1().Pods("default").Update(ctx, primary, metav1.UpdateOptions{})
	require.NoError(t, err)
	h.noEvents(t)

	// Solved: the gauge drops; back again: reported again.
	shadow.Spec.SecurityContext.RunAsUser = ptr.To[int64](1000)
	_, err = h.client.CoreV1().Pods("default").Update(ctx, shadow, metav1.UpdateOptions{})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return h.gauge(t, ReasonMPSUsersDiffer)() == 0 }, 10*time.Second, 10*time.Millisecond)
	shadow.Spec.SecurityContext.RunAsUser = ptr.To[int64](3000)
	_, err = h.client.CoreV1().Pods("default").Update(ctx, shadow, metav1.UpdateOptions{})
	require.NoError(t, err)
	got = h.nextEvents(t, 2)
	assert.Contains(t, got[0], "user 3000: shadow/engine")

	// A new consumer that cannot use the node is one more problem.
	late := consumer("late", nodeSelector("zone", "b")) // its user is its image's: not an MPS problem
	_, err = h.client.CoreV1().Pods("default").Create(ctx, late, metav1.CreateOptions{})
	require.NoError(t, err)
	got = h.nextEvents(t, 2)
	assert.Contains(t, got[0], "Warning ConsumerNodeExcluded Share")
	assert.Contains(t, got[0], "pod late: node node-a does not match")
	h.noEvents(t)

	// Deleting the claim forgets the group.
	require.NoError(t, h.client.ResourceV1().ResourceClaims("default").Delete(ctx, claim.Name, metav1.DeleteOptions{}))
	require.Eventually(t, func() bool { return testutil.ToFloat64(h.ctrl.metrics.groups) == 0 }, 10*time.Second, 10*time.Millisecond)
	assert.Equal(t, 0.0, h.gauge(t, ReasonMPSUsersDiffer)())
}

func TestControllerIgnoresOtherClaims(t *testing.T) {
	notGrove := groveClaim(allocated("node-a"), config(mpsConfig))
	notGrove.Name, notGrove.UID = "mine", "mine-uid"
	delete(notGrove.Labels, LabelComponent)
	otherDriver := groveClaim(allocated("node-a"), config(mpsConfig))
	otherDriver.Name, otherDriver.UID = "theirs", "theirs-uid"
	otherDriver.Status.Allocation.Devices.Results[0].Driver = "gpu.nvidia.com"
	var pods []runtime.Object
	for i, c := range []string{"mine", "theirs"} {
		p := consumer(c+"-pod", runAsUser(ptr.To(int64(1000+i)), nil))
		p.Spec.ResourceClaims[0].ResourceClaimName = ptr.To(c)
		pods = append(pods, p)
	}
	h := start(t, append(pods, notGrove, otherDriver)...)
	h.noEvents(t)
	assert.Empty(t, h.ctrl.Groups())
}

// A new leader reads what the previous one reported and does not report
// it again.
func TestControllerSeedsFromEarlierEvents(t *testing.T) {
	primary := consumer("primary", runAsUser(ptr.To[int64](1000), nil))
	shadow := consumer("shadow", runAsUser(ptr.To[int64](2000), nil))
	claim := groveClaim(config(mpsConfig))
	g, _ := Analyze(Input{Claim: claim, Pods: []*corev1.Pod{primary, shadow}, Now: t0})
	require.Len(t, g.Problems, 1)
	earlier := &eventsv1.Event{
		ObjectMeta: metav1.ObjectMeta{Name: "earlier", Namespace: "default"},
		Regarding:  corev1.ObjectReference{Kind: "ResourceClaim", Namespace: "default", Name: claim.Name, UID: claim.UID},
		Reason:     ReasonMPSUsersDiffer, Action: ActionShare, Type: corev1.EventTypeWarning, Note: g.Problems[0].Message,
		EventTime: metav1.NewMicroTime(t0),
	}
	h := start(t, claim, primary, shadow, earlier)
	require.Eventually(t, func() bool { return h.gauge(t, ReasonMPSUsersDiffer)() == 1 }, 10*time.Second, 10*time.Millisecond)
	h.noEvents(t)
}

func TestControllerRechecksPendingConsumers(t *testing.T) {
	now := t0
	msg := "0/1 nodes are available: 1 cannot allocate all claims."
	pod := consumer("primary", unschedulable(t0, msg))
	claim := groveClaim()
	client := fake.NewClientset(claim, pod)
	recorder := events.NewFakeRecorder(10)
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	clock := make(chan time.Time, 1)
	clock <- now
	ctrl, err := New(Options{Client: client, Recorder: recorder, PendingGrace: 200 * time.Millisecond, Now: func() time.Time {
		// The first sync sees t0; later ones see the grace period passed.
		select {
		case t := <-clock:
			return t
		default:
			return t0.Add(time.Second)
		}
	}})
	require.NoError(t, err)
	go func() { _ = ctrl.Run(ctx) }()
	select {
	case e := <-recorder.Events:
		assert.Contains(t, e, "Warning ConsumersPending 1 consumer(s) of claim grove-demo-0-engine-0-engine-gpu cannot be scheduled for longer than 200ms: pod primary: "+msg)
	case <-time.After(10 * time.Second):
		t.Fatal("no ConsumersPending Event")
	}
}

func TestNoteFitsAnEvent(t *testing.T) {
	long := strings.Repeat("é", 600) // 1200 bytes
	for _, msg := range []string{"short", strings.Repeat("x", noteLimit), long} {
		n := note(msg)
		assert.LessOrEqual(t, len(n), noteLimit)
		assert.True(t, utf8.ValidString(n))
		if len(msg) <= noteLimit {
			assert.Equal(t, msg, n)
		} else {
			assert.True(t, strings.HasSuffix(n, "..."))
		}
	}
}
