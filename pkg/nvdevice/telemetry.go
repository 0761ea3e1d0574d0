package nvdevice

import (
	"context"
)

// TelemetryReader reads device telemetry: what dcgm-exporter reads, for the
// kubelet plugin's /metrics. It is apart from Interface so that a backend
// (or a test stand-in) without it still is one; the plugin asks for it with
// a type assertion.
type TelemetryReader interface {
	// Telemetry reads one sample of every GPU and every MIG device the
	// backend's inventory lists now. A reading the device does not give is
	// left unsupported: one failed field never fails the whole read. An
	// error means nothing could be read (the device list itself).
	Telemetry(ctx context.Context) ([]TelemetrySample, error)
}

// Reading is one value NVML may not give. Supported false means the device
// (or driver) did not give it: not the same as zero, and not exported.
type Reading struct {
	Value     float64
	Supported bool
}

// Read is a supported reading of v.
func Read(v float64) Reading { return Reading{Value: v, Supported: true} }

// TelemetrySample is one device's readings at one time. For a MIG device
// only the framebuffer, GPM and process readings can be supported: NVML
// gives no utilization, power, clocks or ECC per MIG device.
type TelemetrySample struct {
	// UUID is the device's: the GPU's, or the MIG device's.
	UUID string
	// ParentUUID is the GPU a MIG device is on; empty for a GPU.
	ParentUUID string
	// Minor is the GPU's (the parent's for a MIG device) minor number:
	// device names are built from it.
	Minor int
	// ProductName is the GPU's ("NVIDIA H100 80GB HBM3").
	ProductName string
	// MigProfile and MigStart are a MIG device's GPU-instance profile
	// ("3g.40gb") and placement start, in memory slices.
	MigProfile string
	MigStart   int

	// GPUUtilization is the fraction of the last sample period in which a
	// kernel ran (0..1).
	GPUUtilization Reading
	// MemoryUtilization is the fraction of the period in which device
	// memory was read or written (0..1).
	MemoryUtilization Reading
	// Framebuffer memory, bytes.
	FramebufferUsedBytes, FramebufferFreeBytes, FramebufferTotalBytes Reading
	// PowerWatts is the power draw, PowerLimitWatts the enforced limit.
	PowerWatts, PowerLimitWatts Reading
	// TemperatureCelsius is the GPU die's.
	TemperatureCelsius Reading
	// SMClockHertz is the current SM clock.
	SMClockHertz Reading
	// ClockEventReasons is NVML's clock event (throttle) reasons bitmask;
	// ThrottleReasons names its bits.
	ClockEventReasons Reading
	// ECC error counts, volatile (since the driver loaded) and aggregate
	// (over the device's life): corrected (single-bit) and uncorrected
	// (double-bit).
	ECCVolatileCorrected, ECCVolatileUncorrected   Reading
	ECCAggregateCorrected, ECCAggregateUncorrected Reading
	// Row remapping (HBM): rows remapped for correctable and for
	// uncorrectable errors, a remapping pending (1, until the next GPU
	// reset) and a remapping that failed (1).
	RemappedRowsCorrectable, RemappedRowsUncorrectable Reading
	RemapPending, RemapFailure                         Reading
	// PCIe throughput, bytes per second, over NVML's last 20 ms sample.
	PCIeTXBytesPerSecond, PCIeRXBytesPerSecond Reading

	// GPM (GPU performance monitoring; Hopper and later) figures over the
	// time between two GPM samples, ratios 0..1: SMs with a warp resident
	// (DCGM_FI_PROF_SM_ACTIVE), warps resident against the SMs' maximum
	// (SM_OCCUPANCY), the tensor pipes busy (PIPE_TENSOR_ACTIVE) and the
	// memory interface busy (DRAM_ACTIVE). A GPU and a MIG device (its GPU
	// instance) have them each; a GPU in MIG mode has them per instance.
	SMActive, SMOccupancy, TensorActive, DRAMActive Reading
	// NVLink throughput over all of the GPU's links, bytes per second (GPM;
	// DCGM_FI_PROF_NVLINK_TX_BYTES and RX_BYTES). GPUs only.
	NVLinkTXBytesPerSecond, NVLinkRXBytesPerSecond Reading

	// ProcessesRead says whether the device's process list was read: false
	// means NVML could not tell (not "no process"), and nothing may be
	// concluded from Processes.
	ProcessesRead bool
	// Processes are the compute processes on the device now, MPS clients
	// included, one entry per PID. A MIG device lists its own; a GPU in MIG
	// mode lists none of its own (NVML lists them per MIG device).
	Processes []ProcessSample
}

// ProcessSample is one process's use of one device, as NVML reports it.
type ProcessSample struct {
	// PID is the process's ID in the host's PID namespace (NVML's).
	PID int
	// UsedMemoryBytes is the framebuffer the process holds on the device
	// (unsupported where NVML does not say: NVML_VALUE_NOT_AVAILABLE).
	UsedMemoryBytes Reading
	// SMUtilization is the process's share of the device's SMs, 0..1,
	// averaged over the samples NVML kept since the previous pass
	// (nvmlDeviceGetProcessUtilization); unsupported on MIG devices, where
	// NVML samples none, and when NVML kept no sample of the process.
	SMUtilization Reading
}

// IsMIG says whether the sample is a MIG device's.
func (s TelemetrySample) IsMIG() bool { return s.ParentUUID != "" }

// GPUUUID is the physical GPU's UUID: the parent's for a MIG device.
func (s TelemetrySample) GPUUUID() string {
	if s.IsMIG() {
		return s.ParentUUID
	}
	return s.UUID
}

// ThrottleReason names one bit of the clock event reasons bitmask
// (nvmlClocksEventReason*, DCGM's DCGM_CLOCKS_EVENT_REASON_*).
type ThrottleReason struct {
	Bit  uint64
	Name string
}

// ThrottleReasons are the bits NVML defines, in bit order, named as
// Prometheus label values.
var ThrottleReasons = []ThrottleReason{
	{0x1, "gpu_idle"},
	{0x2, "applications_clocks_setting"},
	{0x4, "sw_power_cap"},
	{0x8, "hw_slowdown"},
	{0x10, "sync_boost"},
	{0x20, "sw_thermal_slowdown"},
	{0x40, "hw_thermal_slowdown"},
	{0x80, "hw_power_brake_slowdown"},
	{0x100, "display_clock_setting"},
	{0x200, "board_limit"},
	{0x400, "reliability"},
}

// TelemetryOptions says what one pass reads. The zero value reads
// everything, as Telemetry does.
type TelemetryOptions struct {
	// SkipSlow leaves out the readings that change slowly (CopySlowReadings
	// names them): they are left unsupported, and the caller keeps the last
	// ones.
	SkipSlow bool
	// KeepDevices lets the backend use its devices as it last read them
	// (which GPUs, their MIG devices, their handles) instead of reading
	// them again: most of a full pass's NVML calls. A backend still reads
	// them again after a MIG change made through it, a change of the GPU
	// count or a GPU lost.
	KeepDevices bool
	// MPSDevices, when not nil, are the only devices (GPU or MIG device
	// UUIDs) whose MPS client list a pass reads: the ones the plugin
	// shares with MPS. Nil reads it on every device. An MPS server is a
	// compute process of its device, listed on every pass; only its
	// clients are in the MPS list.
	MPSDevices map[string]bool
}

// MPS says whether a pass reads the MPS client list of the device.
func (o TelemetryOptions) MPS(uuid string) bool {
	return o.MPSDevices == nil || o.MPSDevices[uuid]
}

// MPSAny says whether a pass reads the MPS client list of any of the MIG
// devices (on their GPU's handle, which lists them all).
func (o TelemetryOptions) MPSAny(devices []MigDevice) bool {
	for _, d := range devices {
		if o.MPS(d.UUID) {
			return true
		}
	}
	return false
}

// CadencedTelemetryReader is a TelemetryReader that can read the slowly
// changing fields less often than the others. Telemetry reads everything.
type CadencedTelemetryReader interface {
	TelemetryReader
	TelemetryWith(ctx context.Context, opts TelemetryOptions) ([]TelemetrySample, error)
}

// CopySlowReadings copies the readings that change slowly from src to dst:
// the enforced power limit (set by an administrator), the ECC error counts
// and the row remapping state (they move when the HBM fails, a few times in
// a GPU's life). TelemetryOptions.SkipSlow leaves them out.
// Only a GPU has them; a MIG device's sample has none to copy.
func CopySlowReadings(dst, src *TelemetrySample) {
	dst.PowerLimitWatts = src.PowerLimitWatts
	dst.ECCVolatileCorrected, dst.ECCVolatileUncorrected = src.ECCVolatileCorrected, src.ECCVolatileUncorrected
	dst.ECCAggregateCorrected, dst.ECCAggregateUncorrected = src.ECCAggregateCorrected, src.ECCAggregateUncorrected
	dst.RemappedRowsCorrectable, dst.RemappedRowsUncorrectable = src.RemappedRowsCorrectable, src.RemappedRowsUncorrectable
	dst.RemapPending, dst.RemapFailure = src.RemapPending, src.RemapFailure
}
