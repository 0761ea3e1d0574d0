//go:build cgo && linux

package nvml

import (
	"context"
	"reflect"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// countCalls adds the calls go-nvml's mock v recorded, by method.
func countCalls(into map[string]int, mocks ...any) {
	for _, v := range mocks {
		rv := reflect.ValueOf(v)
		rt := rv.Type()
		for i := range rt.NumMethod() {
			m := rt.Method(i)
			if !strings.HasSuffix(m.Name, "Calls") || m.Type.NumIn() != 1 {
				continue
			}
			if out := rv.Method(i).Call(nil); len(out) == 1 && out[0].Kind() == reflect.Slice {
				into[strings.TrimSuffix(m.Name, "Calls")] += out[0].Len()
			}
		}
	}
}

// callsOf is the NVML calls one pass with opts made, by method, and their
// total.
func callsOf(t *testing.T, b *Backend, opts nvdevice.TelemetryOptions, mocks ...any) ([]nvdevice.TelemetrySample, map[string]int, int) {
	t.Helper()
	before := map[string]int{}
	countCalls(before, mocks...)
	got, err := b.TelemetryWith(context.Background(), opts)
	require.NoError(t, err)
	after := map[string]int{}
	countCalls(after, mocks...)
	calls, total := map[string]int{}, 0
	for k, n := range after {
		if n -= before[k]; n > 0 {
			calls[k] = n
			total += n
		}
	}
	return got, calls, total
}

var (
	fullPass = nvdevice.TelemetryOptions{}
	fastPass = nvdevice.TelemetryOptions{SkipSlow: true, KeepDevices: true}
)

// TestTelemetryCallsPerPass pins what a pass asks of NVML on the GPU the
// simulator's timing model is calibrated on (one H200: MIG capable and
// off, no NVLink, GPM, a process), as sim's TestNVMLTimingCallsPerPass
// charges them: with a driver without field values (one call per reading,
// the two PCIe throughput windows), the 94 calls of a full pass that the
// model divides the H200's pass among (sim.H200NVMLTiming), 16 for a fast
// one: what the backend asked of every driver before issue 50. With field
// values, 86 and 14; 13 on a fast pass that reads no MPS list. No pass
// but a full one reads an inventory entry or a slow reading.
func TestTelemetryCallsPerPass(t *testing.T) {
	for _, tc := range []struct {
		name               string
		missing            []string
		mpsDevices         map[string]bool
		wantFull, wantFast int
	}{
		{name: "field values", wantFull: 86, wantFast: 14},
		{name: "field values, no device shared with MPS", mpsDevices: map[string]bool{}, wantFull: 85, wantFast: 13},
		{name: "a driver without field values", missing: []string{symFieldValues}, wantFull: 94, wantFast: 16},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gpus := board(1, nvml.DEVICE_MIG_DISABLE)
			withTelemetry(gpus[0], telemetryFake{})
			gpus[0].GetComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) {
				return []nvml.ProcessInfo{{Pid: 489, UsedGpuMemory: 2 << 30}}, nvml.SUCCESS
			}
			lib := fakeLib(gpus, tc.missing...)
			withGPM(t, lib, gpus, &fakeGPM{supported: true})
			b := testBackend(t, lib)
			full, fast := fullPass, fastPass
			full.MPSDevices, fast.MPSDevices = tc.mpsDevices, tc.mpsDevices
			callsOf(t, b, full, lib, gpus[0].Device) // GPM's first sample

			fullSamples, calls, total := callsOf(t, b, full, lib, gpus[0].Device)
			assert.Equal(t, tc.wantFull, total, "a full pass: %v", calls)
			assert.True(t, fullSamples[0].ECCVolatileCorrected.Supported)
			if tc.missing == nil {
				assert.Equal(t, 1, calls["GetFieldValues"], "the power, PCIe and slow readings in one call")
				assert.Zero(t, calls["GetPcieThroughput"], "no 20 ms PCIe window")
			}
			if tc.mpsDevices != nil {
				assert.Zero(t, calls["GetMPSComputeRunningProcesses"], "no MPS list on a device not shared with MPS")
			}

			fastSamples, calls, total := callsOf(t, b, fast, lib, gpus[0].Device)
			assert.Equal(t, tc.wantFast, total, "a fast pass: %v", calls)
			for _, fn := range []string{"GetPciInfo", "GetNvLinkState", "GetGpuInstanceProfileInfo", "GetEnforcedPowerLimit", "GetTotalEccErrors", "GetRemappedRows"} {
				assert.Zero(t, calls[fn], "a fast pass calls no %s", fn)
			}
			require.Len(t, fastSamples, 1)
			assert.False(t, fastSamples[0].ECCVolatileCorrected.Supported, "no slow reading on a fast pass")
			assert.False(t, fastSamples[0].PowerLimitWatts.Supported)
			nvdevice.CopySlowReadings(&fastSamples[0], &fullSamples[0])
			assert.Equal(t, fullSamples[0].ECCVolatileCorrected, fastSamples[0].ECCVolatileCorrected)
			assert.Equal(t, fullSamples[0].PowerWatts, fastSamples[0].PowerWatts, "the fast readings are all there")
			assert.True(t, fastSamples[0].SMActive.Supported, "GPM over the time since the previous pass")
			assert.True(t, fastSamples[0].ProcessesRead)
		})
	}
}

// TestFastPassSeesTheBackendsMIGChanges: a fast pass reads the entries
// again after a MIG device was made or destroyed through the backend, so
// that a new MIG device is sampled at once and a destroyed one is gone.
func TestFastPassSeesTheBackendsMIGChanges(t *testing.T) {
	gpus := board(1, nvml.DEVICE_MIG_ENABLE, "sw0")
	gpu := withTelemetry(gpus[0], telemetryFake{})
	gpu.addGI(nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4, nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE)
	lib := fakeLib(gpus)
	b := testBackend(t, lib)
	uuids := func(s []nvdevice.TelemetrySample) []string {
		var out []string
		for _, d := range s {
			out = append(out, d.UUID)
		}
		return out
	}
	got, _, _ := callsOf(t, b, fullPass, lib, gpu.Device)
	assert.Equal(t, []string{"GPU-0", "MIG-1"}, uuids(got))
	got, calls, _ := callsOf(t, b, fastPass, lib, gpu.Device)
	assert.Equal(t, []string{"GPU-0", "MIG-1"}, uuids(got))
	assert.Zero(t, calls["GetGpuInstanceProfileInfo"], "no change: the kept entry")
	assert.Zero(t, calls["GetMigDeviceHandleByIndex"], "and the kept MIG device handles")
	assert.True(t, got[1].FramebufferUsedBytes.Supported, "read through the kept handle")

	made, err := b.CreateMigDevice(context.Background(), nvdevice.MigCreateRequest{ParentUUID: "GPU-0", Profile: "1g.10gb", Start: 0})
	require.NoError(t, err)
	got, calls, _ = callsOf(t, b, fastPass, lib, gpu.Device)
	assert.Equal(t, []string{"GPU-0", made.UUID, "MIG-1"}, uuids(got), "the new MIG device, at once")
	assert.NotZero(t, calls["GetGpuInstanceProfileInfo"], "the entry read again")

	require.NoError(t, b.DeleteMigDevice(context.Background(), nvdevice.MigDeviceRef{ParentUUID: "GPU-0", GPUInstanceID: made.GPUInstanceID, ComputeInstanceID: made.ComputeInstanceID, UUID: made.UUID}))
	got, _, _ = callsOf(t, b, fastPass, lib, gpu.Device)
	assert.Equal(t, []string{"GPU-0", "MIG-1"}, uuids(got), "the destroyed one is gone")
}

// TestFastPassLeavesALostGPUOut: a GPU lost since its entry was read is
// left out of the fast pass, as the full pass leaves it out, and the next
// pass reads the entries again.
func TestFastPassLeavesALostGPUOut(t *testing.T) {
	gpus := board(2, nvml.DEVICE_MIG_DISABLE)
	for _, g := range gpus {
		withTelemetry(g, telemetryFake{})
	}
	lib := fakeLib(gpus)
	b := testBackend(t, lib)
	got, _, _ := callsOf(t, b, fullPass, lib, gpus[0].Device, gpus[1].Device)
	require.Len(t, got, 2)
	gpus[1].GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) { return nvml.Utilization{}, nvml.ERROR_GPU_IS_LOST }
	gpus[1].GetUUIDFunc = func() (string, nvml.Return) { return "", nvml.ERROR_GPU_IS_LOST }
	got, _, _ = callsOf(t, b, fastPass, lib, gpus[0].Device, gpus[1].Device)
	require.Len(t, got, 1)
	assert.Equal(t, "GPU-0", got[0].UUID)
	got, calls, _ := callsOf(t, b, fastPass, lib, gpus[0].Device, gpus[1].Device)
	assert.Len(t, got, 1)
	assert.NotZero(t, calls["GetPciInfo"], "after a lost GPU the entries are read again")
}
