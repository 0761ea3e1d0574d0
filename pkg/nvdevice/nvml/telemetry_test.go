//go:build cgo && linux

package nvml

import (
	"context"
	"encoding/binary"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// telemetryFake is what one GPU's telemetry calls return; a non-zero ret
// for a field makes that call fail.
type telemetryFake struct {
	utilRet, powerRet, eccRet, remapRet, pcieRet nvml.Return
	// throttle is what the old throttle-reasons call returns, events the
	// new clock-events call.
	throttle, events uint64
	// pcie are the PCIe byte counters the field values give (nil: 0);
	// fieldsRet, when set, is what nvmlDeviceGetFieldValues itself
	// returns (a driver that refuses it).
	pcie      *fakePCIe
	fieldsRet nvml.Return
}

// fakePCIe is a GPU's PCIe byte counters, and when they were read
// (microseconds; 0: NVML gives no timestamp).
type fakePCIe struct {
	tx, rx uint64
	at     int64
}

// fieldValues answers nvmlDeviceGetFieldValues as a GPU with f's readings:
// each field with the return of the call that reads it alone.
func (f telemetryFake) fieldValues(values []nvml.FieldValue) nvml.Return {
	if f.fieldsRet != nvml.SUCCESS {
		return f.fieldsRet
	}
	var pcie fakePCIe
	if f.pcie != nil {
		pcie = *f.pcie
	}
	for i := range values {
		v := &values[i]
		n, ret := uint64(0), nvml.ERROR_NOT_SUPPORTED
		switch v.FieldId {
		case nvml.FI_DEV_POWER_AVERAGE:
			n, ret = 512345, f.powerRet
		case nvml.FI_DEV_POWER_CURRENT_LIMIT:
			n, ret = 700000, f.powerRet
		case nvml.FI_DEV_PCIE_COUNT_TX_BYTES:
			n, ret = pcie.tx, f.pcieRet
		case nvml.FI_DEV_PCIE_COUNT_RX_BYTES:
			n, ret = pcie.rx, f.pcieRet
		case nvml.FI_DEV_ECC_SBE_VOL_TOTAL:
			n, ret = 3, f.eccRet
		case nvml.FI_DEV_ECC_DBE_VOL_TOTAL:
			n, ret = 1, f.eccRet
		case nvml.FI_DEV_ECC_SBE_AGG_TOTAL:
			n, ret = 30, f.eccRet
		case nvml.FI_DEV_ECC_DBE_AGG_TOTAL:
			n, ret = 2, f.eccRet
		case nvml.FI_DEV_REMAPPED_COR:
			n, ret = 5, f.remapRet
		case nvml.FI_DEV_REMAPPED_UNC:
			n, ret = 1, f.remapRet
		case nvml.FI_DEV_REMAPPED_PENDING:
			n, ret = 1, f.remapRet
		case nvml.FI_DEV_REMAPPED_FAILURE:
			n, ret = 0, f.remapRet
		}
		v.NvmlReturn = uint32(ret)
		v.Timestamp = pcie.at
		v.ValueType = uint32(nvml.VALUE_TYPE_UNSIGNED_LONG_LONG)
		binary.LittleEndian.PutUint64(v.Value[:], n)
	}
	return nvml.SUCCESS
}

// withTelemetry fills the mock's telemetry calls: an H100 SXM5 at work.
func withTelemetry(g *fakeGPU, f telemetryFake) *fakeGPU {
	d := g.Device
	d.GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) {
		return nvml.Utilization{Gpu: 87, Memory: 42}, f.utilRet
	}
	d.GetMemoryInfoFunc = func() (nvml.Memory, nvml.Return) {
		return nvml.Memory{Total: 81559 << 20, Used: 40 << 30, Free: 81559<<20 - 40<<30}, nvml.SUCCESS
	}
	d.GetFieldValuesFunc = f.fieldValues
	d.GetPowerUsageFunc = func() (uint32, nvml.Return) { return 512345, f.powerRet }
	d.GetEnforcedPowerLimitFunc = func() (uint32, nvml.Return) { return 700000, f.powerRet }
	d.GetTemperatureFunc = func(s nvml.TemperatureSensors) (uint32, nvml.Return) {
		if s != nvml.TEMPERATURE_GPU {
			return 0, nvml.ERROR_INVALID_ARGUMENT
		}
		return 61, nvml.SUCCESS
	}
	d.GetClockInfoFunc = func(c nvml.ClockType) (uint32, nvml.Return) {
		if c != nvml.CLOCK_SM {
			return 0, nvml.ERROR_INVALID_ARGUMENT
		}
		return 1980, nvml.SUCCESS
	}
	d.GetCurrentClocksEventReasonsFunc = func() (uint64, nvml.Return) { return f.events, nvml.SUCCESS }
	d.GetCurrentClocksThrottleReasonsFunc = func() (uint64, nvml.Return) { return f.throttle, nvml.SUCCESS }
	d.GetTotalEccErrorsFunc = func(t nvml.MemoryErrorType, c nvml.EccCounterType) (uint64, nvml.Return) {
		n := map[[2]int]uint64{
			{int(nvml.MEMORY_ERROR_TYPE_CORRECTED), int(nvml.VOLATILE_ECC)}:    3,
			{int(nvml.MEMORY_ERROR_TYPE_UNCORRECTED), int(nvml.VOLATILE_ECC)}:  1,
			{int(nvml.MEMORY_ERROR_TYPE_CORRECTED), int(nvml.AGGREGATE_ECC)}:   30,
			{int(nvml.MEMORY_ERROR_TYPE_UNCORRECTED), int(nvml.AGGREGATE_ECC)}: 2,
		}[[2]int{int(t), int(c)}]
		return n, f.eccRet
	}
	d.GetRemappedRowsFunc = func() (int, int, bool, bool, nvml.Return) { return 5, 1, true, false, f.remapRet }
	d.GetPcieThroughputFunc = func(c nvml.PcieUtilCounter) (uint32, nvml.Return) {
		if c == nvml.PCIE_UTIL_TX_BYTES {
			return 1000, f.pcieRet
		}
		return 2000, f.pcieRet
	}
	// No GPM (a GPU before Hopper, or behind a hypervisor that hides it),
	// no process: gpm_test.go and processes_test.go fill these.
	d.GpmQueryDeviceSupportFunc = func() (nvml.GpmSupport, nvml.Return) { return nvml.GpmSupport{}, nvml.SUCCESS }
	d.GetComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) { return nil, nvml.SUCCESS }
	d.GetMPSComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) { return nil, nvml.SUCCESS }
	d.GetProcessUtilizationFunc = func(uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
		return nil, nvml.ERROR_NOT_FOUND
	}
	return g
}

func TestTelemetryOfAGPU(t *testing.T) {
	na := nvdevice.Reading{}
	full := nvdevice.TelemetrySample{
		UUID: "GPU-0", Minor: 0, ProductName: "NVIDIA H100 80GB HBM3",
		GPUUtilization: nvdevice.Read(0.87), MemoryUtilization: nvdevice.Read(0.42),
		FramebufferUsedBytes:  nvdevice.Read(40 << 30),
		FramebufferFreeBytes:  nvdevice.Read(81559<<20 - 40<<30),
		FramebufferTotalBytes: nvdevice.Read(81559 << 20),
		PowerWatts:            nvdevice.Read(512.345), PowerLimitWatts: nvdevice.Read(700),
		TemperatureCelsius: nvdevice.Read(61), SMClockHertz: nvdevice.Read(1980e6),
		ClockEventReasons:    nvdevice.Read(0x4),
		ECCVolatileCorrected: nvdevice.Read(3), ECCVolatileUncorrected: nvdevice.Read(1),
		ECCAggregateCorrected: nvdevice.Read(30), ECCAggregateUncorrected: nvdevice.Read(2),
		RemappedRowsCorrectable: nvdevice.Read(5), RemappedRowsUncorrectable: nvdevice.Read(1),
		RemapPending: nvdevice.Read(1), RemapFailure: nvdevice.Read(0),
		PCIeTXBytesPerSecond: nvdevice.Read(1000 * 1024), PCIeRXBytesPerSecond: nvdevice.Read(2000 * 1024),
		ProcessesRead: true,
	}
	for _, tc := range []struct {
		name    string
		fake    telemetryFake
		missing []string
		want    func(s *nvdevice.TelemetrySample)
	}{
		{
			name: "every reading; the PCIe rate needs a second pass", fake: telemetryFake{events: 0x4, throttle: 0x8},
			want: func(s *nvdevice.TelemetrySample) { s.PCIeTXBytesPerSecond, s.PCIeRXBytesPerSecond = na, na },
		},
		{
			name: "a driver without field values: a call each, PCIe as NVML's 20 ms throughput",
			fake: telemetryFake{events: 0x4}, missing: []string{symFieldValues},
			want: func(*nvdevice.TelemetrySample) {},
		},
		{
			name: "field values refused: a call each", fake: telemetryFake{events: 0x4, fieldsRet: nvml.ERROR_NOT_SUPPORTED},
			want: func(*nvdevice.TelemetrySample) {},
		},
		{
			name: "an older driver without the clock events call",
			fake: telemetryFake{events: 0x4, throttle: 0x8}, missing: []string{symClocksEventReasons, symFieldValues},
			want: func(s *nvdevice.TelemetrySample) { s.ClockEventReasons = nvdevice.Read(0x8) },
		},
		{
			name: "refused readings are unsupported, not zero, and the rest still read",
			fake: telemetryFake{events: 0x4, utilRet: nvml.ERROR_NOT_SUPPORTED, powerRet: nvml.ERROR_NO_PERMISSION,
				eccRet: nvml.ERROR_NOT_SUPPORTED, remapRet: nvml.ERROR_UNKNOWN, pcieRet: nvml.ERROR_GPU_IS_LOST},
			want: func(s *nvdevice.TelemetrySample) {
				s.GPUUtilization, s.MemoryUtilization, s.PowerWatts, s.PowerLimitWatts = na, na, na, na
				s.ECCVolatileCorrected, s.ECCVolatileUncorrected, s.ECCAggregateCorrected, s.ECCAggregateUncorrected = na, na, na, na
				s.RemappedRowsCorrectable, s.RemappedRowsUncorrectable, s.RemapPending, s.RemapFailure = na, na, na, na
				s.PCIeTXBytesPerSecond, s.PCIeRXBytesPerSecond = na, na
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gpus := board(1, nvml.DEVICE_MIG_DISABLE)
			withTelemetry(gpus[0], tc.fake)
			got, err := testBackend(t, fakeLib(gpus, tc.missing...)).Telemetry(context.Background())
			require.NoError(t, err)
			want := full
			tc.want(&want)
			require.Len(t, got, 1)
			assert.Equal(t, want, got[0])
		})
	}
}

func TestTelemetryOfMigDevices(t *testing.T) {
	gpus := board(1, nvml.DEVICE_MIG_ENABLE)
	gpu := withTelemetry(gpus[0], telemetryFake{})
	gpu.addGI(nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4, nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE) // MIG-1
	gpu.addGI(nvml.GPU_INSTANCE_PROFILE_1_SLICE, 0, nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE) // MIG-2
	got, err := testBackend(t, fakeLib(gpus)).Telemetry(context.Background())
	require.NoError(t, err)
	require.Len(t, got, 3, "the GPU and its two MIG devices")
	assert.False(t, got[0].IsMIG())
	byUUID := map[string]nvdevice.TelemetrySample{}
	for _, s := range got[1:] {
		byUUID[s.UUID] = s
	}
	for _, tc := range []struct {
		uuid, profile string
		start         int
		memMiB        float64
	}{
		{"MIG-1", "3g.40gb", 4, 40448},
		{"MIG-2", "1g.10gb", 0, 9984},
	} {
		s, ok := byUUID[tc.uuid]
		require.True(t, ok, tc.uuid)
		assert.Equal(t, "GPU-0", s.ParentUUID, tc.uuid)
		assert.Equal(t, "GPU-0", s.GPUUUID(), tc.uuid)
		assert.Equal(t, tc.profile, s.MigProfile, tc.uuid)
		assert.Equal(t, tc.start, s.MigStart, tc.uuid)
		assert.Equal(t, nvdevice.Read(tc.memMiB*(1<<20)), s.FramebufferTotalBytes, tc.uuid)
		assert.Equal(t, nvdevice.Read(1<<30), s.FramebufferUsedBytes, tc.uuid)
		assert.False(t, s.GPUUtilization.Supported, "%s: plain NVML has no utilization per MIG device", tc.uuid)
		assert.False(t, s.PowerWatts.Supported, tc.uuid)
	}
}

// hangPower makes the GPU's power reading hang, as a driver call can, until
// release is closed; entered is closed when the first read starts hanging.
func hangPower(g *fakeGPU) (entered, release chan struct{}) {
	entered, release = make(chan struct{}), make(chan struct{})
	var once sync.Once
	read := g.GetFieldValuesFunc // the power draw is a field value
	g.GetFieldValuesFunc = func(values []nvml.FieldValue) nvml.Return {
		once.Do(func() { close(entered) })
		<-release
		return read(values)
	}
	return entered, release
}

// within runs f and says whether it returned before the timeout.
func within(timeout time.Duration, f func()) bool {
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	select {
	case <-done:
		return true
	case <-time.After(timeout):
		return false
	}
}

func TestPrepareDoesNotWaitForTelemetry(t *testing.T) {
	gpus := board(2, nvml.DEVICE_MIG_ENABLE)
	for _, g := range gpus {
		withTelemetry(g, telemetryFake{})
	}
	entered, release := hangPower(gpus[1])
	b := testBackend(t, fakeLib(gpus))
	ctx := context.Background()
	passDone := make(chan []nvdevice.TelemetrySample)
	go func() {
		s, err := b.Telemetry(ctx)
		assert.NoError(t, err)
		passDone <- s
	}()
	select {
	case <-entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the pass never read GPU-1's power")
	}
	// The pass is under way, hung in a reading of GPU-1: what a prepare
	// calls completes.
	assert.True(t, within(5*time.Second, func() {
		inv, err := b.Inventory(ctx)
		assert.NoError(t, err)
		assert.Len(t, inv.GPUs, 2)
	}), "an inventory read waited for the telemetry pass")
	assert.True(t, within(5*time.Second, func() {
		_, err := b.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: "GPU-1", Profile: "3g.40gb", Start: 4})
		assert.NoError(t, err)
	}), "a MIG device's creation waited for the telemetry pass")
	select {
	case <-passDone:
		t.Fatal("the pass ended while a reading hung")
	default:
	}
	closed := make(chan struct{})
	go func() { defer close(closed); assert.NoError(t, b.Close()) }()
	select {
	case <-closed:
		t.Fatal("Close shut NVML down under a reading")
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	s := <-passDone
	assert.Len(t, s, 2, "both GPUs sampled")
	<-closed
	_, err := b.Telemetry(ctx)
	assert.ErrorIs(t, err, errClosed)
}
