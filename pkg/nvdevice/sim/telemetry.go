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
// for Telemetry: utilization, framebuffer used, power, clock, temperature
// and PCIe traffic follow it. A MIG device's load adds to its parent's
// framebuffer used and utilization.
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
// device the inventory lists, from their loads (SetLoad). As on a real
// H100 through plain NVML, a MIG device has framebuffer readings only.
func (m *Machine) Telemetry(ctx context.Context) ([]nvdevice.TelemetrySample, error) {
	inv, err := m.Inventory(ctx)
	if err != nil {
		return nil, fmt.Errorf("read the devices to sample: %w", err)
	}
	pm := powerModels[m.spec.model()]
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []nvdevice.TelemetrySample
	for _, g := range inv.GPUs {
		load := m.load[g.UUID]
		totalBytes := float64(g.MemoryMiB) * (1 << 20)
		usedMiB := float64(baseUsedMiB) + load*0.9*float64(g.MemoryMiB-baseUsedMiB)
		var migs []nvdevice.TelemetrySample
		for _, d := range g.MIG.Devices {
			if d.UUID == "" {
				continue
			}
			ml := m.load[d.UUID]
			mTotal := float64(d.MemoryMiB)
			mUsed := ml * 0.9 * mTotal
			usedMiB += mUsed
			if ml > load {
				load = ml // the busiest MIG device sets the GPU's activity
			}
			migs = append(migs, nvdevice.TelemetrySample{
				UUID: d.UUID, ParentUUID: g.UUID, Minor: g.Minor, ProductName: g.ProductName,
				MigProfile: d.Profile, MigStart: d.Placement.Start,
				FramebufferTotalBytes: nvdevice.Read(mTotal * (1 << 20)),
				FramebufferUsedBytes:  nvdevice.Read(mUsed * (1 << 20)),
				FramebufferFreeBytes:  nvdevice.Read((mTotal - mUsed) * (1 << 20)),
			})
		}
		usedBytes := min(usedMiB*(1<<20), totalBytes)
		reasons := float64(reasonGPUIdle)
		if load > 0 {
			reasons = 0
		}
		if load >= 0.95 {
			reasons = reasonSwPowerCap
		}
		smMHz := pm.idleSMMHz
		if load > 0 {
			smMHz = pm.maxSMMHz
		}
		out = append(out, nvdevice.TelemetrySample{
			UUID: g.UUID, Minor: g.Minor, ProductName: g.ProductName,
			GPUUtilization:        nvdevice.Read(load),
			MemoryUtilization:     nvdevice.Read(load / 2),
			FramebufferUsedBytes:  nvdevice.Read(usedBytes),
			FramebufferFreeBytes:  nvdevice.Read(totalBytes - usedBytes),
			FramebufferTotalBytes: nvdevice.Read(totalBytes),
			PowerWatts:            nvdevice.Read(pm.idleW + load*0.95*(pm.limitW-pm.idleW)),
			PowerLimitWatts:       nvdevice.Read(pm.limitW),
			TemperatureCelsius:    nvdevice.Read(pm.idleCelsius + load*(pm.maxCelsius-pm.idleCelsius)),
			SMClockHertz:          nvdevice.Read(smMHz * 1e6),
			ClockEventReasons:     nvdevice.Read(reasons),
			ECCVolatileCorrected:  nvdevice.Read(0), ECCVolatileUncorrected: nvdevice.Read(0),
			ECCAggregateCorrected: nvdevice.Read(0), ECCAggregateUncorrected: nvdevice.Read(0),
			RemappedRowsCorrectable: nvdevice.Read(0), RemappedRowsUncorrectable: nvdevice.Read(0),
			RemapPending: nvdevice.Read(0), RemapFailure: nvdevice.Read(0),
			PCIeTXBytesPerSecond: nvdevice.Read(load * 0.1 * pm.pcieBytesPerSecondAtFull),
			PCIeRXBytesPerSecond: nvdevice.Read(load * 0.2 * pm.pcieBytesPerSecondAtFull),
		})
		out = append(out, migs...)
	}
	return out, nil
}
