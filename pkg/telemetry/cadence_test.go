package telemetry

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clocktesting "k8s.io/utils/clock/testing"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/prepared"
)

// optsReader records the options of each pass it is asked for.
type optsReader struct {
	nvdevice.CadencedTelemetryReader
	mu   sync.Mutex
	opts []nvdevice.TelemetryOptions
	err  error // the next pass fails with it, once
}

func (r *optsReader) TelemetryWith(ctx context.Context, opts nvdevice.TelemetryOptions) ([]nvdevice.TelemetrySample, error) {
	r.mu.Lock()
	r.opts = append(r.opts, opts)
	err := r.err
	r.err = nil
	r.mu.Unlock()
	if err != nil {
		return nil, err
	}
	return r.CadencedTelemetryReader.TelemetryWith(ctx, opts)
}

// keptDevices is which of the passes so far kept the devices.
func (r *optsReader) keptDevices() []bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []bool
	for _, o := range r.opts {
		out = append(out, o.KeepDevices)
	}
	return out
}

// fullPasses is which of the passes so far were full.
func (r *optsReader) fullPasses() []bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []bool
	for _, o := range r.opts {
		out = append(out, !o.SkipSlow)
	}
	return out
}

// uncorrectedVolatile is GPU 0's volatile uncorrected ECC count as the
// collector exports it, "missing" without the series.
func uncorrectedVolatile(t *testing.T, c *Collector) string {
	t.Helper()
	for _, l := range strings.Split(series(t, c, "gpudra_gpu_ecc_errors_total"), "\n") {
		if strings.Contains(l, `counter="volatile"`) && strings.Contains(l, `type="uncorrected"`) && strings.Contains(l, `dra_device_name="gpu-0"`) {
			return l[strings.LastIndex(l, " ")+1:]
		}
	}
	return "missing"
}

func countSeries(c *Collector, metric string) int { return testutil.CollectAndCount(c, metric) }

// TestSlowReadingsOnTheirCadence: the ECC counts (a slow reading) are read
// on the full passes only, every DefaultSlowInterval; the fast passes
// between still export the last full pass's figures, and an error counted
// after a full pass is exported by the next full one, within the slow
// interval.
func TestSlowReadingsOnTheirCadence(t *testing.T) {
	m, err := sim.New(sim.MachineSpec{Name: "vm-h200", GPUModel: sim.ModelH200SXM, GPUCount: 1, NVLink: sim.NVLinkNone}, "n1")
	require.NoError(t, err)
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	g := inv.GPUs[0]
	r := &optsReader{CadencedTelemetryReader: m}
	clk := clocktesting.NewFakeClock(time.Unix(1e9, 0))
	c := NewCollector(r, "n1", 10*time.Second)
	c.SetClock(clk)

	c.Sample(context.Background()) // t=0: the first pass is full
	require.Equal(t, "0", uncorrectedVolatile(t, c))
	require.NoError(t, m.InjectECC(g.UUID, 0, 2))
	for at := 10; at < 60; at += 10 {
		clk.Step(10 * time.Second)
		c.Sample(context.Background())
		assert.Equal(t, "0", uncorrectedVolatile(t, c), "t=%ds: a fast pass sends the last full pass's count", at)
		assert.Equal(t, 1, countSeries(c, "gpudra_gpu_power_limit_watts"), "t=%ds: the power limit too", at)
	}
	clk.Step(10 * time.Second)
	c.Sample(context.Background()) // t=60s: full
	assert.Equal(t, "2", uncorrectedVolatile(t, c), "the count is read again a slow interval after the last full pass")
	assert.Equal(t, []bool{true, false, false, false, false, false, true}, r.fullPasses())
	assert.Equal(t, []bool{false, true, true, true, true, true, true}, r.keptDevices(), "the devices are read at the first pass only")

	// The devices are read again every DeviceInterval.
	for clk.Since(time.Unix(1e9, 0)) < DeviceInterval {
		clk.Step(10 * time.Second)
		c.Sample(context.Background())
	}
	kept := r.keptDevices()
	assert.False(t, kept[len(kept)-1], "a pass a device interval after the first reads the devices")
	assert.Equal(t, 1+int(DeviceInterval/(10*time.Second)), len(kept))
	for i, k := range kept[1 : len(kept)-1] {
		assert.True(t, k, "pass %d keeps them", i+1)
	}
}

// TestEveryPassFullWithoutSlowInterval: SetSlowInterval(0) reads
// everything every pass, as before the slow cadence: an ECC count is
// exported by the next pass.
func TestEveryPassFullWithoutSlowInterval(t *testing.T) {
	m, err := sim.New(sim.MachineSpec{Name: "vm-h200", GPUModel: sim.ModelH200SXM, GPUCount: 1, NVLink: sim.NVLinkNone}, "n1")
	require.NoError(t, err)
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	g := inv.GPUs[0]
	r := &optsReader{CadencedTelemetryReader: m}
	c := NewCollector(r, "n1", 10*time.Second)
	c.SetSlowInterval(0)
	c.Sample(context.Background())
	require.NoError(t, m.InjectECC(g.UUID, 0, 3))
	c.Sample(context.Background())
	assert.Equal(t, "3", uncorrectedVolatile(t, c))
	assert.Equal(t, []bool{true, true}, r.fullPasses())
	assert.Equal(t, []bool{false, false}, r.keptDevices(), "nor keeps the devices")
}

// TestFullPassAgainAfterAFailureOrANewGPU: a full pass that fails is taken
// again at the next pass; a GPU that a fast pass meets without slow
// readings (new since the last full pass) has them read by the next pass.
func TestFullPassAgainAfterAFailureOrANewGPU(t *testing.T) {
	m, err := sim.New(sim.MachineSpec{Name: "vm-h200", GPUModel: sim.ModelH200SXM, GPUCount: 2, NVLink: sim.NVLinkNone}, "n1")
	require.NoError(t, err)
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	r := &optsReader{CadencedTelemetryReader: m, err: errors.New("NVML went away")}
	clk := clocktesting.NewFakeClock(time.Unix(1e9, 0))
	c := NewCollector(r, "n1", 10*time.Second)
	c.SetClock(clk)
	pass := func() {
		clk.Step(10 * time.Second)
		c.Sample(context.Background())
	}
	pass() // full, fails
	pass() // full again
	pass() // fast
	assert.Equal(t, []bool{true, true, false}, r.fullPasses())
	assert.Equal(t, 2, countSeries(c, "gpudra_gpu_power_limit_watts"))

	// GPU 1 falls off the bus and comes back between two full passes:
	// the full pass without it forgets its slow readings.
	require.NoError(t, m.LoseGPU(inv.GPUs[1].UUID))
	c.SetSlowInterval(0)
	pass() // full, without GPU 1
	c.SetSlowInterval(DefaultSlowInterval)
	require.NoError(t, m.RecoverGPU(inv.GPUs[1].UUID))
	pass() // fast: GPU 1 has no slow readings
	assert.Equal(t, 1, countSeries(c, "gpudra_gpu_power_limit_watts"), "GPU 1's slow series are missing, never made up")
	assert.Equal(t, 2, countSeries(c, "gpudra_gpu_power_watts"), "its fast ones are there")
	pass() // full: GPU 1 met without slow readings
	assert.Equal(t, []bool{true, true, false, true, false, true}, r.fullPasses())
	assert.Equal(t, 2, countSeries(c, "gpudra_gpu_power_limit_watts"))
}

// TestCollectorPassesTheMPSDevices: each pass is told the devices its
// claims share with MPS, as they are at that pass; without SetClaims,
// nil (every device's MPS list).
func TestCollectorPassesTheMPSDevices(t *testing.T) {
	m, err := sim.New(sim.MachineSpec{Name: "vm-h200", GPUModel: sim.ModelH200SXM, GPUCount: 1, NVLink: sim.NVLinkNone}, "n1")
	require.NoError(t, err)
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	r := &optsReader{CadencedTelemetryReader: m}
	c := NewCollector(r, "n1", 10*time.Second)
	c.Sample(context.Background())

	var claims []prepared.Claim
	c.SetClaims(func() []prepared.Claim { return claims })
	c.Sample(context.Background())
	claims = []prepared.Claim{{UID: "u", Namespace: "ns", Name: "c", State: prepared.PrepareCompleted,
		Sharing: &gpuapi.Sharing{Strategy: gpuapi.MPS},
		Devices: []prepared.Device{{Pool: "n1", Device: "gpu-0", UUID: inv.GPUs[0].UUID, GPUUUID: inv.GPUs[0].UUID}}}}
	c.Sample(context.Background())

	r.mu.Lock()
	defer r.mu.Unlock()
	require.Len(t, r.opts, 3)
	assert.Nil(t, r.opts[0].MPSDevices, "no claims func: every device's")
	assert.Equal(t, map[string]bool{}, r.opts[1].MPSDevices, "no claim shared with MPS: none")
	assert.Equal(t, map[string]bool{inv.GPUs[0].UUID: true}, r.opts[2].MPSDevices)
}
