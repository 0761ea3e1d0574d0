package main

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/deviceplugin"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/plugin"
	"github.com/gpudra/gpudra/pkg/telemetry"
)

// noTelemetry is a backend that reads no telemetry.
type noTelemetry struct{ nvdevice.Interface }

func TestTelemetryOnBothModesRegistries(t *testing.T) {
	m, err := sim.NewBuiltin("dgx-h100", "node-a")
	require.NoError(t, err)
	defer m.Close()
	for _, tc := range []struct {
		name     string
		reg      *prometheus.Registry
		backend  nvdevice.Interface
		interval time.Duration
		want     int // power limit series
	}{
		{"DRA mode", plugin.NewMetrics().Registry, m, time.Hour, 8},
		{"device plugin mode", deviceplugin.NewMetrics().Registry, m, time.Hour, 8},
		{"a backend without telemetry", plugin.NewMetrics().Registry, noTelemetry{m}, time.Hour, 0},
		{"--telemetry-interval=0", plugin.NewMetrics().Registry, m, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			c := telemetry.Register(ctx, tc.reg, tc.backend, "node-a", tc.interval)
			assert.Equal(t, tc.want > 0, c != nil)
			count := func() int {
				n, err := testutil.GatherAndCount(tc.reg, "gpudra_gpu_power_limit_watts")
				require.NoError(t, err, "no collision with the registry's other metrics")
				return n
			}
			if tc.want > 0 {
				// The sampler's first pass, at its start.
				require.Eventually(t, func() bool { return count() == tc.want }, 10*time.Second, 10*time.Millisecond)
			}
			assert.Equal(t, tc.want, count())
			n, err := testutil.GatherAndCount(tc.reg, "gpudra_telemetry_up")
			require.NoError(t, err)
			assert.Equal(t, min(tc.want, 1), n, "telemetry_up only where telemetry is on")
		})
	}
}

func TestHealthMetricsOnBothModesRegistries(t *testing.T) {
	m, err := sim.NewBuiltin("dgx-h100", "node-a")
	require.NoError(t, err)
	defer m.Close()
	for _, tc := range []struct {
		name string
		reg  *prometheus.Registry
	}{
		{"DRA mode", plugin.NewMetrics().Registry},
		{"device plugin mode", deviceplugin.NewMetrics().Registry},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, err := registerHealthMetrics(context.Background(), tc.reg, m, "node-a")
			require.NoError(t, err)
			h.XID("GPU-x", 79)
			n, err := testutil.GatherAndCount(tc.reg, "gpudra_gpu_healthy")
			require.NoError(t, err, "no collision with the registry's other metrics")
			assert.Equal(t, 8+1, n, "every GPU of the inventory, and one seen only in an event")
			n, err = testutil.GatherAndCount(tc.reg, "gpudra_gpu_xid_errors_total")
			require.NoError(t, err)
			assert.Equal(t, 1, n)
		})
	}
}

// --telemetry-processes turns process attribution on in either mode's
// registry (here without a kubelet: attribution_up says 0 and no pod
// series come); off, there is no attribution series at all.
func TestAttributionOnBothModesRegistries(t *testing.T) {
	m, err := sim.NewBuiltin("dgx-h100", "node-a")
	require.NoError(t, err)
	defer m.Close()
	for _, tc := range []struct {
		name string
		reg  *prometheus.Registry
		args []string
		want int // attribution_up series
	}{
		{"DRA mode", plugin.NewMetrics().Registry, nil, 1},
		{"device plugin mode", deviceplugin.NewMetrics().Registry, []string{"--mode=device-plugin"}, 1},
		{"--telemetry-processes=false", plugin.NewMetrics().Registry, []string{"--telemetry-processes=false"}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, o, err := parse(t, append([]string{"--node-name=node-a", "--pod-resources-socket=" + t.TempDir() + "/none.sock", "--container-log-dir=" + t.TempDir()}, tc.args...), nil)
			require.NoError(t, err)
			require.NoError(t, o.validate(c.Features))
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			col := telemetry.Register(ctx, tc.reg, m, "node-a", time.Hour)
			o.startAttribution(col)
			col.Sample(ctx) // the first pass may have run before SetAttribution
			n, err := testutil.GatherAndCount(tc.reg, "gpudra_telemetry_attribution_up")
			require.NoError(t, err, "no collision with the registry's other metrics")
			assert.Equal(t, tc.want, n)
			if tc.want > 0 {
				assert.Equal(t, 0.0, gaugeValue(t, tc.reg, "gpudra_telemetry_attribution_up"), "no kubelet: could not tell")
			}
			n, err = testutil.GatherAndCount(tc.reg, "gpudra_device_pod_info", "gpudra_container_gpu_processes", "gpudra_unattributed_gpu_processes")
			require.NoError(t, err)
			assert.Zero(t, n, "without the kubelet's answer, no pod, container or unattributed series")
		})
	}
	o := &options{}
	o.startAttribution(nil) // no telemetry (--telemetry-interval=0): nothing to do, no panic
}

// gaugeValue is the value of reg's first series of name.
func gaugeValue(t *testing.T, reg prometheus.Gatherer, name string) float64 {
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) > 0 {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("no %s series", name)
	return 0
}
