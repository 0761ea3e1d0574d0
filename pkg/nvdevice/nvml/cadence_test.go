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
// values, 86 and 14; 13 on a fast pass that reads no MPS list. A full
// pass whose entry is checked rather than read (sameEntry: the handle,
// the UUID, the MIG mode) makes 69 calls fewer. No pass but a full one
// reads an inventory entry or a slow reading.
func TestTelemetryCallsPerPass(t *testing.T) {
	for _, tc := range []struct {
		name                            string
		missing                         []string
		mpsDevices                      map[string]bool
		wantFull, wantChecked, wantFast int
	}{
		{name: "field values", wantFull: 86, wantChecked: 17, wantFast: 14},
		{name: "field values, no device shared with MPS", mpsDevices: map[string]bool{}, wantFull: 85, wantChecked: 16, wantFast: 13},
		{name: "a driver without field values", missing: []string{symFieldValues}, wantFull: 94, wantChecked: 25, wantFast: 16},
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

			b.pass.entries = nil // as after a change: the entry read in full
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

			checkedSamples, calls, total := callsOf(t, b, full, lib, gpus[0].Device)
			assert.Equal(t, tc.wantChecked, total, "a full pass, the entry checked: %v", calls)
			for _, fn := range []string{"GetPciInfo", "GetNvLinkState", "GetGpuInstanceProfileInfo", "GetName"} {
				assert.Zero(t, calls[fn], "an entry checked calls no %s", fn)
			}
			assert.Equal(t, fullSamples[0].ProductName, checkedSamples[0].ProductName, "the entry kept")
			assert.Equal(t, fullSamples[0].ECCVolatileCorrected, checkedSamples[0].ECCVolatileCorrected)

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

// TestDeviceReadChecksTheEntries: reading the devices again (a full pass
// without KeepDevices, every ten minutes in the collector) checks each
// kept entry with a few calls, asks the link states only until one is up,
// and reads in full a GPU whose MIG devices changed behind the backend's
// back (nvidia-smi), so that the new MIG device is sampled with its
// profile and placement.
func TestDeviceReadChecksTheEntries(t *testing.T) {
	gpus := board(2, nvml.DEVICE_MIG_ENABLE, "sw0")
	for _, g := range gpus {
		withTelemetry(g, telemetryFake{})
	}
	gpus[0].addGI(nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4, nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE) // MIG-1
	lib := fakeLib(gpus)
	b := testBackend(t, lib)
	mocks := []any{lib, gpus[0].Device, gpus[1].Device}
	first, calls, _ := callsOf(t, b, fullPass, mocks...)
	require.Len(t, first, 3)
	assert.Equal(t, 2*nvml.NVLINK_MAX_LINKS, calls["GetNvLinkState"], "a full read asks every link of both GPUs")

	again, calls, _ := callsOf(t, b, fullPass, mocks...)
	assert.Equal(t, identities(first), identities(again), "the same devices, as the full read found them")
	assert.Zero(t, calls["GetGpuInstanceProfileInfo"], "no MIG profile read again")
	assert.Zero(t, calls["GetPciInfo"], "no PCI info read again")
	assert.Equal(t, 2, calls["GetNvLinkState"], "one link state a GPU: the first is up")
	assert.Zero(t, calls["GetNvLinkRemotePciInfo"], "no remote end asked")
	assert.Equal(t, 2, calls["GetMigMode"])

	gpus[1].addGI(nvml.GPU_INSTANCE_PROFILE_1_SLICE, 0, nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE) // made by another tool
	got, calls, _ := callsOf(t, b, fullPass, mocks...)
	require.Len(t, got, 4, "the GPUs, MIG-1 and the new MIG device")
	assert.Equal(t, "GPU-1", got[3].ParentUUID)
	assert.Equal(t, "1g.10gb", got[3].MigProfile, "its entry read in full")
	assert.Equal(t, 1, calls["GetPciInfo"], "of the changed GPU only")
}

// identities are the samples' devices: who they are, not their readings.
func identities(samples []nvdevice.TelemetrySample) []nvdevice.TelemetrySample {
	var out []nvdevice.TelemetrySample
	for _, s := range samples {
		out = append(out, nvdevice.TelemetrySample{
			UUID: s.UUID, ParentUUID: s.ParentUUID, Minor: s.Minor, ProductName: s.ProductName,
			MigProfile: s.MigProfile, MigStart: s.MigStart,
		})
	}
	return out
}

// TestRefusedReadingsAreNotAskedAgain: a reading NVML refuses as not
// supported (a MIG-mode GPU's utilization and its own GPM sample) is not
// asked again until the devices are read again; one refused for another
// reason is asked every pass; a GPU lost is still left out.
func TestRefusedReadingsAreNotAskedAgain(t *testing.T) {
	gpus := board(1, nvml.DEVICE_MIG_ENABLE)
	gpu := withTelemetry(gpus[0], telemetryFake{utilRet: nvml.ERROR_NOT_SUPPORTED})
	gpu.addGI(nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4, nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE)
	lib := fakeLib(gpus)
	withGPM(t, lib, gpus, &fakeGPM{supported: true})
	gpu.GpmSampleGetFunc = func(nvml.GpmSample) nvml.Return { return nvml.ERROR_NOT_SUPPORTED }
	tempRet := nvml.ERROR_UNKNOWN
	gpu.GetTemperatureFunc = func(nvml.TemperatureSensors) (uint32, nvml.Return) { return 0, tempRet }
	b := testBackend(t, lib)

	_, calls, _ := callsOf(t, b, fullPass, lib, gpu.Device)
	assert.Equal(t, 1, calls["GetUtilizationRates"])
	assert.Equal(t, 1, calls["GpmSampleGet"])
	assert.Equal(t, 1, calls["GpmMigSampleGet"])
	for range 2 {
		got, calls, _ := callsOf(t, b, fastPass, lib, gpu.Device)
		assert.Zero(t, calls["GetUtilizationRates"], "refused as not supported: not asked again")
		assert.Zero(t, calls["GpmSampleGet"], "nor the GPU's GPM sample")
		assert.Zero(t, calls["GpmSampleAlloc"]-calls["GpmMigSampleGet"], "no buffer for it")
		assert.Equal(t, 1, calls["GpmMigSampleGet"], "the MIG device's is asked")
		assert.Equal(t, 1, calls["GetTemperature"], "refused for another reason: asked every pass")
		require.Len(t, got, 2)
		assert.False(t, got[0].GPUUtilization.Supported)
	}
	_, calls, _ = callsOf(t, b, fullPass, lib, gpu.Device)
	assert.Equal(t, 1, calls["GetUtilizationRates"], "asked again once the devices are read again")

	gpu.GetMemoryInfoFunc = func() (nvml.Memory, nvml.Return) { return nvml.Memory{}, nvml.ERROR_GPU_IS_LOST }
	got, _, _ := callsOf(t, b, fastPass, lib, gpu.Device)
	assert.Empty(t, got, "a GPU lost is left out, its utilization not asked")
}
