//go:build cgo && linux

package nvml

import (
	"context"
	"errors"
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

// symFieldValues reads several readings in one call (R418 and later).
const symFieldValues = "nvmlDeviceGetFieldValues"

// Telemetry reads each GPU's inventory entry (which GPU it is, its MIG
// devices and their names' parts), then every reading of it and of its MIG
// devices. A reading NVML refuses (not supported, no permission, a GPU that
// fails one call) is left unsupported and logged at V(4): one field never
// fails the scrape. GPM figures and per-process SM utilization are over the
// time since the previous call (the sampler's previous pass): the first
// call has no GPM figures.
//
// The backend's lock is held for one GPU's inventory entry at a time, and
// never across readings: a prepare (a MIG change, an inventory read) waits
// for at most one GPU's entry, however slow the pass, and a reading that
// hangs in the driver holds up no prepare. A MIG device destroyed between
// its entry and its readings has its readings left unsupported.
func (b *Backend) Telemetry(ctx context.Context) ([]nvdevice.TelemetrySample, error) {
	return b.TelemetryWith(ctx, nvdevice.TelemetryOptions{})
}

var _ nvdevice.CadencedTelemetryReader = (*Backend)(nil)

// TelemetryWith is Telemetry, without the slow readings when
// opts.SkipSlow. With opts.KeepDevices it reads no inventory entry: it
// uses the entries (GPU and MIG device handles) of the last pass that read
// them, unless the GPU count changed, a MIG change went through the
// backend since, or a GPU was lost. The entries are most of a full pass's
// NVML calls (72 of an H200's 86: MIG profiles and placements, 36 NVLink
// states), so without opts.KeepDevices a pass checks each kept entry with
// a few calls (sameEntry) and reads in full only those that changed, and
// the first pass and one after such a change read them all in full. A MIG
// device made or destroyed by another tool (nvidia-smi) is seen at the
// next pass without opts.KeepDevices.
func (b *Backend) TelemetryWith(ctx context.Context, opts nvdevice.TelemetryOptions) ([]nvdevice.TelemetrySample, error) {
	b.passMu.Lock()
	defer b.passMu.Unlock()
	var count int
	var changes uint64
	err := b.locked(func() error {
		var ret nvml.Return
		count, ret = b.lib.DeviceGetCount()
		changes = b.migChanges
		return check(ret, "count GPUs")
	})
	if err != nil {
		return nil, fmt.Errorf("read the devices to sample: %w", err)
	}
	kept := b.pass.entries
	if len(kept) != count || b.pass.entriesAt != changes {
		kept = nil // the devices changed: each entry is read in full
	}
	reuse := opts.KeepDevices && kept != nil
	entries := kept
	if !reuse {
		entries = make([]*gpuEntry, count)
		// A reading refused until now is asked again of the devices
		// as they are read now.
		clear(b.pass.refused)
	}
	b.pass.entries = nil // kept again once the pass has worked
	lost := false
	var out []nvdevice.TelemetrySample
	for i := range count {
		if err := ctx.Err(); err != nil {
			clear(b.pass.seen)
			return nil, err
		}
		if !reuse {
			var last *gpuEntry
			if kept != nil {
				last = kept[i]
			}
			err := b.locked(func() error {
				var err error
				entries[i], err = b.gpuToSample(ctx, i, last)
				return err
			})
			if err != nil {
				clear(b.pass.seen) // the next pass starts over
				return nil, fmt.Errorf("read the devices to sample: %w", err)
			}
		}
		if g := entries[i]; g != nil {
			samples, ok := b.sampleGPU(ctx, g, opts)
			lost = lost || !ok
			out = append(out, samples...)
		}
	}
	if !lost {
		b.pass.entries, b.pass.entriesAt = entries, changes
	}
	b.endPass()
	return out, nil
}

// gpuEntry is what a pass needs of a GPU's inventory entry, and its
// handles: the GPU's, and its MIG devices' by UUID.
type gpuEntry struct {
	nvdevice.GPU
	dev  nvml.Device
	migs map[string]nvml.Device
	// nvlinkUp says whether one of its NVLink links was up when the entry
	// was read: only then does a pass ask GPM for NVLink figures.
	nvlinkUp bool
}

// gpuToSample reads the inventory entry of the GPU at index i as Inventory
// does, and its MIG device handles; nil for a GPU that is lost (logged) or
// not a compute GPU. With last, the entry the previous read found at i, it
// first checks that entry (sameEntry) and reads in full only a GPU that
// changed. The caller holds b.mu.
func (b *Backend) gpuToSample(ctx context.Context, i int, last *gpuEntry) (*gpuEntry, error) {
	dev, ret := b.lib.DeviceGetHandleByIndex(i)
	err := check(ret, "get handle of GPU %d", i)
	if err == nil && last != nil {
		if e, same := sameEntry(klog.FromContext(ctx).WithValues("gpu", last.UUID), dev, last); same {
			return e, nil
		}
	}
	var g nvdevice.GPU
	if err == nil {
		g, _, err = b.readGPU(ctx, i, dev)
	}
	if errors.Is(err, nvdevice.ErrGPULost) {
		klog.FromContext(ctx).V(4).Info("GPU left out of telemetry", "index", i, "err", err)
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if skippedProducts[g.ProductName] {
		return nil, nil
	}
	e := &gpuEntry{GPU: g, dev: dev, nvlinkUp: hasActiveNVLink(&g)}
	if len(g.MIG.Devices) > 0 {
		e.migs = migHandles(klog.FromContext(ctx).WithValues("gpu", g.UUID), dev)
	}
	return e, nil
}

// sameEntry checks the entry last (a full read of the GPU) against the GPU
// behind dev with the few calls that say whether it changed: its UUID, its
// MIG mode, its MIG devices' UUIDs (with their handles, which the pass
// needs anyway). A GPU's name, minor number, profiles and links, and a MIG
// device's profile, placement and instance ids, do not change while its
// UUID stays: a MIG device made again has a new UUID. Of the links, a
// pass needs only whether one is up: their states are asked until one is.
// This is what reading the devices costs, every ten minutes, instead of
// the full entry (dozens of calls a GPU: 36 NVLink states, the remote end
// of each active link, MIG profiles and placements, every compute
// instance). False: the entry is read in full.
func sameEntry(logger logr.Logger, dev nvml.Device, last *gpuEntry) (*gpuEntry, bool) {
	if uuid, ret := dev.GetUUID(); ret != nvml.SUCCESS || uuid != last.UUID {
		return nil, false
	}
	if last.MIG.Capable {
		mode, _, ret := dev.GetMigMode()
		if ret != nvml.SUCCESS || (mode == nvml.DEVICE_MIG_ENABLE) != last.MIG.Enabled {
			return nil, false
		}
	}
	e := &gpuEntry{GPU: last.GPU, dev: dev}
	if last.MIG.Enabled {
		e.migs = migHandles(logger, dev)
		n := 0
		for _, m := range last.MIG.Devices {
			if m.UUID == "" {
				continue
			}
			if _, ok := e.migs[m.UUID]; !ok {
				return nil, false
			}
			n++
		}
		if n != len(e.migs) {
			return nil, false // a MIG device the entry does not list
		}
	}
	for _, l := range last.NVLink.Links {
		if state, ret := dev.GetNvLinkState(l.Index); ret == nvml.SUCCESS && state == nvml.FEATURE_ENABLED {
			e.nvlinkUp = true
			break
		}
	}
	return e, true
}

// sampleGPU takes every reading of the GPU and of its MIG devices (the
// slow ones only on a full pass); false, and no sample, for a GPU lost
// since its entry was read. The caller holds b.passMu, not b.mu.
func (b *Backend) sampleGPU(ctx context.Context, g *gpuEntry, opts nvdevice.TelemetryOptions) ([]nvdevice.TelemetrySample, bool) {
	logger := klog.FromContext(ctx)
	dev := g.dev
	glog := logger.WithValues("gpu", g.UUID)
	s := nvdevice.TelemetrySample{UUID: g.UUID, Minor: g.Minor, ProductName: g.ProductName}
	if !b.readGPUTelemetry(glog, dev, !opts.SkipSlow, &s) {
		glog.V(4).Info("GPU left out of telemetry: lost since its entry was read")
		return nil, false
	}
	b.pass.seen[g.UUID] = true
	gpm := b.gpmSupported(glog, g.UUID, dev)
	if gpm {
		metrics := gpmActivity
		if g.nvlinkUp {
			// A GPU without links has no NVLink figure, not 0 B/s.
			metrics = append(slices.Clip(metrics), gpmNVLink...)
		}
		b.readGPM(glog, g.UUID, dev.GpmSampleGet, metrics, &s)
	}
	var migProcs map[instanceKey][]nvdevice.ProcessSample
	fromParent := false
	if g.MIG.Enabled {
		// A MIG-mode GPU has no process of its own: they are its MIG
		// devices', all listed on its handle in one call when NVML gives
		// their instance ids, else asked of each MIG device.
		s.ProcessesRead = true
		migProcs, fromParent = readMigProcesses(glog, dev, opts.MPSAny(g.MIG.Devices))
	} else {
		b.readProcesses(glog, g.UUID, dev, true, opts.MPS(g.UUID), &s)
	}
	out := []nvdevice.TelemetrySample{s}
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
		h, ok := g.migs[m.UUID]
		if ok {
			readMemory(mlog, h, &ms)
		}
		switch {
		case fromParent:
			ms.Processes = migProcs[instanceKey{uint32(m.GPUInstanceID), uint32(m.ComputeInstanceID)}]
			ms.ProcessesRead = true
		case ok:
			b.readProcesses(mlog, m.UUID, h, false, opts.MPS(m.UUID), &ms)
		}
		if gpm {
			gi := m.GPUInstanceID
			get := func(s nvml.GpmSample) nvml.Return { return dev.GpmMigSampleGet(gi, s) }
			b.readGPM(mlog, m.UUID, get, gpmActivity, &ms)
		}
		out = append(out, ms)
	}
	return out, true
}

// field logs a refused reading and says whether the call succeeded.
func field(logger logr.Logger, ret nvml.Return, what string) bool {
	if ret == nvml.SUCCESS {
		return true
	}
	logger.V(4).Info("Telemetry reading unsupported", "field", what, "err", ret.Error())
	return false
}

// readGPUTelemetry takes the GPU's own readings, the slow ones too when
// slow; false when the GPU is lost (its first reading says so). The
// readings NVML gives as field values come from one call (fields.go);
// each one it refuses is read by its own call.
func (b *Backend) readGPUTelemetry(logger logr.Logger, dev nvml.Device, slow bool, s *nvdevice.TelemetrySample) bool {
	uuid := s.UUID
	if b.asks(uuid, "utilization") {
		u, ret := dev.GetUtilizationRates()
		if ret == nvml.ERROR_GPU_IS_LOST {
			return false
		}
		if b.answered(logger, uuid, ret, "utilization") {
			s.GPUUtilization = nvdevice.Read(float64(u.Gpu) / 100)
			s.MemoryUtilization = nvdevice.Read(float64(u.Memory) / 100)
		}
	}
	if b.asks(uuid, "memory") {
		// The first call of a MIG-mode GPU, whose utilization NVML
		// refuses: it says whether the GPU is lost.
		if readMemory(logger, dev, s) == nvml.ERROR_GPU_IS_LOST {
			return false
		}
	}
	got := b.readFields(logger, uuid, dev, slow, s)
	if !got[nvml.FI_DEV_POWER_AVERAGE] && b.asks(uuid, "power usage") {
		if mw, ret := dev.GetPowerUsage(); b.answered(logger, uuid, ret, "power usage") {
			s.PowerWatts = nvdevice.Read(float64(mw) / 1000)
		}
	}
	if b.asks(uuid, "temperature") {
		if c, ret := dev.GetTemperature(nvml.TEMPERATURE_GPU); b.answered(logger, uuid, ret, "temperature") {
			s.TemperatureCelsius = nvdevice.Read(float64(c))
		}
	}
	if b.asks(uuid, "SM clock") {
		if mhz, ret := dev.GetClockInfo(nvml.CLOCK_SM); b.answered(logger, uuid, ret, "SM clock") {
			s.SMClockHertz = nvdevice.Read(float64(mhz) * 1e6)
		}
	}
	if b.asks(uuid, "clock event reasons") {
		var reasons uint64
		var ret nvml.Return
		if b.hasSymbol(symClocksEventReasons) {
			reasons, ret = dev.GetCurrentClocksEventReasons()
		} else {
			reasons, ret = dev.GetCurrentClocksThrottleReasons()
		}
		if b.answered(logger, uuid, ret, "clock event reasons") {
			s.ClockEventReasons = nvdevice.Read(float64(reasons))
		}
	}
	if !got.all(nvml.FI_DEV_PCIE_COUNT_TX_BYTES, nvml.FI_DEV_PCIE_COUNT_RX_BYTES) {
		// No byte counters: NVML's throughput, sampled over 20 ms each
		// (KB/s, 1024 bytes).
		if kb, ret := dev.GetPcieThroughput(nvml.PCIE_UTIL_TX_BYTES); field(logger, ret, "PCIe TX throughput") {
			s.PCIeTXBytesPerSecond = nvdevice.Read(float64(kb) * 1024)
		}
		if kb, ret := dev.GetPcieThroughput(nvml.PCIE_UTIL_RX_BYTES); field(logger, ret, "PCIe RX throughput") {
			s.PCIeRXBytesPerSecond = nvdevice.Read(float64(kb) * 1024)
		}
	}
	if slow {
		readSlowTelemetry(logger, dev, got, s)
	}
	return true
}

// readSlowTelemetry takes the readings that change slowly
// (nvdevice.CopySlowReadings) that the field values did not give: a full
// pass only.
func readSlowTelemetry(logger logr.Logger, dev nvml.Device, got fieldsRead, s *nvdevice.TelemetrySample) {
	if !got[nvml.FI_DEV_POWER_CURRENT_LIMIT] {
		if mw, ret := dev.GetEnforcedPowerLimit(); field(logger, ret, "power limit") {
			s.PowerLimitWatts = nvdevice.Read(float64(mw) / 1000)
		}
	}
	ecc := []struct {
		id      uint32
		to      *nvdevice.Reading
		typ     nvml.MemoryErrorType
		counter nvml.EccCounterType
		what    string
	}{
		{nvml.FI_DEV_ECC_SBE_VOL_TOTAL, &s.ECCVolatileCorrected, nvml.MEMORY_ERROR_TYPE_CORRECTED, nvml.VOLATILE_ECC, "ECC volatile corrected"},
		{nvml.FI_DEV_ECC_DBE_VOL_TOTAL, &s.ECCVolatileUncorrected, nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.VOLATILE_ECC, "ECC volatile uncorrected"},
		{nvml.FI_DEV_ECC_SBE_AGG_TOTAL, &s.ECCAggregateCorrected, nvml.MEMORY_ERROR_TYPE_CORRECTED, nvml.AGGREGATE_ECC, "ECC aggregate corrected"},
		{nvml.FI_DEV_ECC_DBE_AGG_TOTAL, &s.ECCAggregateUncorrected, nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.AGGREGATE_ECC, "ECC aggregate uncorrected"},
	}
	for _, e := range ecc {
		if got[e.id] {
			continue
		}
		if n, ret := dev.GetTotalEccErrors(e.typ, e.counter); field(logger, ret, e.what) {
			*e.to = nvdevice.Read(float64(n))
		}
	}
	if got.all(nvml.FI_DEV_REMAPPED_COR, nvml.FI_DEV_REMAPPED_UNC, nvml.FI_DEV_REMAPPED_PENDING, nvml.FI_DEV_REMAPPED_FAILURE) {
		return
	}
	if corr, unc, pending, failed, ret := dev.GetRemappedRows(); field(logger, ret, "remapped rows") {
		s.RemappedRowsCorrectable = nvdevice.Read(float64(corr))
		s.RemappedRowsUncorrectable = nvdevice.Read(float64(unc))
		s.RemapPending = nvdevice.Read(boolValue(pending))
		s.RemapFailure = nvdevice.Read(boolValue(failed))
	}
}

// readMemory reads the framebuffer of a GPU or a MIG device (a MIG device
// handle gives its own memory), and says what NVML answered.
func readMemory(logger logr.Logger, dev nvml.Device, s *nvdevice.TelemetrySample) nvml.Return {
	m, ret := dev.GetMemoryInfo()
	if field(logger, ret, "memory") {
		s.FramebufferUsedBytes = nvdevice.Read(float64(m.Used))
		s.FramebufferFreeBytes = nvdevice.Read(float64(m.Free))
		s.FramebufferTotalBytes = nvdevice.Read(float64(m.Total))
	}
	return ret
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
