package sim

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// sampleOf reads the machine's telemetry and returns the device's sample.
func sampleOf(t *testing.T, m *Machine, uuid string) nvdevice.TelemetrySample {
	t.Helper()
	got, err := m.Telemetry(context.Background())
	require.NoError(t, err)
	for _, s := range got {
		if s.UUID == uuid {
			return s
		}
	}
	t.Fatalf("no sample of %s", uuid)
	return nvdevice.TelemetrySample{}
}

type startedProcess struct {
	pid   int
	share float64
	mem   uint64
}

func TestProcessesDriveTheGPUsTelemetry(t *testing.T) {
	const gib = 1 << 30
	na := nvdevice.Reading{}
	for _, tc := range []struct {
		name      string
		load      float64
		procs     []startedProcess
		wantUtil  float64
		wantProcs []nvdevice.ProcessSample
		extraMem  float64 // framebuffer used over the idle GPU's
	}{
		{name: "idle: no process, read", wantUtil: 0},
		{
			name:     "two processes add their shares and their memory",
			procs:    []startedProcess{{pid: 200, share: 0.3, mem: 10 * gib}, {pid: 100, share: 0.2, mem: 4 * gib}},
			wantUtil: 0.5, extraMem: 14 * gib,
			wantProcs: []nvdevice.ProcessSample{
				{PID: 100, UsedMemoryBytes: nvdevice.Read(4 * gib), SMUtilization: nvdevice.Read(0.2)},
				{PID: 200, UsedMemoryBytes: nvdevice.Read(10 * gib), SMUtilization: nvdevice.Read(0.3)},
			},
		},
		{
			name:     "an over-asked GPU is busy once, each process gets share/sum",
			procs:    []startedProcess{{pid: 1, share: 0.75, mem: gib}, {pid: 2, share: 0.75, mem: gib}},
			wantUtil: 1, extraMem: 2 * gib,
			wantProcs: []nvdevice.ProcessSample{
				{PID: 1, UsedMemoryBytes: nvdevice.Read(gib), SMUtilization: nvdevice.Read(0.5)},
				{PID: 2, UsedMemoryBytes: nvdevice.Read(gib), SMUtilization: nvdevice.Read(0.5)},
			},
		},
		{
			name: "SetLoad adds to the processes' shares, at most 1", load: 0.9,
			procs:    []startedProcess{{pid: 7, share: 0.25}},
			wantUtil: 1,
			wantProcs: []nvdevice.ProcessSample{
				{PID: 7, UsedMemoryBytes: nvdevice.Read(0), SMUtilization: nvdevice.Read(0.25)},
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, gpu := oneGPU(t, false)
			sampleOf(t, m, gpu) // a GPU's first pass has no PCIe rate
			idle := sampleOf(t, m, gpu)
			require.NoError(t, m.SetLoad(gpu, tc.load))
			for _, p := range tc.procs {
				require.NoError(t, m.StartProcess(gpu, p.pid, p.share, p.mem))
			}
			s := sampleOf(t, m, gpu)
			assert.True(t, s.ProcessesRead)
			assert.Equal(t, tc.wantProcs, s.Processes)
			assert.Equal(t, nvdevice.Read(tc.wantUtil), s.GPUUtilization)
			assert.Equal(t, nvdevice.Read(tc.wantUtil), s.SMActive, "SMs active as long as the GPU is busy")
			if tc.load == 0 {
				assert.Equal(t, idle.FramebufferUsedBytes.Value+tc.extraMem, s.FramebufferUsedBytes.Value)
			}
			assert.Equal(t, s.FramebufferTotalBytes.Value, s.FramebufferUsedBytes.Value+s.FramebufferFreeBytes.Value)
			if tc.wantUtil > 0 {
				assert.Greater(t, s.PowerWatts.Value, idle.PowerWatts.Value, "a busier GPU draws more")
				assert.Greater(t, s.TemperatureCelsius.Value, idle.TemperatureCelsius.Value)
				assert.Greater(t, s.SMClockHertz.Value, idle.SMClockHertz.Value)
			}
			assert.Equal(t, na, s.NVLinkTXBytesPerSecond, "no NVLink on this machine: no figure, not 0")
			assert.Equal(t, s, sampleOf(t, m, gpu), "deterministic")

			for _, p := range tc.procs {
				m.EndProcess(p.pid)
			}
			require.NoError(t, m.SetLoad(gpu, 0))
			assert.Equal(t, idle, sampleOf(t, m, gpu), "idle again once the processes end")
		})
	}
}

// The GPM figures and the rest follow the load, never falling as it rises,
// and stay ratios.
func TestGPMFollowsTheLoad(t *testing.T) {
	m, err := New(MachineSpec{Name: "t", GPUModel: ModelH100SXM5, GPUCount: 1, NVLink: NVLinkNVSwitch}, "n")
	require.NoError(t, err)
	gpu := inventory(t, m).GPUs[0].UUID
	var prev nvdevice.TelemetrySample
	for i, load := range []float64{0, 0.1, 0.5, 0.9, 1} {
		require.NoError(t, m.SetLoad(gpu, load))
		s := sampleOf(t, m, gpu)
		figures := []struct {
			name      string
			cur, last nvdevice.Reading
			ratio     bool
		}{
			{"SM active", s.SMActive, prev.SMActive, true},
			{"SM occupancy", s.SMOccupancy, prev.SMOccupancy, true},
			{"tensor active", s.TensorActive, prev.TensorActive, true},
			{"DRAM active", s.DRAMActive, prev.DRAMActive, true},
			{"NVLink tx", s.NVLinkTXBytesPerSecond, prev.NVLinkTXBytesPerSecond, false},
			{"NVLink rx", s.NVLinkRXBytesPerSecond, prev.NVLinkRXBytesPerSecond, false},
			{"power", s.PowerWatts, prev.PowerWatts, false},
			{"temperature", s.TemperatureCelsius, prev.TemperatureCelsius, false},
		}
		for _, f := range figures {
			require.True(t, f.cur.Supported, "%s at load %v", f.name, load)
			if f.ratio {
				assert.GreaterOrEqual(t, f.cur.Value, 0.0, f.name)
				assert.LessOrEqual(t, f.cur.Value, 1.0, f.name)
			}
			if i > 0 {
				assert.Greater(t, f.cur.Value, f.last.Value, "%s rises with the load (%v)", f.name, load)
			}
		}
		if load == 0 {
			assert.Zero(t, s.SMActive.Value, "an idle GPU's SMs are idle")
		}
		prev = s
	}
	assert.Equal(t, 1.0, prev.SMActive.Value)
	// 18 links at 25 GB/s each way: a busy GPU uses a fifth of 450 GB/s.
	assert.Equal(t, 90e9, prev.NVLinkTXBytesPerSecond.Value)
	assert.LessOrEqual(t, prev.PowerWatts.Value, prev.PowerLimitWatts.Value)
}

func TestNVLinkThroughputOnlyWithNVLink(t *testing.T) {
	for _, tc := range []struct {
		name   string
		model  string
		nvlink string
		wantTX float64 // at full load; 0: unsupported
	}{
		{"HGX H100: 18 links through NVSwitches", ModelH100SXM5, NVLinkNVSwitch, 0.2 * 18 * 25e9},
		{"H100 PCIe with NVLink bridges: 12 links", ModelH100PCIe, NVLinkBridgedPairs, 0.2 * 12 * 25e9},
		{"H100 PCIe without a bridge: no NVLink", ModelH100PCIe, NVLinkNone, 0},
		{"HGX H200", ModelH200SXM, NVLinkNVSwitch, 0.2 * 18 * 25e9},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := New(MachineSpec{Name: "t", GPUModel: tc.model, GPUCount: 2, NVLink: tc.nvlink}, "n")
			require.NoError(t, err)
			gpu := inventory(t, m).GPUs[0].UUID
			require.NoError(t, m.SetLoad(gpu, 1))
			s := sampleOf(t, m, gpu)
			if tc.wantTX == 0 {
				assert.False(t, s.NVLinkTXBytesPerSecond.Supported)
				assert.False(t, s.NVLinkRXBytesPerSecond.Supported)
				assert.True(t, s.SMActive.Supported, "GPM is there without NVLink")
				return
			}
			assert.True(t, s.NVLinkTXBytesPerSecond.Supported)
			assert.InDelta(t, tc.wantTX, s.NVLinkTXBytesPerSecond.Value, 1)
			assert.True(t, s.NVLinkRXBytesPerSecond.Supported)
		})
	}
}

func TestProcessesOnMigDevices(t *testing.T) {
	const gib = 1 << 30
	ctx := context.Background()
	m, gpu := oneGPU(t, true)
	big, err := m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: "3g.40gb", Start: 4})
	require.NoError(t, err)
	small, err := m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: "1g.10gb", Start: 0})
	require.NoError(t, err)
	idleGPU := sampleOf(t, m, gpu)

	require.NoError(t, m.StartProcess(big.UUID, 42, 0.5, 8*gib))
	require.NoError(t, m.StartProcess(big.UUID, 43, 0.25, 2*gib))
	require.NoError(t, m.StartProcess(small.UUID, 42, 1, 1*gib), "a PID on two devices")
	b, sm, g := sampleOf(t, m, big.UUID), sampleOf(t, m, small.UUID), sampleOf(t, m, gpu)

	assert.True(t, b.ProcessesRead)
	assert.Equal(t, []nvdevice.ProcessSample{
		{PID: 42, UsedMemoryBytes: nvdevice.Read(8 * gib)},
		{PID: 43, UsedMemoryBytes: nvdevice.Read(2 * gib)},
	}, b.Processes, "its own processes; no per-process SM on a MIG device")
	assert.Equal(t, nvdevice.Read(10*gib), b.FramebufferUsedBytes)
	assert.Equal(t, nvdevice.Read(0.75), b.SMActive, "the instance's own GPM")
	assert.Equal(t, nvdevice.Read(1.0), sm.SMActive)
	assert.Equal(t, []nvdevice.ProcessSample{{PID: 42, UsedMemoryBytes: nvdevice.Read(1 * gib)}}, sm.Processes)
	assert.False(t, b.GPUUtilization.Supported)
	assert.False(t, b.NVLinkTXBytesPerSecond.Supported, "NVLink is the GPU's")

	assert.True(t, g.ProcessesRead)
	assert.Empty(t, g.Processes, "a GPU in MIG mode has no process of its own")
	assert.False(t, g.GPUUtilization.Supported, "nor utilization")
	assert.False(t, g.SMActive.Supported, "nor GPM figures of its own")
	assert.Equal(t, idleGPU.FramebufferUsedBytes.Value+11*gib, g.FramebufferUsedBytes.Value,
		"its framebuffer used counts its MIG devices'")
	assert.Greater(t, g.PowerWatts.Value, idleGPU.PowerWatts.Value, "busy instances draw power")

	m.EndProcess(42)
	b, sm = sampleOf(t, m, big.UUID), sampleOf(t, m, small.UUID)
	assert.Equal(t, []nvdevice.ProcessSample{{PID: 43, UsedMemoryBytes: nvdevice.Read(2 * gib)}}, b.Processes)
	assert.Empty(t, sm.Processes, "EndProcess takes the PID off every device")
	assert.Equal(t, nvdevice.Read(0.0), sm.SMActive)
}

func TestStartProcessAndInjectECCRefuse(t *testing.T) {
	m, gpu := oneGPU(t, false)
	for _, tc := range []struct {
		name     string
		err      error
		notFound bool
	}{
		{"an unknown device", m.StartProcess("GPU-nope", 1, 0.5, 0), true},
		{"a share above 1", m.StartProcess(gpu, 1, 1.5, 0), false},
		{"a negative share", m.StartProcess(gpu, 1, -0.1, 0), false},
		{"PID 0", m.StartProcess(gpu, 0, 0.5, 0), false},
		{"ECC into an unknown GPU", m.InjectECC("GPU-nope", 1, 1), true},
	} {
		require.Error(t, tc.err, tc.name)
		assert.Equal(t, tc.notFound, errorsIsNotFound(tc.err), tc.name)
	}
	assert.Empty(t, sampleOf(t, m, gpu).Processes, "nothing refused was started")
}

func errorsIsNotFound(err error) bool { return errors.Is(err, nvdevice.ErrNotFound) }

func TestInjectECC(t *testing.T) {
	m, err := New(MachineSpec{Name: "t", GPUCount: 2, NVLink: NVLinkNone}, "n")
	require.NoError(t, err)
	gpus := inventory(t, m).GPUs
	require.NoError(t, m.InjectECC(gpus[0].UUID, 3, 1))
	require.NoError(t, m.InjectECC(gpus[0].UUID, 2, 0))
	s := sampleOf(t, m, gpus[0].UUID)
	for _, tc := range []struct {
		name string
		got  nvdevice.Reading
		want float64
	}{
		{"volatile corrected", s.ECCVolatileCorrected, 5},
		{"volatile uncorrected", s.ECCVolatileUncorrected, 1},
		{"aggregate corrected", s.ECCAggregateCorrected, 5},
		{"aggregate uncorrected", s.ECCAggregateUncorrected, 1},
	} {
		assert.Equal(t, nvdevice.Read(tc.want), tc.got, tc.name)
	}
	assert.Equal(t, nvdevice.Read(0), sampleOf(t, m, gpus[1].UUID).ECCVolatileCorrected, "the other GPU has none")
}
