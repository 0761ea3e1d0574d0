package sim

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

func TestTelemetryFollowsTheModelAndTheLoad(t *testing.T) {
	const gib = 1 << 30
	for _, tc := range []struct {
		name         string
		model        string
		load         float64
		limitW       float64
		totalMiB     float64
		util         float64
		minW, maxW   float64
		smHz         float64
		reasons      float64
		usedAtLeastB float64
	}{
		{name: "idle H100 SXM5", model: ModelH100SXM5, limitW: 700, totalMiB: 81559, minW: 50, maxW: 100, smHz: 345e6, reasons: reasonGPUIdle},
		{name: "busy H100 SXM5", model: ModelH100SXM5, load: 1, limitW: 700, totalMiB: 81559, util: 1, minW: 600, maxW: 700, smHz: 1980e6, reasons: reasonSwPowerCap, usedAtLeastB: 70 * gib},
		{name: "half-busy H100 PCIe", model: ModelH100PCIe, load: 0.5, limitW: 350, totalMiB: 81559, util: 0.5, minW: 150, maxW: 250, smHz: 1755e6, usedAtLeastB: 30 * gib},
		{name: "idle H200", model: ModelH200SXM, limitW: 700, totalMiB: 143771, minW: 50, maxW: 100, smHz: 345e6, reasons: reasonGPUIdle},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := New(MachineSpec{Name: "t", GPUModel: tc.model, GPUCount: 2, NVLink: NVLinkNone}, "n")
			require.NoError(t, err)
			gpu := inventory(t, m).GPUs[0].UUID
			require.NoError(t, m.SetLoad(gpu, tc.load))
			got, err := m.Telemetry(context.Background())
			require.NoError(t, err)
			require.Len(t, got, 2)
			s := got[0]
			assert.Equal(t, gpu, s.UUID)
			assert.Equal(t, nvdevice.Read(tc.limitW), s.PowerLimitWatts)
			assert.Equal(t, nvdevice.Read(tc.totalMiB*(1<<20)), s.FramebufferTotalBytes)
			assert.Equal(t, s.FramebufferTotalBytes.Value, s.FramebufferUsedBytes.Value+s.FramebufferFreeBytes.Value)
			assert.GreaterOrEqual(t, s.FramebufferUsedBytes.Value, tc.usedAtLeastB)
			assert.Equal(t, nvdevice.Read(tc.util), s.GPUUtilization)
			assert.True(t, s.PowerWatts.Supported)
			assert.GreaterOrEqual(t, s.PowerWatts.Value, tc.minW)
			assert.LessOrEqual(t, s.PowerWatts.Value, tc.maxW)
			assert.Equal(t, nvdevice.Read(tc.smHz), s.SMClockHertz)
			assert.Equal(t, nvdevice.Read(tc.reasons), s.ClockEventReasons)
			assert.Equal(t, nvdevice.Read(0), s.ECCAggregateUncorrected)
			assert.Equal(t, nvdevice.Read(0), got[1].GPUUtilization, "the other GPU stays idle")
		})
	}
}

func TestTelemetryOfMigDevicesInTheSimulator(t *testing.T) {
	ctx := context.Background()
	m, gpu := oneGPU(t, true)
	d, err := m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: "3g.40gb", Start: 4})
	require.NoError(t, err)
	idle, err := m.Telemetry(ctx)
	require.NoError(t, err)
	require.NoError(t, m.SetLoad(d.UUID, 1))
	got, err := m.Telemetry(ctx)
	require.NoError(t, err)
	require.Len(t, got, 2)
	mig := got[1]
	assert.Equal(t, d.UUID, mig.UUID)
	assert.Equal(t, gpu, mig.ParentUUID)
	assert.Equal(t, "3g.40gb", mig.MigProfile)
	assert.Equal(t, 4, mig.MigStart)
	assert.Equal(t, nvdevice.Read(40448*(1<<20)), mig.FramebufferTotalBytes)
	assert.Greater(t, mig.FramebufferUsedBytes.Value, float64(30<<30))
	assert.False(t, mig.GPUUtilization.Supported, "no utilization per MIG device through plain NVML")
	assert.Greater(t, got[0].FramebufferUsedBytes.Value, idle[0].FramebufferUsedBytes.Value+30<<30,
		"the MIG device's memory counts in its GPU's")

	require.ErrorIs(t, m.SetLoad("GPU-nope", 0.5), nvdevice.ErrNotFound)
	require.Error(t, m.SetLoad(gpu, 1.5))
}

func TestLostGPUHasNoTelemetry(t *testing.T) {
	m, err := New(MachineSpec{Name: "t", GPUCount: 2, NVLink: NVLinkNone}, "n")
	require.NoError(t, err)
	gpus := inventory(t, m).GPUs
	require.NoError(t, m.LoseGPU(gpus[0].UUID))
	got, err := m.Telemetry(context.Background())
	require.NoError(t, err)
	require.Len(t, got, 1)
	assert.Equal(t, gpus[1].UUID, got[0].UUID)
}

// A reading that hangs in the driver holds up neither a MIG change nor an
// inventory read: the machine's lock is taken one GPU at a time and never
// across the readings, as the NVML backend takes its own.
func TestHungTelemetryReadingHoldsUpNoPrepare(t *testing.T) {
	m, err := NewBuiltin("dgx-h100", "n")
	require.NoError(t, err)
	gpus := inventory(t, m).GPUs
	hung := gpus[3].UUID
	entered, release := make(chan struct{}), make(chan struct{})
	m.SetTelemetryHook(func(gpu string) {
		if gpu == hung {
			close(entered)
			<-release
		}
	})
	ctx := context.Background()
	passDone := make(chan []nvdevice.TelemetrySample)
	go func() {
		s, err := m.Telemetry(ctx)
		assert.NoError(t, err)
		passDone <- s
	}()
	<-entered
	prepared := make(chan error)
	go func() {
		if _, err := m.Inventory(ctx); err != nil {
			prepared <- err
			return
		}
		_, err := m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpus[5].UUID, Profile: "1g.10gb", Start: 0})
		prepared <- err
	}()
	select {
	case err := <-prepared:
		require.NoError(t, err)
	case <-time.After(5 * time.Second):
		t.Fatal("the inventory read and the MIG device's creation waited for the telemetry pass")
	}
	select {
	case <-passDone:
		t.Fatal("the pass ended while a reading hung")
	default:
	}
	close(release)
	s := <-passDone
	var migs int
	for _, d := range s {
		if d.IsMIG() {
			migs++
			assert.Equal(t, gpus[5].UUID, d.ParentUUID)
		}
	}
	assert.Equal(t, 1, migs, "the pass samples the MIG device made on a GPU it had not sampled yet")
}
