//go:build cgo && linux

package nvml

import (
	"context"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// TestPCIeRateFromCounters: the PCIe figures are the byte counters'
// increase over the time between two passes (NVML's timestamps, or the
// backend's clock where NVML gives none): none on a first pass, none on a
// pass whose counters went back (a GPU reset or a driver reload; a narrow
// counter's wrap), which the next pass counts from; and a GPU gone for a
// pass starts over.
func TestPCIeRateFromCounters(t *testing.T) {
	const us = int64(1_000_000)
	counters := &fakePCIe{tx: 1 << 40, rx: 2 << 40, at: 1000 * us}
	gpus := board(1, nvml.DEVICE_MIG_DISABLE)
	withTelemetry(gpus[0], telemetryFake{pcie: counters})
	b := testBackend(t, fakeLib(gpus))
	pass := func() (tx, rx nvdevice.Reading) {
		t.Helper()
		got, err := b.Telemetry(context.Background())
		require.NoError(t, err)
		require.Len(t, got, 1)
		return got[0].PCIeTXBytesPerSecond, got[0].PCIeRXBytesPerSecond
	}
	na := nvdevice.Reading{}

	tx, rx := pass()
	assert.Equal(t, na, tx, "a first pass has nothing to count from")
	assert.Equal(t, na, rx)

	counters.tx += 10e9
	counters.rx += 30e9
	counters.at += 10 * us
	tx, rx = pass()
	assert.Equal(t, nvdevice.Read(1e9), tx, "10 GB over 10 s")
	assert.Equal(t, nvdevice.Read(3e9), rx)

	counters.tx, counters.rx = 5e9, 5e9 // reset
	counters.at += 10 * us
	tx, rx = pass()
	assert.Equal(t, na, tx, "a counter that went back gives no rate, not a huge one")
	assert.Equal(t, na, rx)

	counters.tx += 2e9
	counters.rx += 4e9
	counters.at += 2 * us
	tx, rx = pass()
	assert.Equal(t, nvdevice.Read(1e9), tx, "counted from the reset")
	assert.Equal(t, nvdevice.Read(2e9), rx)

	tx, _ = pass()
	assert.Equal(t, na, tx, "no time between the readings: no rate")
}

func TestPCIeRateOverTheBackendsClockWithoutTimestamps(t *testing.T) {
	counters := &fakePCIe{tx: 100, rx: 100} // at 0: NVML gives no time
	gpus := board(1, nvml.DEVICE_MIG_DISABLE)
	withTelemetry(gpus[0], telemetryFake{pcie: counters})
	b := testBackend(t, fakeLib(gpus))
	now := time.Unix(1000, 0)
	b.now = func() time.Time { return now }
	_, err := b.Telemetry(context.Background())
	require.NoError(t, err)
	counters.tx += 4000
	now = now.Add(4 * time.Second)
	got, err := b.Telemetry(context.Background())
	require.NoError(t, err)
	assert.Equal(t, nvdevice.Read(1000), got[0].PCIeTXBytesPerSecond)
	assert.Equal(t, nvdevice.Read(0), got[0].PCIeRXBytesPerSecond, "idle is 0 B/s, not unsupported")
}

func TestPCIeRatesOfAGPUThatWentAway(t *testing.T) {
	const us = int64(1_000_000)
	counters := &fakePCIe{tx: 1000, rx: 1000, at: 10 * us}
	gpus := board(1, nvml.DEVICE_MIG_DISABLE)
	withTelemetry(gpus[0], telemetryFake{pcie: counters})
	b := testBackend(t, fakeLib(gpus))
	_, err := b.Telemetry(context.Background())
	require.NoError(t, err)
	util := gpus[0].GetUtilizationRatesFunc
	gpus[0].GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) { return nvml.Utilization{}, nvml.ERROR_GPU_IS_LOST }
	_, err = b.Telemetry(context.Background())
	require.NoError(t, err)
	gpus[0].GetUtilizationRatesFunc = util
	counters.tx += 1e6
	counters.at += us
	got, err := b.Telemetry(context.Background())
	require.NoError(t, err)
	require.Len(t, got, 1)
	assert.False(t, got[0].PCIeTXBytesPerSecond.Supported, "back after a pass away: counts from now, not over the time it was away")
}
