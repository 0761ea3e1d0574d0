//go:build cgo && linux

package nvml

import (
	"context"
	"fmt"
	"slices"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/go-logr/logr"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

var _ nvdevice.TelemetryReader = (*Backend)(nil)

// symClocksEventReasons is the newer name of the throttle reasons call
// (R535); older drivers have only nvmlDeviceGetCurrentClocksThrottleReasons.
const symClocksEventReasons = "nvmlDeviceGetCurrentClocksEventReasons"

// Telemetry reads the inventory (which GPUs and MIG devices exist, and their
// names' parts), then every reading of each. A reading NVML refuses (not
// supported, no permission, a GPU that fails one call) is left unsupported
// and logged at V(4): one field never fails the scrape. GPM figures and
// per-process SM utilization are over the time since the previous call
// (the sampler's previous pass): the first call has no GPM figures.
func (b *Backend) Telemetry(ctx context.Context) ([]nvdevice.TelemetrySample, error) {
	var out []nvdevice.TelemetrySample
	err := b.locked(func() error {
		inv, err := b.readInventory(ctx)
		if err != nil {
			return fmt.Errorf("read the devices to sample: %w", err)
		}
		logger := klog.FromContext(ctx)
		for i := range inv.GPUs {
			g := &inv.GPUs[i]
			dev, ret := b.lib.DeviceGetHandleByUUID(g.UUID)
			if err := check(ret, "get handle of GPU %s", g.UUID); err != nil {
				logger.V(4).Info("GPU left out of telemetry", "gpu", g.UUID, "err", err)
				continue
			}
			b.pass.seen[g.UUID] = true
			glog := logger.WithValues("gpu", g.UUID)
			s := nvdevice.TelemetrySample{UUID: g.UUID, Minor: g.Minor, ProductName: g.ProductName}
			b.readGPUTelemetry(glog, dev, &s)
			gpm := b.gpmSupported(glog, g.UUID, dev)
			if gpm {
				metrics := gpmActivity
				if hasActiveNVLink(g) {
					// A GPU without links has no NVLink figure, not 0 B/s.
					metrics = append(slices.Clip(metrics), gpmNVLink...)
				}
				b.readGPM(glog, g.UUID, dev.GpmSampleGet, metrics, &s)
			}
			if g.MIG.Enabled {
				// NVML lists a MIG-mode GPU's processes per MIG device:
				// none are the whole GPU's.
				s.ProcessesRead = true
			} else {
				b.readProcesses(glog, g.UUID, dev, true, &s)
			}
			out = append(out, s)
			if len(g.MIG.Devices) == 0 {
				continue
			}
			handles := migHandles(glog, dev)
			for _, m := range g.MIG.Devices {
				if m.UUID == "" {
					continue // a GPU instance without a spanning compute instance is no device
				}
				b.pass.seen[m.UUID] = true
				mlog := logger.WithValues("gpu", g.UUID, "mig", m.UUID)
				ms := nvdevice.TelemetrySample{
					UUID: m.UUID, ParentUUID: g.UUID, Minor: g.Minor, ProductName: g.ProductName,
					MigProfile: m.Profile, MigStart: m.Placement.Start,
				}
				if h, ok := handles[m.UUID]; ok {
					readMemory(mlog, h, &ms)
					b.readProcesses(mlog, m.UUID, h, false, &ms)
				}
				if gpm {
					gi := m.GPUInstanceID
					get := func(s nvml.GpmSample) nvml.Return { return dev.GpmMigSampleGet(gi, s) }
					b.readGPM(mlog, m.UUID, get, gpmActivity, &ms)
				}
				out = append(out, ms)
			}
		}
		b.endPass()
		return nil
	})
	return out, err
}

// field logs a refused reading and says whether the call succeeded.
func field(logger logr.Logger, ret nvml.Return, what string) bool {
	if ret == nvml.SUCCESS {
		return true
	}
	logger.V(4).Info("Telemetry reading unsupported", "field", what, "err", ret.Error())
	return false
}

func (b *Backend) readGPUTelemetry(logger logr.Logger, dev nvml.Device, s *nvdevice.TelemetrySample) {
	if u, ret := dev.GetUtilizationRates(); field(logger, ret, "utilization") {
		s.GPUUtilization = nvdevice.Read(float64(u.Gpu) / 100)
		s.MemoryUtilization = nvdevice.Read(float64(u.Memory) / 100)
	}
	readMemory(logger, dev, s)
	if mw, ret := dev.GetPowerUsage(); field(logger, ret, "power usage") {
		s.PowerWatts = nvdevice.Read(float64(mw) / 1000)
	}
	if mw, ret := dev.GetEnforcedPowerLimit(); field(logger, ret, "power limit") {
		s.PowerLimitWatts = nvdevice.Read(float64(mw) / 1000)
	}
	if c, ret := dev.GetTemperature(nvml.TEMPERATURE_GPU); field(logger, ret, "temperature") {
		s.TemperatureCelsius = nvdevice.Read(float64(c))
	}
	if mhz, ret := dev.GetClockInfo(nvml.CLOCK_SM); field(logger, ret, "SM clock") {
		s.SMClockHertz = nvdevice.Read(float64(mhz) * 1e6)
	}
	var reasons uint64
	var ret nvml.Return
	if b.hasSymbol(symClocksEventReasons) {
		reasons, ret = dev.GetCurrentClocksEventReasons()
	} else {
		reasons, ret = dev.GetCurrentClocksThrottleReasons()
	}
	if field(logger, ret, "clock event reasons") {
		s.ClockEventReasons = nvdevice.Read(float64(reasons))
	}
	ecc := []struct {
		to      *nvdevice.Reading
		typ     nvml.MemoryErrorType
		counter nvml.EccCounterType
		what    string
	}{
		{&s.ECCVolatileCorrected, nvml.MEMORY_ERROR_TYPE_CORRECTED, nvml.VOLATILE_ECC, "ECC volatile corrected"},
		{&s.ECCVolatileUncorrected, nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.VOLATILE_ECC, "ECC volatile uncorrected"},
		{&s.ECCAggregateCorrected, nvml.MEMORY_ERROR_TYPE_CORRECTED, nvml.AGGREGATE_ECC, "ECC aggregate corrected"},
		{&s.ECCAggregateUncorrected, nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.AGGREGATE_ECC, "ECC aggregate uncorrected"},
	}
	for _, e := range ecc {
		if n, ret := dev.GetTotalEccErrors(e.typ, e.counter); field(logger, ret, e.what) {
			*e.to = nvdevice.Read(float64(n))
		}
	}
	if corr, unc, pending, failed, ret := dev.GetRemappedRows(); field(logger, ret, "remapped rows") {
		s.RemappedRowsCorrectable = nvdevice.Read(float64(corr))
		s.RemappedRowsUncorrectable = nvdevice.Read(float64(unc))
		s.RemapPending = nvdevice.Read(boolValue(pending))
		s.RemapFailure = nvdevice.Read(boolValue(failed))
	}
	// NVML gives KB/s (1024 bytes).
	if kb, ret := dev.GetPcieThroughput(nvml.PCIE_UTIL_TX_BYTES); field(logger, ret, "PCIe TX throughput") {
		s.PCIeTXBytesPerSecond = nvdevice.Read(float64(kb) * 1024)
	}
	if kb, ret := dev.GetPcieThroughput(nvml.PCIE_UTIL_RX_BYTES); field(logger, ret, "PCIe RX throughput") {
		s.PCIeRXBytesPerSecond = nvdevice.Read(float64(kb) * 1024)
	}
}

// readMemory reads the framebuffer of a GPU or a MIG device (a MIG device
// handle gives its own memory).
func readMemory(logger logr.Logger, dev nvml.Device, s *nvdevice.TelemetrySample) {
	if m, ret := dev.GetMemoryInfo(); field(logger, ret, "memory") {
		s.FramebufferUsedBytes = nvdevice.Read(float64(m.Used))
		s.FramebufferFreeBytes = nvdevice.Read(float64(m.Free))
		s.FramebufferTotalBytes = nvdevice.Read(float64(m.Total))
	}
}

// migHandles are the GPU's MIG device handles by UUID; a handle that cannot
// be read is left out (its sample then has no readings).
func migHandles(logger logr.Logger, dev nvml.Device) map[string]nvml.Device {
	out := map[string]nvml.Device{}
	count, ret := dev.GetMaxMigDeviceCount()
	if !field(logger, ret, "MIG device count") {
		return out
	}
	for i := range count {
		h, ret := dev.GetMigDeviceHandleByIndex(i)
		if ret != nvml.SUCCESS {
			continue // no MIG device at this index
		}
		if uuid, ret := h.GetUUID(); field(logger, ret, "MIG device UUID") {
			out[uuid] = h
		}
	}
	return out
}

func boolValue(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// hasActiveNVLink says whether the GPU has an NVLink link up.
func hasActiveNVLink(g *nvdevice.GPU) bool {
	for _, l := range g.NVLink.Links {
		if l.Active {
			return true
		}
	}
	return false
}
