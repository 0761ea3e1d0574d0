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
