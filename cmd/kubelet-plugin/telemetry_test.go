package main

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/deviceplugin"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/plugin"
)

// noTelemetry is a backend that reads no telemetry.
type noTelemetry struct{ nvdevice.Interface }

func TestTelemetryOnBothModesRegistries(t *testing.T) {
	m, err := sim.NewBuiltin("dgx-h100", "node-a")
	require.NoError(t, err)
	defer m.Close()
	for _, tc := range []struct {
		name    string
		reg     *prometheus.Registry
		backend nvdevice.Interface
		want    int // power limit series
	}{
		{"DRA mode", plugin.NewMetrics().Registry, m, 8},
		{"device plugin mode", deviceplugin.NewMetrics().Registry, m, 8},
		{"a backend without telemetry", plugin.NewMetrics().Registry, noTelemetry{m}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want > 0, registerTelemetry(context.Background(), tc.reg, tc.backend, "node-a"))
			n, err := testutil.GatherAndCount(tc.reg, "gpudra_gpu_power_limit_watts")
			require.NoError(t, err, "no collision with the registry's other metrics")
			assert.Equal(t, tc.want, n)
		})
	}
}
