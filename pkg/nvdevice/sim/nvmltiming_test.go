package sim

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// oneH200 is the GPU the timing model is calibrated on: one H200, MIG
// capable and off, no NVLink (a VM), a CUDA process busy on it.
func oneH200(t *testing.T) *Machine {
	t.Helper()
	m, err := New(MachineSpec{Name: "vm-h200", GPUModel: ModelH200SXM, GPUCount: 1, NVLink: NVLinkNone}, "node-a")
	require.NoError(t, err)
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	require.NoError(t, m.StartProcess(inv.GPUs[0].UUID, 489, 0.97, 2<<30))
	return m
}

// passCost is what one pass with opts charged.
func passCost(t *testing.T, m *Machine, opts nvdevice.TelemetryOptions) NVMLLedger {
	t.Helper()
	before := m.NVMLLedger()
	_, err := m.TelemetryWith(context.Background(), opts)
	require.NoError(t, err)
	after := m.NVMLLedger()
	d := NVMLLedger{Calls: after.Calls - before.Calls, CPU: after.CPU - before.CPU, Wait: after.Wait - before.Wait, ByFunction: map[string]int{}}
	for fn, n := range after.ByFunction {
		if n -= before.ByFunction[fn]; n > 0 {
			d.ByFunction[fn] = n
		}
	}
	return d
}

// TestNVMLTimingReproducesTheH200: with the reads the H200's capture
// timed (PerCallReads), a full pass over the GPU the model is calibrated on
// makes the backend's 94 calls (pkg/nvdevice/nvml's
// TestTelemetryCallsPerPass, a driver without field values) and costs
// what the steady pass took there (61.1 ms); a fast one 16 calls.
func TestNVMLTimingReproducesTheH200(t *testing.T) {
	m := oneH200(t)
	timing := H200NVMLTiming()
	timing.PerCallReads = true
	m.SetNVMLTiming(timing)
	full := nvdevice.TelemetryOptions{}
	passCost(t, m, full)
	got := passCost(t, m, full)
	assert.Equal(t, 94, got.Calls, "calls: %v", got.ByFunction)
	assert.Equal(t, 36, got.ByFunction["nvmlDeviceGetNvLinkState"])
	assert.Equal(t, 2, got.ByFunction["nvmlDeviceGetPcieThroughput"])
	assert.Equal(t, 40*time.Millisecond, got.Wait)
	assert.InDelta(t, 61.1, (got.CPU+got.Wait).Seconds()*1000, 0.5, "ms, the H200's third pass")

	fast := passCost(t, m, nvdevice.TelemetryOptions{SkipSlow: true, KeepDevices: true})
	assert.Equal(t, 16, fast.Calls, "calls: %v", fast.ByFunction)
}

// TestNVMLTimingCallsPerPass: the model charges what the backend asks now
// (pkg/nvdevice/nvml's TestTelemetryCallsPerPass counts the same on
// go-nvml's mock): 86 calls a full pass that reads the entry in full (the
// first), 17 one that checks it, 14 a fast one on the H200, 13 without the
// MPS list, and no PCIe window; with FullEntries, 86 every full pass.
func TestNVMLTimingCallsPerPass(t *testing.T) {
	m := oneH200(t)
	m.SetNVMLTiming(H200NVMLTiming())
	full := passCost(t, m, nvdevice.TelemetryOptions{})
	assert.Equal(t, 86, full.Calls, "calls: %v", full.ByFunction)
	assert.Equal(t, 1, full.ByFunction["nvmlDeviceGetFieldValues"])
	assert.Zero(t, full.Wait, "no PCIe window")
	checked := passCost(t, m, nvdevice.TelemetryOptions{})
	assert.Equal(t, 17, checked.Calls, "calls: %v", checked.ByFunction)
	assert.Zero(t, checked.ByFunction["nvmlDeviceGetPciInfo"])
	fastOpts := nvdevice.TelemetryOptions{SkipSlow: true, KeepDevices: true}
	assert.Equal(t, 14, passCost(t, m, fastOpts).Calls)
	fastOpts.MPSDevices = map[string]bool{}
	assert.Equal(t, 13, passCost(t, m, fastOpts).Calls)

	before := H200NVMLTiming()
	before.FullEntries = true
	m.SetNVMLTiming(before)
	passCost(t, m, nvdevice.TelemetryOptions{})
	assert.Equal(t, 86, passCost(t, m, nvdevice.TelemetryOptions{}).Calls, "before: the entry read in full")
}

// TestNVMLTimingCheckedEntriesAndRefusals: on an HGX H200 with every GPU
// cut into seven MIG devices, reading the devices again checks each GPU's
// entry (its UUID, MIG mode, MIG device handles and UUIDs, one link state:
// the first link is up), as the backend's sameEntry does, and a MIG-mode
// GPU's utilization and own GPM sample, which NVML refuses as not
// supported, are charged only on a pass that reads the devices (allocated,
// refused, freed), as the backend asks them; FullEntries charges both
// every pass, as before.
func TestNVMLTimingCheckedEntriesAndRefusals(t *testing.T) {
	spec := MachineSpec{Name: "mig56", GPUModel: ModelH200SXM, GPUCount: 8, NVLink: NVLinkNVSwitch, MigEnabled: MigEnabledSpec{All: true}}
	for g := range 8 {
		for s := range 7 {
			spec.MigDevices = append(spec.MigDevices, MigDeviceSpec{GPU: g, Profile: "1g.18gb", Start: s})
		}
	}
	m, err := New(spec, "node-a")
	require.NoError(t, err)
	m.SetNVMLTiming(H200NVMLTiming())
	fast := nvdevice.TelemetryOptions{SkipSlow: true, KeepDevices: true}
	passCost(t, m, fast)

	checked := passCost(t, m, nvdevice.TelemetryOptions{SkipSlow: true})
	for fn, want := range map[string]int{
		"nvmlDeviceGetHandleByIndex": 8, "nvmlDeviceGetUUID": 8 + 56, "nvmlDeviceGetMigMode": 8,
		"nvmlDeviceGetMigDeviceHandleByIndex": 56, "nvmlDeviceGetNvLinkState": 8,
		"nvmlDeviceGetPciInfo": 0, "nvmlDeviceGetGpuInstanceProfileInfo": 0, "nvmlGpuInstanceGetComputeInstanceProfileInfo": 0,
		"nvmlDeviceGetUtilizationRates": 8, "nvmlDeviceGetNvLinkRemotePciInfo": 0,
	} {
		assert.Equal(t, want, checked.ByFunction[fn], fn)
	}
	steady := passCost(t, m, fast)
	assert.Zero(t, steady.ByFunction["nvmlDeviceGetUtilizationRates"], "refused: not asked between device reads")
	assert.Zero(t, steady.ByFunction["nvmlGpmSampleGet"], "nor the GPU's GPM sample")
	assert.Equal(t, 56, steady.ByFunction["nvmlGpmMigSampleGet"])
	assert.Equal(t, 56, steady.ByFunction["nvmlGpmSampleAlloc"], "a buffer only for the MIG devices' samples")

	before := H200NVMLTiming()
	before.FullEntries = true
	m.SetNVMLTiming(before)
	passCost(t, m, fast)
	steady = passCost(t, m, fast)
	assert.Equal(t, 8, steady.ByFunction["nvmlDeviceGetUtilizationRates"], "before: asked every pass")
	assert.Equal(t, 8, steady.ByFunction["nvmlGpmSampleGet"])
	full := passCost(t, m, nvdevice.TelemetryOptions{SkipSlow: true})
	assert.Equal(t, 8*nvlinkStatesAsked, full.ByFunction["nvmlDeviceGetNvLinkState"], "before: every entry read in full")
}

// TestPCIeRateFromTheSecondPass: a GPU's first pass has no PCIe figure, as
// on the NVML backend (the rate between two passes' byte counters), and
// neither has a GPU's first pass after one that did not see it.
func TestPCIeRateFromTheSecondPass(t *testing.T) {
	m := oneH200(t)
	first, err := m.Telemetry(context.Background())
	require.NoError(t, err)
	assert.False(t, first[0].PCIeTXBytesPerSecond.Supported, "no rate from one pass")
	assert.False(t, first[0].PCIeRXBytesPerSecond.Supported)
	second, err := m.Telemetry(context.Background())
	require.NoError(t, err)
	assert.True(t, second[0].PCIeTXBytesPerSecond.Supported)
	assert.Greater(t, second[0].PCIeRXBytesPerSecond.Value, 0.0, "a busy GPU moves bytes")

	require.NoError(t, m.LoseGPU(second[0].UUID))
	_, err = m.Telemetry(context.Background())
	require.NoError(t, err)
	require.NoError(t, m.RecoverGPU(second[0].UUID))
	back, err := m.Telemetry(context.Background())
	require.NoError(t, err)
	require.Len(t, back, 1)
	assert.False(t, back[0].PCIeTXBytesPerSecond.Supported, "back after a pass without it: counts from now")
}

// TestNVMLTimingMIGProcessesOnTheGPU: a GPU in MIG mode lists its MIG
// devices' processes on its own handle, one call (two with a MIG device
// shared with MPS), where PerCallReads asks each MIG device twice.
func TestNVMLTimingMIGProcessesOnTheGPU(t *testing.T) {
	spec := MachineSpec{Name: "mig", GPUModel: ModelH200SXM, GPUCount: 1, NVLink: NVLinkNone, MigEnabled: MigEnabledSpec{All: true}}
	for s := range 7 {
		spec.MigDevices = append(spec.MigDevices, MigDeviceSpec{GPU: 0, Profile: "1g.18gb", Start: s})
	}
	m, err := New(spec, "node-a")
	require.NoError(t, err)
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	mig := inv.GPUs[0].MIG.Devices[3].UUID
	fast := nvdevice.TelemetryOptions{SkipSlow: true, KeepDevices: true, MPSDevices: map[string]bool{}}
	timing := H200NVMLTiming()
	m.SetNVMLTiming(timing)
	passCost(t, m, fast)
	got := passCost(t, m, fast)
	assert.Equal(t, 1, got.ByFunction["nvmlDeviceGetComputeRunningProcesses"], "calls: %v", got.ByFunction)
	assert.Zero(t, got.ByFunction["nvmlDeviceGetMPSComputeRunningProcesses"])
	assert.Equal(t, 8, got.ByFunction["nvmlDeviceGetMemoryInfo"], "the GPU's and each MIG device's")
	fast.MPSDevices[mig] = true
	got = passCost(t, m, fast)
	assert.Equal(t, 1, got.ByFunction["nvmlDeviceGetMPSComputeRunningProcesses"], "a MIG device shared with MPS")

	timing.PerCallReads = true
	m.SetNVMLTiming(timing)
	passCost(t, m, fast)
	got = passCost(t, m, fast)
	assert.Equal(t, 7, got.ByFunction["nvmlDeviceGetComputeRunningProcesses"], "before: each MIG device")
	assert.Equal(t, 7, got.ByFunction["nvmlDeviceGetMPSComputeRunningProcesses"])
}

// TestNVMLTimingFastPass: a fast pass reads neither the devices' entries
// nor the slow readings; a MIG change makes the next fast pass read the
// entries again, as the backend does after a change it made.
func TestNVMLTimingFastPass(t *testing.T) {
	m, err := NewBuiltin("hgx-h200", "node-a")
	require.NoError(t, err)
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	m.SetNVMLTiming(H200NVMLTiming())
	fast := nvdevice.TelemetryOptions{SkipSlow: true, KeepDevices: true}

	first := passCost(t, m, fast)
	assert.Equal(t, 8, first.ByFunction["nvmlDeviceGetPciInfo"], "the first pass reads every GPU's entry")
	steady := passCost(t, m, fast)
	for _, fn := range []string{"nvmlDeviceGetPciInfo", "nvmlDeviceGetNvLinkState", "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetRemappedRows", "nvmlDeviceGetPcieThroughput"} {
		assert.Zero(t, steady.ByFunction[fn], fn)
	}
	assert.Equal(t, 8, steady.ByFunction["nvmlDeviceGetTemperature"], "fast readings every pass")

	_, err = m.CreateMigDevice(context.Background(), nvdevice.MigCreateRequest{ParentUUID: inv.GPUs[0].UUID, Profile: "1g.18gb", Start: 0})
	require.NoError(t, err)
	after := passCost(t, m, fast)
	assert.Equal(t, 8, after.ByFunction["nvmlDeviceGetPciInfo"], "a MIG change: the entries are read again")
	assert.Equal(t, 1, after.ByFunction["nvmlGpmMigSampleGet"], "the new MIG device is sampled")

	full := passCost(t, m, nvdevice.TelemetryOptions{})
	assert.Equal(t, 8, full.ByFunction["nvmlDeviceGetFieldValues"], "a full pass reads the slow readings with the others")
	assert.Zero(t, full.ByFunction["nvmlDeviceGetPciInfo"], "and the entries checked, not read")
	assert.Equal(t, 8, full.ByFunction["nvmlDeviceGetMigMode"])
}

// TestNVMLTimingOffByDefault: without SetNVMLTiming a pass charges
// nothing and spends nothing.
func TestNVMLTimingOffByDefault(t *testing.T) {
	m := oneH200(t)
	_, err := m.Telemetry(context.Background())
	require.NoError(t, err)
	assert.Zero(t, m.NVMLLedger().Calls)
}

// TestFastPassLeavesSlowReadingsOut: a fast pass's GPU samples have no
// slow readings (the collector fills them in), the rest as a full pass.
func TestFastPassLeavesSlowReadingsOut(t *testing.T) {
	m := oneH200(t)
	_, err := m.Telemetry(context.Background()) // a GPU's first pass has no PCIe rate
	require.NoError(t, err)
	full, err := m.TelemetryWith(context.Background(), nvdevice.TelemetryOptions{})
	require.NoError(t, err)
	fast, err := m.TelemetryWith(context.Background(), nvdevice.TelemetryOptions{SkipSlow: true, KeepDevices: true})
	require.NoError(t, err)
	require.Len(t, fast, 1)
	assert.True(t, full[0].ECCVolatileUncorrected.Supported)
	assert.False(t, fast[0].ECCVolatileUncorrected.Supported)
	assert.False(t, fast[0].PowerLimitWatts.Supported)
	assert.Equal(t, full[0].PowerWatts, fast[0].PowerWatts)
	nvdevice.CopySlowReadings(&fast[0], &full[0])
	assert.Equal(t, full[0], fast[0])
}
