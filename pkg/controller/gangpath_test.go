package controller

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	fakediscovery "k8s.io/client-go/discovery/fake"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/klog/v2/ktesting"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

func TestDecideGangPath(t *testing.T) {
	all := served{PodGroups: true, TaintRules: true, CRDs: true, Grove: true}
	gatesOnly := served{TaintRules: true, CRDs: true, Grove: true}
	tests := []struct {
		name   string
		mode   string
		served served
		want   string
		reason string
	}{
		{"auto on 1.37 with the Workload API", GangModeAuto, all, GangPathWorkload, "PodGroups are served"},
		{"workload on 1.37 with the Workload API", GangModeWorkload, all, GangPathWorkload, "PodGroups are served"},
		{"auto on 1.37 without the Workload API", GangModeAuto, gatesOnly, GangPathGates, "DeviceTaintRules are served"},
		{"workload without the Workload API is off, not gates", GangModeWorkload, gatesOnly, GangPathOff, "does not serve scheduling.k8s.io/v1beta1 PodGroups"},
		{"gates on 1.37 even with the Workload API", GangModeGates, all, GangPathGates, "DeviceTaintRules are served"},
		{"auto on 1.34-1.36: no DeviceTaintRules", GangModeAuto, served{CRDs: true}, GangPathOff, "does not serve resource.k8s.io/v1 DeviceTaintRules"},
		{"gates without DeviceTaintRules cannot work", GangModeGates, served{CRDs: true}, GangPathOff, "does not serve resource.k8s.io/v1 DeviceTaintRules"},
		{"no CRDs", GangModeAuto, served{TaintRules: true}, GangPathOff, "CRDs (GpuReservation, GpuQueue) are not installed"},
		{"off", GangModeOff, all, GangPathOff, "gangs.mode is off"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := decideGangPath(tt.mode, tt.served)
			assert.Equal(t, tt.want, p.Path)
			assert.Contains(t, p.Reason, tt.reason)
		})
	}
}

// TestGangPathWatcher: the watcher follows discovery: a cluster that
// starts serving DeviceTaintRules turns the gate path on, with the metric
// and a closed change channel; the webhook's Gates follows.
func TestGangPathWatcher(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	disc := fake.NewClientset().Discovery().(*fakediscovery.FakeDiscovery)
	disc.Resources = []*metav1.APIResourceList{
		{GroupVersion: "gpudra.dev/v1alpha1", APIResources: []metav1.APIResource{{Name: "gpureservations"}, {Name: "gpuqueues"}}},
		{GroupVersion: "resource.k8s.io/v1", APIResources: []metav1.APIResource{{Name: "resourceclaims"}}},
	}
	reg := prometheus.NewRegistry()
	w, err := newGangPathWatcher("", disc, reg)
	require.NoError(t, err)
	assert.Equal(t, "", w.Path(), "undecided before the first check: the webhook refuses gang pods")
	w.check(ctx)
	p, changed := w.current()
	assert.Equal(t, GangPathOff, p.Path)
	assert.Equal(t, GangPathOff, w.Path())
	assert.Equal(t, 1.0, testutil.ToFloat64(w.metric.WithLabelValues(GangPathOff)))

	w.check(ctx)
	assert.False(t, isClosed(changed), "no change, no signal")

	// The cluster is upgraded: DeviceTaintRules are served.
	disc.Resources[1].APIResources = append(disc.Resources[1].APIResources, metav1.APIResource{Name: "devicetaintrules"})
	w.check(ctx)
	assert.True(t, isClosed(changed), "a change is signalled")
	p, _ = w.current()
	assert.Equal(t, GangPathGates, p.Path)
	assert.Equal(t, GangPathGates, w.Path())
	assert.Equal(t, 1.0, testutil.ToFloat64(w.metric.WithLabelValues(GangPathGates)))
	assert.Equal(t, 0.0, testutil.ToFloat64(w.metric.WithLabelValues(GangPathOff)))

	// Upgraded again, with the Workload API on: auto takes it.
	changed = func() <-chan struct{} { _, ch := w.current(); return ch }()
	disc.Resources = append(disc.Resources, &metav1.APIResourceList{GroupVersion: "scheduling.k8s.io/v1beta1",
		APIResources: []metav1.APIResource{{Name: "workloads"}, {Name: "podgroups"}}})
	// Leaving the gate path, a working one, takes several answers.
	for i := 1; i < leaveWorkingPathAfter; i++ {
		w.check(ctx)
		assert.Equal(t, GangPathGates, w.Path())
	}
	w.check(ctx)
	assert.True(t, isClosed(changed))
	assert.Equal(t, GangPathWorkload, w.Path())
	assert.Equal(t, 1.0, testutil.ToFloat64(w.metric.WithLabelValues(GangPathWorkload)))
	assert.Equal(t, 0.0, testutil.ToFloat64(w.metric.WithLabelValues(GangPathGates)))

	_, err = newGangPathWatcher("podgroups", disc, nil)
	assert.ErrorContains(t, err, `gang mode "podgroups": want auto, workload, gates or off`)
}

// flakyDiscovery fails discovery of one group version, a number of times,
// with a server error: "could not tell", not "absent".
type flakyDiscovery struct {
	*fakediscovery.FakeDiscovery
	gv    string
	fails int
}

func (d *flakyDiscovery) ServerResourcesForGroupVersion(gv string) (*metav1.APIResourceList, error) {
	if gv == d.gv && d.fails > 0 {
		d.fails--
		return nil, apierrors.NewInternalError(errors.New("etcdserver: request timed out"))
	}
	return d.FakeDiscovery.ServerResourcesForGroupVersion(gv)
}

func gatesCluster() *fakediscovery.FakeDiscovery {
	disc := fake.NewClientset().Discovery().(*fakediscovery.FakeDiscovery)
	disc.Resources = []*metav1.APIResourceList{
		{GroupVersion: "gpudra.dev/v1alpha1", APIResources: []metav1.APIResource{{Name: "gpureservations"}, {Name: "gpuqueues"}}},
		{GroupVersion: "resource.k8s.io/v1", APIResources: []metav1.APIResource{{Name: "resourceclaims"}, {Name: "devicetaintrules"}}},
	}
	return disc
}

// A group version the server does not have is absent; a 500 is "could
// not tell", an error, never "not served".
func TestDiscoverTellsAbsentFromCouldNotTell(t *testing.T) {
	disc := &flakyDiscovery{FakeDiscovery: gatesCluster(), gv: "resource.k8s.io/v1", fails: 1}
	s, err := discover(disc)
	require.Error(t, err, "a failed discovery is not an answer")
	assert.ErrorContains(t, err, "resource.k8s.io/v1")
	assert.False(t, s.TaintRules)
	s, err = discover(disc)
	require.NoError(t, err, "scheduling.k8s.io/v1beta1 and grove are absent (404): an answer")
	assert.True(t, s.TaintRules)
	assert.False(t, s.PodGroups)
	assert.Equal(t, GangPathGates, decideGangPath(GangModeAuto, s).Path)
}

// One failed discovery keeps the path (the issue: every gated gang pod of
// the cluster was released); a real change leaves a working path only
// after leaveWorkingPathAfter answers in a row.
func TestGangPathKeptWhenDiscoveryFails(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	disc := &flakyDiscovery{FakeDiscovery: gatesCluster(), gv: "resource.k8s.io/v1"}
	w, err := newGangPathWatcher(GangModeAuto, disc, prometheus.NewRegistry())
	require.NoError(t, err)
	w.check(ctx)
	require.Equal(t, GangPathGates, w.Path())
	_, changed := w.current()

	disc.fails = 1
	w.check(ctx)
	assert.Equal(t, GangPathGates, w.Path(), "could not tell: the path stays")
	assert.False(t, isClosed(changed), "no change is signalled, so nothing is released")
	assert.Equal(t, 1.0, testutil.ToFloat64(w.failures))
	assert.True(t, w.unsettled(), "asked again soon")

	// The cluster really stops serving DeviceTaintRules: the answer must
	// come leaveWorkingPathAfter times before the path is left.
	disc.Resources[1].APIResources = disc.Resources[1].APIResources[:1]
	for i := 1; i < leaveWorkingPathAfter; i++ {
		w.check(ctx)
		assert.Equal(t, GangPathGates, w.Path(), "answer %d of %d", i, leaveWorkingPathAfter)
		assert.False(t, isClosed(changed))
	}
	// A failure in between does not count as an answer, nor reset them.
	disc.fails = 1
	w.check(ctx)
	assert.Equal(t, GangPathGates, w.Path())
	w.check(ctx)
	assert.Equal(t, GangPathOff, w.Path(), "left after %d answers in a row", leaveWorkingPathAfter)
	assert.True(t, isClosed(changed))
	assert.False(t, w.unsettled())

	// Coming back to a working path needs no wait.
	_, changed = w.current()
	disc.Resources[1].APIResources = append(disc.Resources[1].APIResources, metav1.APIResource{Name: "devicetaintrules"})
	w.check(ctx)
	assert.Equal(t, GangPathGates, w.Path())
	assert.True(t, isClosed(changed))
}

// A replica whose discovery never answered has decided nothing: it
// releases no gated pod (it did, as "gangs off").
func TestUndecidedGangPathReleasesNothing(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	gated := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "worker-0", Namespace: "team-a", Labels: map[string]string{gpudrav1.LabelGang: "train"}},
		Spec: corev1.PodSpec{SchedulingGates: []corev1.PodSchedulingGate{{Name: gpudrav1.SchedulingGate}}}}
	client := fake.NewClientset(gated)
	disc := &flakyDiscovery{FakeDiscovery: gatesCluster(), gv: "resource.k8s.io/v1", fails: 1 << 30}
	w, err := newGangPathWatcher(GangModeAuto, disc, nil)
	require.NoError(t, err)
	w.check(ctx)
	p, _ := w.current()
	require.Equal(t, "", p.Path, "nothing decided")
	run, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	require.NoError(t, runGangs(run, Config{}, client, nil, w, &gangPlans{}))
	got, err := client.CoreV1().Pods("team-a").Get(ctx, "worker-0", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Len(t, got.Spec.SchedulingGates, 1, "the gate stays")
}
