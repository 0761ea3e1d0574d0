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

// procFake is what one GPU's process calls return.
type procFake struct {
	compute, mps       []nvml.ProcessInfo
	computeRet, mpsRet nvml.Return
	util               []nvml.ProcessUtilizationSample
	utilRet            nvml.Return
	// since are the lastSeenTimeStamps the utilization calls were given.
	since []uint64
}

func withProcesses(g *fakeGPU, f *procFake) {
	g.GetComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) { return f.compute, f.computeRet }
	g.GetMPSComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) { return f.mps, f.mpsRet }
	g.GetProcessUtilizationFunc = func(since uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
		f.since = append(f.since, since)
		return f.util, f.utilRet
	}
}

const gib = 1 << 30

func proc(pid int, mem uint64) nvml.ProcessInfo {
	// A GPU's processes have no GPU or compute instance (0xFFFFFFFF).
	return nvml.ProcessInfo{Pid: uint32(pid), UsedGpuMemory: mem, GpuInstanceId: 0xFFFFFFFF, ComputeInstanceId: 0xFFFFFFFF}
}

func utilSample(pid int, sm uint32) nvml.ProcessUtilizationSample {
	return nvml.ProcessUtilizationSample{Pid: uint32(pid), SmUtil: sm, TimeStamp: 1}
}

func TestProcessesOfAGPU(t *testing.T) {
	na := nvdevice.Reading{}
	for _, tc := range []struct {
		name     string
		fake     procFake
		wantRead bool
		want     []nvdevice.ProcessSample
	}{
		{
			name: "compute and MPS lists merged by PID, sorted, SM averaged per PID",
			fake: procFake{
				// 300 is an MPS server (compute list), 100 and 200 its
				// clients; NVML lists 100 in both.
				compute: []nvml.ProcessInfo{proc(300, 1*gib), proc(100, 2*gib)},
				mps:     []nvml.ProcessInfo{proc(100, 2*gib), proc(200, 4*gib)},
				util: []nvml.ProcessUtilizationSample{
					utilSample(100, 20), utilSample(100, 40), utilSample(200, 90),
					utilSample(999, 100), // a process that ended: not listed
				},
			},
			wantRead: true,
			want: []nvdevice.ProcessSample{
				{PID: 100, UsedMemoryBytes: nvdevice.Read(2 * gib), SMUtilization: nvdevice.Read(0.3)},
				{PID: 200, UsedMemoryBytes: nvdevice.Read(4 * gib), SMUtilization: nvdevice.Read(0.9)},
				{PID: 300, UsedMemoryBytes: nvdevice.Read(1 * gib), SMUtilization: na},
			},
		},
		{
			name: "memory NVML cannot tell is unsupported, not 0; a PID's other entry gives it",
			fake: procFake{
				compute: []nvml.ProcessInfo{proc(100, notAvailable), proc(200, notAvailable)},
				mps:     []nvml.ProcessInfo{proc(200, 3*gib)},
				utilRet: nvml.ERROR_NOT_FOUND,
			},
			wantRead: true,
			want: []nvdevice.ProcessSample{
				{PID: 100, UsedMemoryBytes: na, SMUtilization: na},
				{PID: 200, UsedMemoryBytes: nvdevice.Read(3 * gib), SMUtilization: na},
			},
		},
		{
			name:     "no sample since the last pass (NOT_FOUND) is no failure",
			fake:     procFake{compute: []nvml.ProcessInfo{proc(100, gib)}, utilRet: nvml.ERROR_NOT_FOUND},
			wantRead: true,
			want:     []nvdevice.ProcessSample{{PID: 100, UsedMemoryBytes: nvdevice.Read(gib)}},
		},
		{
			name:     "no sample counted (go-nvml's INSUFFICIENT_SIZE with none) is no failure",
			fake:     procFake{compute: []nvml.ProcessInfo{proc(100, gib)}, util: []nvml.ProcessUtilizationSample{}, utilRet: nvml.ERROR_INSUFFICIENT_SIZE},
			wantRead: true,
			want:     []nvdevice.ProcessSample{{PID: 100, UsedMemoryBytes: nvdevice.Read(gib)}},
		},
		{
			name:     "a refused utilization call leaves SM unsupported, the list still read",
			fake:     procFake{compute: []nvml.ProcessInfo{proc(100, gib)}, util: []nvml.ProcessUtilizationSample{utilSample(100, 50)}, utilRet: nvml.ERROR_NO_PERMISSION},
			wantRead: true,
			want:     []nvdevice.ProcessSample{{PID: 100, UsedMemoryBytes: nvdevice.Read(gib)}},
		},
		{
			name:     "no process",
			wantRead: true,
		},
		{
			name:     "a failed compute list: NVML could not tell",
			fake:     procFake{compute: []nvml.ProcessInfo{proc(100, gib)}, computeRet: nvml.ERROR_NO_PERMISSION},
			wantRead: false,
		},
		{
			name:     "a failed MPS list: NVML could not tell",
			fake:     procFake{compute: []nvml.ProcessInfo{proc(100, gib)}, mpsRet: nvml.ERROR_UNKNOWN},
			wantRead: false,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gpus := board(1, nvml.DEVICE_MIG_DISABLE)
			withTelemetry(gpus[0], telemetryFake{})
			withProcesses(gpus[0], &tc.fake)
			got, err := testBackend(t, fakeLib(gpus)).Telemetry(context.Background())
			require.NoError(t, err)
			require.Len(t, got, 1)
			assert.Equal(t, tc.wantRead, got[0].ProcessesRead)
			assert.Equal(t, tc.want, got[0].Processes)
		})
	}
}

// Per-process utilization is read since the previous pass's time, each
// pass; a failed read asks from the same time again.
func TestProcessUtilizationSinceThePreviousPass(t *testing.T) {
	gpus := board(1, nvml.DEVICE_MIG_DISABLE)
	withTelemetry(gpus[0], telemetryFake{})
	f := &procFake{compute: []nvml.ProcessInfo{proc(100, gib)}, util: []nvml.ProcessUtilizationSample{utilSample(100, 10)}}
	withProcesses(gpus[0], f)
	b := testBackend(t, fakeLib(gpus))
	t0 := time.Date(2026, 11, 26, 10, 0, 0, 0, time.UTC)
	now := t0
	b.now = func() time.Time { return now }
	for _, step := range []struct {
		ret  nvml.Return
		want float64 // the SM utilization read, -1 none
	}{
		{nvml.SUCCESS, 0.1}, {nvml.ERROR_UNKNOWN, -1}, {nvml.SUCCESS, 0.1}, {nvml.ERROR_NOT_FOUND, -1},
	} {
		f.utilRet = step.ret
		got, err := b.Telemetry(context.Background())
		require.NoError(t, err)
		sm := got[0].Processes[0].SMUtilization
		assert.Equal(t, step.want >= 0, sm.Supported)
		if step.want >= 0 {
			assert.Equal(t, step.want, sm.Value)
		}
		now = now.Add(10 * time.Second)
	}
	us := func(t time.Time) uint64 { return uint64(t.UnixMicro()) }
	assert.Equal(t, []uint64{
		0,                            // the first pass: every sample NVML kept
		us(t0),                       // since the first pass
		us(t0),                       // the second failed: since the first again
		us(t0.Add(20 * time.Second)), // since the third
	}, f.since)
}

func TestProcessesOfMigDevices(t *testing.T) {
	gpus := board(1, nvml.DEVICE_MIG_ENABLE)
	gpu := withTelemetry(gpus[0], telemetryFake{})
	// The parent's list names every MIG device's processes, here without
	// their instance ids (a caller without the privilege): none of it may
	// show as the whole GPU's, and each MIG device is asked for its own.
	parent := &procFake{compute: []nvml.ProcessInfo{proc(100, gib), proc(200, gib)}}
	withProcesses(gpu, parent)
	gpu.addGI(nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4, nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE) // MIG-1
	gpu.addGI(nvml.GPU_INSTANCE_PROFILE_1_SLICE, 0, nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE) // MIG-2
	gpu.migProcs = map[string][]nvml.ProcessInfo{
		"MIG-1": {{Pid: 100, UsedGpuMemory: 5 * gib, GpuInstanceId: 1, ComputeInstanceId: 0}},
		"MIG-2": {{Pid: 200, UsedGpuMemory: notAvailable, GpuInstanceId: 2, ComputeInstanceId: 0}},
	}
	got, err := testBackend(t, fakeLib(gpus)).Telemetry(context.Background())
	require.NoError(t, err)
	require.Len(t, got, 3)
	byUUID := map[string]nvdevice.TelemetrySample{}
	for _, s := range got {
		byUUID[s.UUID] = s
	}
	assert.True(t, byUUID["GPU-0"].ProcessesRead)
	assert.Empty(t, byUUID["GPU-0"].Processes, "a GPU in MIG mode has no process of its own")
	assert.Empty(t, parent.since, "nor per-process utilization")
	assert.Equal(t, []nvdevice.ProcessSample{{PID: 100, UsedMemoryBytes: nvdevice.Read(5 * gib)}}, byUUID["MIG-1"].Processes,
		"the MIG handle's own list, no SM utilization")
	assert.Equal(t, []nvdevice.ProcessSample{{PID: 200}}, byUUID["MIG-2"].Processes)
	assert.True(t, byUUID["MIG-1"].ProcessesRead)
	assert.Zero(t, gpu.migProcCalls, "NVML samples no process utilization per MIG device")

	gpu.migProcsRet = nvml.ERROR_NO_PERMISSION
	got, err = testBackend(t, fakeLib(gpus)).Telemetry(context.Background())
	require.NoError(t, err)
	for _, s := range got[1:] {
		assert.False(t, s.ProcessesRead, "%s: a failed list", s.UUID)
		assert.Nil(t, s.Processes)
	}
}

// TestProcessesOfMigDevicesFromTheGPU: NVML lists every MIG device's
// processes on the GPU's handle, with their instance ids, to a privileged
// caller: one list for the GPU, each process on the MIG device of its ids,
// and no MIG device asked; MPS clients too when a MIG device is shared
// with MPS.
func TestProcessesOfMigDevicesFromTheGPU(t *testing.T) {
	gpus := board(1, nvml.DEVICE_MIG_ENABLE)
	gpu := withTelemetry(gpus[0], telemetryFake{})
	gpu.addGI(nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4, nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE) // MIG-1: GI 1, CI 0
	gpu.addGI(nvml.GPU_INSTANCE_PROFILE_1_SLICE, 0, nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE) // MIG-2: GI 2, CI 0
	parent := &procFake{
		compute: []nvml.ProcessInfo{
			{Pid: 100, UsedGpuMemory: 5 * gib, GpuInstanceId: 1, ComputeInstanceId: 0},
			{Pid: 200, UsedGpuMemory: gib, GpuInstanceId: 2, ComputeInstanceId: 0},
			{Pid: 300, UsedGpuMemory: gib, GpuInstanceId: 2, ComputeInstanceId: 0}, // an MPS server
		},
		mps: []nvml.ProcessInfo{{Pid: 301, UsedGpuMemory: 2 * gib, GpuInstanceId: 2, ComputeInstanceId: 0}},
	}
	withProcesses(gpu, parent)
	// What the MIG devices' own handles would say: never asked.
	gpu.migProcs = map[string][]nvml.ProcessInfo{"MIG-1": {{Pid: 999, GpuInstanceId: 1}}}
	lib := fakeLib(gpus)
	b := testBackend(t, lib)
	byUUID := func(opts nvdevice.TelemetryOptions) (map[string]nvdevice.TelemetrySample, map[string]int) {
		got, calls, _ := callsOf(t, b, opts, lib, gpu.Device)
		out := map[string]nvdevice.TelemetrySample{}
		for _, s := range got {
			out[s.UUID] = s
		}
		return out, calls
	}

	got, calls := byUUID(nvdevice.TelemetryOptions{MPSDevices: map[string]bool{"MIG-2": true}})
	assert.Equal(t, 1, calls["GetComputeRunningProcesses"], "one list for the GPU and its MIG devices")
	assert.Equal(t, 1, calls["GetMPSComputeRunningProcesses"], "and one of MPS clients")
	assert.Empty(t, got["GPU-0"].Processes, "a GPU in MIG mode has no process of its own")
	assert.Equal(t, []nvdevice.ProcessSample{{PID: 100, UsedMemoryBytes: nvdevice.Read(5 * gib)}}, got["MIG-1"].Processes)
	assert.Equal(t, []nvdevice.ProcessSample{
		{PID: 200, UsedMemoryBytes: nvdevice.Read(gib)},
		{PID: 300, UsedMemoryBytes: nvdevice.Read(gib)},
		{PID: 301, UsedMemoryBytes: nvdevice.Read(2 * gib)},
	}, got["MIG-2"].Processes, "each process on the MIG device of its instance ids, MPS clients included")
	assert.True(t, got["MIG-1"].ProcessesRead)
	assert.True(t, got["MIG-2"].ProcessesRead)

	got, calls = byUUID(nvdevice.TelemetryOptions{MPSDevices: map[string]bool{}})
	assert.Zero(t, calls["GetMPSComputeRunningProcesses"], "no MIG device shared with MPS: no MPS list")
	assert.Len(t, got["MIG-2"].Processes, 2, "the MPS server, a compute process, still")

	parent.computeRet = nvml.ERROR_NOT_SUPPORTED // a driver that does not aggregate
	got, _ = byUUID(nvdevice.TelemetryOptions{})
	assert.Equal(t, []nvdevice.ProcessSample{{PID: 999, UsedMemoryBytes: nvdevice.Read(0)}}, got["MIG-1"].Processes, "asked of the MIG device instead")
	assert.True(t, got["MIG-1"].ProcessesRead)
}
