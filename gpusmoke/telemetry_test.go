package gpusmoke

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

// gpu-smoke keeps one scrape of the plugin's telemetry collector over the
// GPU's backend: on a simulated H200, its power limit and framebuffer.
func TestScrapeTelemetryKeepsOneScrape(t *testing.T) {
	m, err := sim.NewBuiltin("hgx-h200-nomig", "n")
	require.NoError(t, err)
	dir := t.TempDir()
	res, err := newResults(dir)
	require.NoError(t, err)
	var out bytes.Buffer
	require.NoError(t, scrapeTelemetry(context.Background(), &out, res, m))
	assert.Contains(t, out.String(), "== telemetry:")
	b, err := os.ReadFile(filepath.Join(dir, "telemetry.prom"))
	require.NoError(t, err)
	assert.Contains(t, string(b), `gpudra_gpu_power_limit_watts{dra_device_name="gpu-0"`)
	assert.Contains(t, string(b), "gpudra_gpu_framebuffer_total_bytes")
	assert.Contains(t, string(b), `gpudra_telemetry_up{node="`+GPUNode+`"} 1`)
}

// twoPassReader gives GPM figures from its second read on, as NVML does.
type twoPassReader struct{ reads int }

func (r *twoPassReader) Telemetry(context.Context) ([]nvdevice.TelemetrySample, error) {
	r.reads++
	s := nvdevice.TelemetrySample{UUID: "GPU-a", ProductName: "NVIDIA H200", PowerLimitWatts: nvdevice.Read(700)}
	if r.reads > 1 {
		s.SMActive = nvdevice.Read(0.5)
	}
	return []nvdevice.TelemetrySample{s}, nil
}

// The scrape kept is taken after a second pass, so that it has the GPM
// series a real Hopper GPU gives only from its second sample.
func TestScrapeTelemetryHasTheSecondPass(t *testing.T) {
	defer func(d time.Duration) { telemetryPassGap = d }(telemetryPassGap)
	telemetryPassGap = 10 * time.Millisecond
	dir := t.TempDir()
	res, err := newResults(dir)
	require.NoError(t, err)
	r := &twoPassReader{}
	require.NoError(t, scrapeTelemetry(context.Background(), io.Discard, res, r))
	assert.Equal(t, 2, r.reads)
	b, err := os.ReadFile(filepath.Join(dir, "telemetry.prom"))
	require.NoError(t, err)
	assert.Contains(t, string(b), `gpudra_gpu_sm_active_ratio{dra_device_name="gpu-0",dra_driver_name="gpu.gpudra.dev",dra_pool_name="nvml-gpu",gpu="GPU-a"`)
}
