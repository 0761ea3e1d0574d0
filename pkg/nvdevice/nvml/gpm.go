//go:build cgo && linux

package nvml

import (
	"math"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/go-logr/logr"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// passState is what Telemetry keeps from one pass to the next, under b.passMu:
// GPM figures and per-process utilization are over the interval between
// two passes, so each pass needs what the previous one read.
type passState struct {
	// gpmSupport: GPU UUID -> what GpmQueryDeviceSupport answered (asked
	// once per GPU; a refused query is asked again next pass).
	gpmSupport map[string]bool
	// gpmPrev: device UUID (a GPU's, or a MIG device's for its GPU
	// instance) -> the previous pass's GPM sample, allocated by NVML.
	gpmPrev map[string]nvml.GpmSample
	// procSince: GPU UUID -> when the previous pass read its process
	// utilization, in microseconds since the epoch (NVML's timestamps).
	procSince map[string]uint64
	// pcie: GPU UUID -> its PCIe byte counters as the previous pass read
	// them (fields.go).
	pcie map[string]pcieCount
	// seen are the devices this pass sampled; what the previous pass
	// kept of any other is let go at its end (the device went).
	seen map[string]bool
	// entries are the GPUs' inventory entries, by index, as the last
	// pass that read them found them (nil for a GPU left out), and
	// entriesAt the backend's migChanges then: a fast pass uses them
	// (telemetry.go). Nil: the next pass reads them.
	entries   []*gpuEntry
	entriesAt uint64
	// refused are the readings NVML refused as not supported, by device,
	// since the devices were last read: a pass does not ask them again
	// (a MIG-mode GPU's utilization and its own GPM sample: 32 calls a
	// pass on a node of 8 such GPUs). Reading the devices again, every
	// ten minutes or after a change, clears them.
	refused map[refusal]bool
}

// refusal is a device's reading NVML refused.
type refusal struct{ uuid, what string }

// asks says whether a pass asks the device's reading: not one NVML refused
// as not supported since the devices were last read.
func (b *Backend) asks(uuid, what string) bool { return !b.pass.refused[refusal{uuid, what}] }

// answered is field, remembering a reading refused as not supported
// (NOT_SUPPORTED only: another error, a lost permission or a busy GPU, is
// asked again next pass).
func (b *Backend) answered(logger logr.Logger, uuid string, ret nvml.Return, what string) bool {
	if ret == nvml.ERROR_NOT_SUPPORTED {
		b.pass.refused[refusal{uuid, what}] = true
	}
	return field(logger, ret, what)
}

func newPassState() passState {
	return passState{
		gpmSupport: map[string]bool{}, gpmPrev: map[string]nvml.GpmSample{},
		procSince: map[string]uint64{}, pcie: map[string]pcieCount{}, seen: map[string]bool{},
		refused: map[refusal]bool{},
	}
}

// endPass frees the GPM samples and forgets the process-utilization times
// of the devices this pass did not see (gone, or no longer readable), so
// that a device that comes back starts over rather than computing figures
// over the time it was away. The caller holds b.passMu.
func (b *Backend) endPass() {
	for uuid, s := range b.pass.gpmPrev {
		if !b.pass.seen[uuid] {
			b.lib.GpmSampleFree(s)
			delete(b.pass.gpmPrev, uuid)
		}
	}
	for uuid := range b.pass.procSince {
		if !b.pass.seen[uuid] {
			delete(b.pass.procSince, uuid)
		}
	}
	for uuid := range b.pass.pcie {
		if !b.pass.seen[uuid] {
			delete(b.pass.pcie, uuid)
		}
	}
	for uuid := range b.pass.gpmSupport {
		if !b.pass.seen[uuid] {
			delete(b.pass.gpmSupport, uuid)
		}
	}
	clear(b.pass.seen)
}

// freePassState frees every GPM sample; Close calls it before NVML shuts
// down. The caller holds b.passMu (and b.mu).
func (b *Backend) freePassState() {
	for uuid, s := range b.pass.gpmPrev {
		b.lib.GpmSampleFree(s)
		delete(b.pass.gpmPrev, uuid)
	}
}

// symGpmQueryDeviceSupport is the first GPM call; a library without it has
// none of them.
const symGpmQueryDeviceSupport = "nvmlGpmQueryDeviceSupport"

// gpmSupported says whether GPM works on the GPU (Hopper and later; not
// through every hypervisor), asking NVML once per GPU.
func (b *Backend) gpmSupported(logger logr.Logger, gpuUUID string, dev nvml.Device) bool {
	if ok, known := b.pass.gpmSupport[gpuUUID]; known {
		return ok
	}
	// GPM came with the R525 drivers (CUDA 12.0); the first Hopper
	// drivers (R520) lack it, and calling a function the library lacks
	// kills the process.
	if !b.hasSymbol(symGpmQueryDeviceSupport) {
		logger.V(4).Info("Telemetry reading unsupported", "field", "GPM", "err", "the NVML library has no GPM")
		b.pass.gpmSupport[gpuUUID] = false
		return false
	}
	sup, ret := dev.GpmQueryDeviceSupport()
	if absent(ret, symGpmQueryDeviceSupport) {
		b.pass.gpmSupport[gpuUUID] = false
		return false
	}
	if !field(logger, ret, "GPM support") {
		return false // asked again next pass
	}
	ok := sup.IsSupportedDevice != 0
	if !ok {
		logger.V(4).Info("Telemetry reading unsupported", "field", "GPM", "err", "the GPU does not support GPM")
	}
	b.pass.gpmSupport[gpuUUID] = ok
	return ok
}

// The GPM metrics read, and the sample fields they fill. NVML gives the
// ratios in percent and NVLink in MiB/s (nvml.h).
type gpmMetric struct {
	id nvml.GpmMetricId
	// unit converts NVML's figure to the sample's.
	unit func(float64) float64
	to   func(s *nvdevice.TelemetrySample) *nvdevice.Reading
}

func fromPercent(v float64) float64 { return v / 100 }
func fromMiB(v float64) float64     { return v * (1 << 20) }

var (
	gpmActivity = []gpmMetric{
		{nvml.GPM_METRIC_SM_UTIL, fromPercent, func(s *nvdevice.TelemetrySample) *nvdevice.Reading { return &s.SMActive }},
		{nvml.GPM_METRIC_SM_OCCUPANCY, fromPercent, func(s *nvdevice.TelemetrySample) *nvdevice.Reading { return &s.SMOccupancy }},
		{nvml.GPM_METRIC_ANY_TENSOR_UTIL, fromPercent, func(s *nvdevice.TelemetrySample) *nvdevice.Reading { return &s.TensorActive }},
		{nvml.GPM_METRIC_DRAM_BW_UTIL, fromPercent, func(s *nvdevice.TelemetrySample) *nvdevice.Reading { return &s.DRAMActive }},
	}
	gpmNVLink = []gpmMetric{
		{nvml.GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC, fromMiB, func(s *nvdevice.TelemetrySample) *nvdevice.Reading { return &s.NVLinkTXBytesPerSecond }},
		{nvml.GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC, fromMiB, func(s *nvdevice.TelemetrySample) *nvdevice.Reading { return &s.NVLinkRXBytesPerSecond }},
	}
)

// readGPM takes this pass's GPM sample of a device with get (the GPU's, or
// its GPU instance's) and fills s's figures over the time since the
// previous pass's sample of the same device. The first pass, and a pass
// after a failed one, has no previous sample: its figures stay unsupported
// (GPM has nothing to give from one sample), never a made-up value.
func (b *Backend) readGPM(logger logr.Logger, uuid string, get func(nvml.GpmSample) nvml.Return, metrics []gpmMetric, s *nvdevice.TelemetrySample) {
	prev, hasPrev := b.pass.gpmPrev[uuid]
	delete(b.pass.gpmPrev, uuid)
	if !b.asks(uuid, "GPM sample") {
		// Refused before (a MIG-mode GPU's own sample): no sample kept.
		if hasPrev {
			b.lib.GpmSampleFree(prev)
		}
		return
	}
	cur, ret := b.lib.GpmSampleAlloc()
	if !field(logger, ret, "GPM sample allocation") {
		if hasPrev {
			b.lib.GpmSampleFree(prev)
		}
		return
	}
	if !b.answered(logger, uuid, get(cur), "GPM sample") {
		// Figures are over one interval: the next pass starts over.
		b.lib.GpmSampleFree(cur)
		if hasPrev {
			b.lib.GpmSampleFree(prev)
		}
		return
	}
	b.pass.gpmPrev[uuid] = cur
	if !hasPrev {
		logger.V(4).Info("Telemetry reading unsupported", "field", "GPM", "err", "first sample: GPM figures come from the next pass")
		return
	}
	defer b.lib.GpmSampleFree(prev)
	get2 := nvml.GpmMetricsGetType{Version: nvml.GPM_METRICS_GET_VERSION, NumMetrics: uint32(len(metrics)), Sample1: prev, Sample2: cur}
	for i, m := range metrics {
		get2.Metrics[i].MetricId = uint32(m.id)
	}
	if !field(logger, b.lib.GpmMetricsGet(&get2), "GPM metrics") {
		return
	}
	for i, m := range metrics {
		got := get2.Metrics[i]
		if got.MetricId != uint32(m.id) {
			continue // not what was asked for: never file a figure under the wrong name
		}
		if !field(logger, nvml.Return(got.NvmlReturn), "GPM metric "+gpmName(m.id)) {
			continue
		}
		if math.IsNaN(got.Value) || math.IsInf(got.Value, 0) {
			continue
		}
		*m.to(s) = nvdevice.Read(m.unit(got.Value))
	}
}

func gpmName(id nvml.GpmMetricId) string {
	switch id {
	case nvml.GPM_METRIC_SM_UTIL:
		return "SM_UTIL"
	case nvml.GPM_METRIC_SM_OCCUPANCY:
		return "SM_OCCUPANCY"
	case nvml.GPM_METRIC_ANY_TENSOR_UTIL:
		return "ANY_TENSOR_UTIL"
	case nvml.GPM_METRIC_DRAM_BW_UTIL:
		return "DRAM_BW_UTIL"
	case nvml.GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC:
		return "NVLINK_TOTAL_TX_PER_SEC"
	case nvml.GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC:
		return "NVLINK_TOTAL_RX_PER_SEC"
	}
	return "unknown"
}

// microseconds is t as NVML's process utilization timestamps count it.
func microseconds(t time.Time) uint64 { return uint64(t.UnixMicro()) }
