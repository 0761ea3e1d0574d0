//go:build cgo && linux

package nvml

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// rusageThread is RUSAGE_THREAD (linux/resource.h).
const rusageThread = 1

// threadCPU is the CPU time the calling thread has used (the caller has
// locked its goroutine to it).
func threadCPU(t *testing.T) time.Duration {
	var ru syscall.Rusage
	require.NoError(t, syscall.Getrusage(rusageThread, &ru))
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// timed is the median wall time and the mean CPU time of one call of f
// over n calls.
func timed(t *testing.T, n int, f func()) (wall, cpu time.Duration) {
	walls := make([]time.Duration, n)
	c0 := threadCPU(t)
	for i := range walls {
		start := time.Now()
		f()
		walls[i] = time.Since(start)
	}
	cpu = (threadCPU(t) - c0) / time.Duration(n)
	slices.Sort(walls)
	return walls[n/2], cpu
}

// TestRealGPUCallCosts times, on GPU 0, each NVML call a telemetry pass
// makes (wall and the calling thread's CPU, which getrusage counts in the
// kernel too), and a full and a fast pass of the backend, and writes the
// table to GPUDRA_REAL_GPU_OUT/call-costs.txt: what the simulator's timing
// model (sim.H200NVMLTiming) needs per function, where the H200's capture
// gave only whole passes. It runs only where GPUDRA_REAL_GPU=1; it changes
// nothing on the GPU.
func TestRealGPUCallCosts(t *testing.T) {
	if os.Getenv("GPUDRA_REAL_GPU") != "1" {
		t.Skip("GPUDRA_REAL_GPU=1 runs this on a real GPU")
	}
	ctx := context.Background()
	backend, err := New(ctx, Options{DriverRoot: os.Getenv("GPUDRA_DRIVER_ROOT")})
	require.NoError(t, err)
	b := backend.(*Backend)
	defer b.Close()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()

	lib := b.lib
	dev, ret := lib.DeviceGetHandleByIndex(0)
	require.Equal(t, nvml.SUCCESS, ret)
	const n = 21
	calls := []struct {
		name string
		n    int
		f    func()
	}{
		{"nvmlDeviceGetCount", n, func() { lib.DeviceGetCount() }},
		{"nvmlDeviceGetHandleByIndex", n, func() { lib.DeviceGetHandleByIndex(0) }},
		{"nvmlDeviceGetUUID", n, func() { dev.GetUUID() }},
		{"nvmlDeviceGetName", n, func() { dev.GetName() }},
		{"nvmlDeviceGetMinorNumber", n, func() { dev.GetMinorNumber() }},
		{"nvmlDeviceGetBrand", n, func() { dev.GetBrand() }},
		{"nvmlDeviceGetArchitecture", n, func() { dev.GetArchitecture() }},
		{"nvmlDeviceGetCudaComputeCapability", n, func() { dev.GetCudaComputeCapability() }},
		{"nvmlDeviceGetPciInfo", n, func() { dev.GetPciInfo() }},
		{"nvmlDeviceGetMigMode", n, func() { dev.GetMigMode() }},
		{"nvmlDeviceGetGpuInstanceProfileInfo", n, func() { dev.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE) }},
		{"nvmlDeviceGetNvLinkState", n, func() { dev.GetNvLinkState(0) }},
		{"nvmlDeviceGetUtilizationRates", n, func() { dev.GetUtilizationRates() }},
		{"nvmlDeviceGetMemoryInfo", n, func() { dev.GetMemoryInfo() }},
		{"nvmlDeviceGetPowerUsage", n, func() { dev.GetPowerUsage() }},
		{"nvmlDeviceGetEnforcedPowerLimit", n, func() { dev.GetEnforcedPowerLimit() }},
		{"nvmlDeviceGetTemperature", n, func() { dev.GetTemperature(nvml.TEMPERATURE_GPU) }},
		{"nvmlDeviceGetClockInfo", n, func() { dev.GetClockInfo(nvml.CLOCK_SM) }},
		{"nvmlDeviceGetCurrentClocksEventReasons", n, func() { dev.GetCurrentClocksEventReasons() }},
		{"nvmlDeviceGetTotalEccErrors", n, func() { dev.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.VOLATILE_ECC) }},
		{"nvmlDeviceGetRemappedRows", n, func() { dev.GetRemappedRows() }},
		{"nvmlDeviceGetComputeRunningProcesses", n, func() { dev.GetComputeRunningProcesses() }},
		{"nvmlDeviceGetMPSComputeRunningProcesses", n, func() { dev.GetMPSComputeRunningProcesses() }},
		{"nvmlDeviceGetPcieThroughput", 5, func() { dev.GetPcieThroughput(nvml.PCIE_UTIL_TX_BYTES) }},
		{"nvmlDeviceGetFieldValues(PCIE_COUNT_TX_BYTES,RX)", n, func() {
			dev.GetFieldValues([]nvml.FieldValue{{FieldId: nvml.FI_DEV_PCIE_COUNT_TX_BYTES}, {FieldId: nvml.FI_DEV_PCIE_COUNT_RX_BYTES}})
		}},
		{"nvmlDeviceGetFieldValues(a fast pass's fields)", n, func() { dev.GetFieldValues(passFields(false)) }},
		{"nvmlDeviceGetFieldValues(a full pass's fields)", n, func() { dev.GetFieldValues(passFields(true)) }},
		{"nvmlGpmSampleAlloc+Get+Free", n, func() {
			if s, ret := lib.GpmSampleAlloc(); ret == nvml.SUCCESS {
				dev.GpmSampleGet(s)
				lib.GpmSampleFree(s)
			}
		}},
	}
	var out strings.Builder
	fmt.Fprintf(&out, "%-52s %12s %12s\n", "CALL (GPU 0)", "WALL p50", "CPU mean")
	for _, c := range calls {
		wall, cpu := timed(t, c.n, c.f)
		fmt.Fprintf(&out, "%-52s %12v %12v\n", c.name, wall, cpu)
	}
	for _, p := range []struct {
		name string
		opts nvdevice.TelemetryOptions
	}{
		{"pass: everything (before issue 50)", nvdevice.TelemetryOptions{}},
		{"pass: fast (no slow readings, devices kept)", nvdevice.TelemetryOptions{SkipSlow: true, KeepDevices: true}},
	} {
		_, err := b.TelemetryWith(ctx, p.opts) // GPM's first sample, the devices read
		require.NoError(t, err)
		wall, cpu := timed(t, 5, func() {
			_, err := b.TelemetryWith(ctx, p.opts)
			require.NoError(t, err)
		})
		fmt.Fprintf(&out, "%-52s %12v %12v\n", p.name, wall, cpu)
	}
	t.Log("\n" + out.String())
	if dir := os.Getenv("GPUDRA_REAL_GPU_OUT"); dir != "" {
		require.NoError(t, os.WriteFile(filepath.Join(dir, "call-costs.txt"), []byte(out.String()), 0o644))
	}
}

// passFields are the field values a pass asks (fields.go), the slow ones
// too when slow.
func passFields(slow bool) []nvml.FieldValue {
	var out []nvml.FieldValue
	for _, f := range gpuFields {
		if slow || !f.slow {
			out = append(out, nvml.FieldValue{FieldId: f.id})
		}
	}
	return out
}
