package sim

import (
	"context"
	"fmt"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

var _ nvdevice.TelemetryReader = (*Machine)(nil)

// powerModel is what a product draws and allows: the board power limit
// (H100 SXM5 and H200 SXM: 700 W; H100 PCIe: 350 W), its draw idle, and
// its SM clock idle and at its maximum boost.
type powerModel struct {
	limitW, idleW            float64
	idleSMMHz, maxSMMHz      float64
	idleCelsius, maxCelsius  float64
	pcieBytesPerSecondAtFull float64
}

var powerModels = map[string]powerModel{
	ModelH100SXM5: {limitW: 700, idleW: 72, idleSMMHz: 345, maxSMMHz: 1980, idleCelsius: 31, maxCelsius: 74, pcieBytesPerSecondAtFull: 25e9},
	ModelH100PCIe: {limitW: 350, idleW: 48, idleSMMHz: 345, maxSMMHz: 1755, idleCelsius: 33, maxCelsius: 78, pcieBytesPerSecondAtFull: 25e9},
	ModelH200SXM:  {limitW: 700, idleW: 76, idleSMMHz: 345, maxSMMHz: 1980, idleCelsius: 30, maxCelsius: 72, pcieBytesPerSecondAtFull: 25e9},
	// L40S: its 350 W board power and 2520 MHz boost clock are NVIDIA's
	// datasheet figures; idle power, idle clock and temperatures are
	// plausible, not measured. PCIe Gen4 x16.
	ModelL40S: {limitW: 350, idleW: 36, idleSMMHz: 210, maxSMMHz: 2520, idleCelsius: 30, maxCelsius: 80, pcieBytesPerSecondAtFull: 25e9},
}

// baseUsedMiB is what the driver keeps of an idle device's framebuffer.
const baseUsedMiB = 518

// clock event reasons the simulator reports: an idle GPU is
// gpu_idle, a busy one at its power limit sw_power_cap.
const (
	reasonGPUIdle    = 0x1
	reasonSwPowerCap = 0x4
)

// SetLoad sets how busy a GPU or MIG device is, 0 (idle, the default) to 1,
// for Telemetry: utilization, framebuffer used, power, clock, temperature,
// GPM, NVLink and PCIe traffic follow it, with the device's processes
// (StartProcess). A MIG device's load adds to its parent's framebuffer
// used and power.
func (m *Machine) SetLoad(uuid string, load float64) error {
	if load < 0 || load > 1 {
		return fmt.Errorf("load %v of %s: want 0 to 1", load, uuid)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, g := range m.inv.GPUs {
		if g.UUID == uuid {
			m.setLoadLocked(uuid, load)
			return nil
		}
		for _, d := range g.MIG.Devices {
			if d.UUID == uuid {
				m.setLoadLocked(uuid, load)
				return nil
			}
		}
	}
	return fmt.Errorf("device %s: %w", uuid, nvdevice.ErrNotFound)
}

func (m *Machine) setLoadLocked(uuid string, load float64) {
	if m.load == nil {
		m.load = map[string]float64{}
	}
	m.load[uuid] = load
}

// Telemetry gives deterministic, plausible readings of every GPU and MIG
// device the inventory lists, from their loads (SetLoad) and processes
// (StartProcess). As on a real H100 through NVML: a MIG device has its
// framebuffer, its processes (without per-process SM utilization) and its
// GPU instance's GPM figures, nothing else; a GPU in MIG mode has no
// utilization, GPM figures or processes of its own, and its framebuffer
// used counts its MIG devices'.
//
// It locks as the NVML backend does: the machine's lock is held for one
// GPU at a time, never across the GPU's readings (SetTelemetryHook stands
// for them), so that a slow or hung reading holds up no MIG change or
// inventory read.
func (m *Machine) Telemetry(ctx context.Context) ([]nvdevice.TelemetrySample, error) {
	return m.TelemetryWith(ctx, nvdevice.TelemetryOptions{})
}

var _ nvdevice.CadencedTelemetryReader = (*Machine)(nil)

// TelemetryWith is Telemetry, without the slow readings on a fast pass
// (opts.SkipSlow). With the NVML timing model on (SetNVMLTiming), it
// charges the NVML calls the backend makes for the same pass.
func (m *Machine) TelemetryWith(ctx context.Context, opts nvdevice.TelemetryOptions) ([]nvdevice.TelemetrySample, error) {
	m.readProcessFeed()
	inv, err := m.Inventory(ctx)
	if err != nil {
		return nil, fmt.Errorf("read the devices to sample: %w", err)
	}
	model, perCall, full := m.modelOn()
	entries := keptEntries
	if model {
		entries = m.devicesReadAgain(inv, opts, full)
		m.charge(nvmlCalls{"nvmlDeviceGetCount": 1})
	}
	var out []nvdevice.TelemetrySample
	seen := map[string]bool{}
	for i := range inv.GPUs {
		listed := &inv.GPUs[i]
		switch entries {
		case fullEntries:
			calls := nvmlCalls{}
			entryCalls(calls, listed)
			m.charge(calls)
		case checkedEntries:
			calls := nvmlCalls{}
			checkedEntryCalls(calls, listed)
			m.charge(calls)
		}
		m.readingsOf(listed.UUID)
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		s, ok := m.sampleGPU(listed.UUID)
		if !ok {
			return nil, fmt.Errorf("read the devices to sample: simulated machine %q is closed", m.spec.Name)
		}
		if len(s) > 0 {
			m.pcieRateOf(&s[0], seen)
		}
		if opts.SkipSlow && len(s) > 0 {
			nvdevice.CopySlowReadings(&s[0], &nvdevice.TelemetrySample{})
		}
		if model {
			calls := nvmlCalls{}
			readingCalls(calls, listed, s, !gpuModels[m.spec.modelOf(listed.Index)].noGPM, perCall, full || entries != keptEntries, opts)
			m.charge(calls)
		}
		out = append(out, s...)
	}
	m.mu.Lock()
	m.pcieSeen = seen
	m.mu.Unlock()
	return out, nil
}

// pcieRateOf leaves the GPU's PCIe figure out on the first pass that sees
// it (the previous pass did not: a new GPU, or one back), as the NVML
// backend does: it gives the rate between two passes' byte counters. It
// adds the GPU to seen, this pass's GPUs.
func (m *Machine) pcieRateOf(s *nvdevice.TelemetrySample, seen map[string]bool) {
	seen[s.UUID] = true
	m.mu.Lock()
	before := m.pcieSeen[s.UUID]
	m.mu.Unlock()
	if !before {
		s.PCIeTXBytesPerSecond, s.PCIeRXBytesPerSecond = nvdevice.Reading{}, nvdevice.Reading{}
	}
}

// sampleGPU is the samples of the GPU and its MIG devices as they are now
// (a MIG device made or destroyed since the GPU was listed counts), none
// for a GPU that fell off the bus since; false once the machine is closed.
func (m *Machine) sampleGPU(uuid string) ([]nvdevice.TelemetrySample, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil, false
	}
	for i := range m.inv.GPUs {
		g := &m.inv.GPUs[i]
		if g.UUID != uuid || m.lost[uuid] {
			continue
		}
		s, migs := m.gpuTelemetry(powerModels[m.spec.modelOf(g.Index)], g)
		return append([]nvdevice.TelemetrySample{s}, migs...), true
	}
	return nil, true
}

// gpuTelemetry is a GPU's sample and its MIG devices'. The caller holds
// m.mu.
func (m *Machine) gpuTelemetry(pm powerModel, g *nvdevice.GPU) (nvdevice.TelemetrySample, []nvdevice.TelemetrySample) {
	load := m.load[g.UUID]
	totalBytes := float64(g.MemoryMiB) * (1 << 20)
	usedBytes := (float64(baseUsedMiB) + load*0.9*float64(g.MemoryMiB-baseUsedMiB)) * (1 << 20)
	s := nvdevice.TelemetrySample{UUID: g.UUID, Minor: g.Minor, ProductName: g.ProductName, ProcessesRead: true}
	// busy drives power, clocks, temperature and PCIe: the GPU's own
	// utilization, or in MIG mode its instances' weighted by their SMs.
	var busy float64
	var migs []nvdevice.TelemetrySample
	if g.MIG.Enabled {
		busy = load
		for _, d := range g.MIG.Devices {
			if d.UUID == "" {
				continue
			}
			ms, smShare := m.migTelemetry(g, &d)
			usedBytes += ms.FramebufferUsedBytes.Value
			busy += ms.SMActive.Value * smShare
			migs = append(migs, ms)
		}
		busy = min(1, busy)
	} else {
		use := m.useOf(g.UUID, true)
		busy = use.busy
		usedBytes += use.processBytes
		s.Processes = use.processes
		s.GPUUtilization = nvdevice.Read(busy)
		s.MemoryUtilization = nvdevice.Read(busy / 2)
		if !gpuModels[m.spec.modelOf(g.Index)].noGPM {
			gpmFigures(busy, &s)
		}
		if links := activeLinks(g); links > 0 {
			s.NVLinkTXBytesPerSecond = nvdevice.Read(busy * nvlinkShareTX * float64(links) * nvlinkBytesPerSecondPerLink)
			s.NVLinkRXBytesPerSecond = nvdevice.Read(busy * nvlinkShareRX * float64(links) * nvlinkBytesPerSecondPerLink)
		}
	}
	usedBytes = min(usedBytes, totalBytes)
	reasons := float64(reasonGPUIdle)
	if busy > 0 {
		reasons = 0
	}
	if busy >= 0.95 {
		reasons = reasonSwPowerCap
	}
	smMHz := pm.idleSMMHz
	if busy > 0 {
		smMHz = pm.maxSMMHz
	}
	ecc := m.usage.ecc[g.UUID]
	s.FramebufferUsedBytes = nvdevice.Read(usedBytes)
	s.FramebufferFreeBytes = nvdevice.Read(totalBytes - usedBytes)
	s.FramebufferTotalBytes = nvdevice.Read(totalBytes)
	s.PowerWatts = nvdevice.Read(pm.idleW + busy*0.95*(pm.limitW-pm.idleW))
	s.PowerLimitWatts = nvdevice.Read(pm.limitW)
	s.TemperatureCelsius = nvdevice.Read(pm.idleCelsius + busy*(pm.maxCelsius-pm.idleCelsius))
	s.SMClockHertz = nvdevice.Read(smMHz * 1e6)
	s.ClockEventReasons = nvdevice.Read(reasons)
	s.ECCVolatileCorrected = nvdevice.Read(float64(ecc.corrected))
	s.ECCVolatileUncorrected = nvdevice.Read(float64(ecc.uncorrected))
	s.ECCAggregateCorrected = nvdevice.Read(float64(ecc.corrected))
	s.ECCAggregateUncorrected = nvdevice.Read(float64(ecc.uncorrected))
	s.RemappedRowsCorrectable, s.RemappedRowsUncorrectable = nvdevice.Read(0), nvdevice.Read(0)
	s.RemapPending, s.RemapFailure = nvdevice.Read(0), nvdevice.Read(0)
	s.PCIeTXBytesPerSecond = nvdevice.Read(busy * 0.1 * pm.pcieBytesPerSecondAtFull)
	s.PCIeRXBytesPerSecond = nvdevice.Read(busy * 0.2 * pm.pcieBytesPerSecondAtFull)
	return s, migs
}

// migTelemetry is a MIG device's sample, and the share of its GPU's SMs it
// has. The caller holds m.mu.
func (m *Machine) migTelemetry(g *nvdevice.GPU, d *nvdevice.MigDevice) (nvdevice.TelemetrySample, float64) {
	use := m.useOf(d.UUID, false) // NVML samples no per-process SM on MIG devices
	total := float64(d.MemoryMiB) * (1 << 20)
	used := min(total, m.load[d.UUID]*0.9*total+use.processBytes)
	s := nvdevice.TelemetrySample{
		UUID: d.UUID, ParentUUID: g.UUID, Minor: g.Minor, ProductName: g.ProductName,
		MigProfile: d.Profile, MigStart: d.Placement.Start,
		FramebufferTotalBytes: nvdevice.Read(total),
		FramebufferUsedBytes:  nvdevice.Read(used),
		FramebufferFreeBytes:  nvdevice.Read(total - used),
		ProcessesRead:         true,
		Processes:             use.processes,
	}
	gpmFigures(use.busy, &s)
	smShare := 0.0
	if g.Engines.Multiprocessors > 0 {
		smShare = float64(d.Engines.Multiprocessors) / float64(g.Engines.Multiprocessors)
	}
	return s, smShare
}

// GPM figures of a device this busy (0..1): SMs active as long as the
// device is busy; warps resident, tensor pipes and the memory interface at
// fractions of that, as a mixed training or inference load shows them
// (plausible, not a measured kernel). Each is monotone in the load.
const (
	occupancyPerBusy = 0.6
	tensorPerBusy    = 0.4
	dramPerBusy      = 0.5
	// NVLink 4 carries about 25 GB/s per link per direction (450 GB/s
	// over an H100 SXM5's 18 links, ../shared/facts/h100.md); a busy
	// GPU uses a fifth of it each way (collectives between steps).
	nvlinkBytesPerSecondPerLink = 25e9
	nvlinkShareTX               = 0.2
	nvlinkShareRX               = 0.2
)

func gpmFigures(busy float64, s *nvdevice.TelemetrySample) {
	s.SMActive = nvdevice.Read(busy)
	s.SMOccupancy = nvdevice.Read(occupancyPerBusy * busy)
	s.TensorActive = nvdevice.Read(tensorPerBusy * busy)
	s.DRAMActive = nvdevice.Read(dramPerBusy * busy)
}

// activeLinks counts the GPU's NVLink links that are up (none on an H100
// PCIe without a bridge).
func activeLinks(g *nvdevice.GPU) int {
	n := 0
	for _, l := range g.NVLink.Links {
		if l.Active {
			n++
		}
	}
	return n
}
