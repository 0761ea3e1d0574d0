//go:build cgo && linux

package nvml

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// TestRealGPUTelemetry reads a real GPU's telemetry twice, a second apart,
// while a process of the caller's holds it (GPUDRA_REAL_GPU_PID, e.g.
// gpudra-cuda-check --alloc 2Gi --hold 30s), and writes both passes to
// GPUDRA_REAL_GPU_OUT as JSON. It runs only where GPUDRA_REAL_GPU=1 (the
// device checks, docs/gpu-smoke.md); its results are kept in
// testdata/real-gpus. It asserts what real NVML must give on Hopper: the GPM
// figures from the second pass on, and the held process with its memory.
func TestRealGPUTelemetry(t *testing.T) {
	if os.Getenv("GPUDRA_REAL_GPU") != "1" {
		t.Skip("GPUDRA_REAL_GPU=1 runs this on a real GPU")
	}
	ctx := context.Background()
	backend, err := New(ctx, Options{DriverRoot: os.Getenv("GPUDRA_DRIVER_ROOT")})
	require.NoError(t, err)
	if c, ok := backend.(interface{ Close() error }); ok {
		defer c.Close()
	}
	r, ok := backend.(nvdevice.TelemetryReader)
	require.True(t, ok, "the NVML backend reads telemetry")
	var passes [][]nvdevice.TelemetrySample
	for i := range 3 {
		if i > 0 {
			time.Sleep(time.Second)
		}
		start := time.Now()
		s, err := r.Telemetry(ctx)
		require.NoError(t, err)
		t.Logf("pass %d took %v", i, time.Since(start))
		passes = append(passes, s)
	}
	if out := os.Getenv("GPUDRA_REAL_GPU_OUT"); out != "" {
		b, err := json.MarshalIndent(passes, "", "  ")
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(out, "telemetry-passes.json"), b, 0o644))
	}
	last := passes[len(passes)-1]
	require.NotEmpty(t, last)
	g := last[0]
	assert.True(t, g.SMActive.Supported, "GPM SM activity on a Hopper GPU from the second pass")
	assert.True(t, g.DRAMActive.Supported, "GPM DRAM activity")
	assert.False(t, passes[0][0].SMActive.Supported, "no GPM figure from a first pass: it needs two samples")
	assert.True(t, g.ProcessesRead, "the process list was read")
	if pid, err := strconv.Atoi(os.Getenv("GPUDRA_REAL_GPU_PID")); err == nil {
		var found *nvdevice.ProcessSample
		for i := range g.Processes {
			if g.Processes[i].PID == pid {
				found = &g.Processes[i]
			}
		}
		require.NotNil(t, found, "NVML lists the held process %d: %+v", pid, g.Processes)
		assert.True(t, found.UsedMemoryBytes.Supported)
		assert.GreaterOrEqual(t, found.UsedMemoryBytes.Value, float64(1<<30), "the held process's memory")
		t.Logf("held process: %+v; GPU utilization %+v, SM active %+v, DRAM active %+v", *found, g.GPUUtilization, g.SMActive, g.DRAMActive)
	}
}
