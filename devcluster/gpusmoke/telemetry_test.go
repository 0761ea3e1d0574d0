package gpusmoke

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

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
	assert.Contains(t, string(b), `gpudra_gpu_power_limit_watts{device="gpu-0"`)
	assert.Contains(t, string(b), "gpudra_gpu_framebuffer_total_bytes")
	assert.Contains(t, string(b), `gpudra_telemetry_up{node="`+GPUNode+`"} 1`)
}
