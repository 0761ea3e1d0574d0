package controller

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	fakediscovery "k8s.io/client-go/discovery/fake"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/klog/v2/ktesting"
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
	assert.Equal(t, GangPathOff, w.Path(), "nothing is gated before the first check")
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
	w.check(ctx)
	assert.True(t, isClosed(changed))
	assert.Equal(t, GangPathWorkload, w.Path())
	assert.Equal(t, 1.0, testutil.ToFloat64(w.metric.WithLabelValues(GangPathWorkload)))
	assert.Equal(t, 0.0, testutil.ToFloat64(w.metric.WithLabelValues(GangPathGates)))

	_, err = newGangPathWatcher("podgroups", disc, nil)
	assert.ErrorContains(t, err, `gang mode "podgroups": want auto, workload, gates or off`)
}
