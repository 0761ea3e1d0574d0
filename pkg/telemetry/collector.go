// Package telemetry exports device telemetry (what dcgm-exporter exports,
// read through NVML) on the kubelet plugin's /metrics, in both of its modes.
// The readings are taken at scrape time, through a short cache so that
// several scrapers (two Prometheus replicas) do not each read NVML.
package telemetry

import (
	"context"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/metrics"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// DefaultMaxAge is how long one read serves scrapes.
const DefaultMaxAge = time.Second

var (
	gpuLabels = []string{"gpu", "device", "node", "model"}
	migLabels = []string{"gpu", "device", "node", "model", "profile"}
)

func desc(name, help string, labels []string, extra ...string) *prometheus.Desc {
	return prometheus.NewDesc(prometheus.BuildFQName(metrics.Namespace, "", name), help, append(append([]string(nil), labels...), extra...), nil)
}

// The metrics. docs/metrics.md maps each to its DCGM field.
var (
	descUp = prometheus.NewDesc(prometheus.BuildFQName(metrics.Namespace, "", "telemetry_up"),
		"1 when the last telemetry read of the node's devices succeeded, 0 when it failed (the device series are then missing).", []string{"node"}, nil)
	descUtil      = desc("gpu_utilization_ratio", "Fraction of the last sample period in which a kernel ran on the GPU (0 to 1).", gpuLabels)
	descMemUtil   = desc("gpu_memory_utilization_ratio", "Fraction of the last sample period in which device memory was read or written (0 to 1).", gpuLabels)
	descFBUsed    = desc("gpu_framebuffer_used_bytes", "Framebuffer memory used.", gpuLabels)
	descFBFree    = desc("gpu_framebuffer_free_bytes", "Framebuffer memory free.", gpuLabels)
	descFBTotal   = desc("gpu_framebuffer_total_bytes", "Framebuffer memory in all.", gpuLabels)
	descPower     = desc("gpu_power_watts", "Power draw.", gpuLabels)
	descPowerLim  = desc("gpu_power_limit_watts", "Enforced power limit.", gpuLabels)
	descTemp      = desc("gpu_temperature_celsius", "GPU die temperature.", gpuLabels)
	descSMClock   = desc("gpu_sm_clock_hertz", "Current SM clock.", gpuLabels)
	descReasons   = desc("gpu_clock_throttle_reasons", "NVML clock event (throttle) reasons bitmask, as DCGM exports it.", gpuLabels)
	descReason    = desc("gpu_clock_throttle_reason_active", "1 when the clock event (throttle) reason holds the clocks down now, else 0.", gpuLabels, "reason")
	descECC       = desc("gpu_ecc_errors_total", "ECC errors: corrected (single-bit) or uncorrected (double-bit), volatile (since the driver loaded) or aggregate (over the GPU's life).", gpuLabels, "type", "counter")
	descRemapped  = desc("gpu_remapped_rows", "HBM rows remapped, for correctable or for uncorrectable errors.", gpuLabels, "state")
	descRemapPend = desc("gpu_row_remap_pending", "1 when a row remapping waits for the next GPU reset.", gpuLabels)
	descRemapFail = desc("gpu_row_remap_failure", "1 when a row remapping failed (the GPU needs service).", gpuLabels)
	descPCIe      = desc("gpu_pcie_bytes_per_second", "PCIe throughput over NVML's last 20 ms sample, by direction (tx: from the GPU, rx: to it).", gpuLabels, "direction")
	descMigUsed   = desc("mig_framebuffer_used_bytes", "MIG device framebuffer memory used.", migLabels)
	descMigFree   = desc("mig_framebuffer_free_bytes", "MIG device framebuffer memory free.", migLabels)
	descMigTotal  = desc("mig_framebuffer_total_bytes", "MIG device framebuffer memory in all.", migLabels)
)

// Collector reads every device's telemetry at scrape time. Register it on
// the plugin's registry.
type Collector struct {
	ctx    context.Context // for logging
	reader nvdevice.TelemetryReader
	node   string
	maxAge time.Duration
	now    func() time.Time

	mu      sync.Mutex // held across a read: concurrent scrapes read once
	readAt  time.Time
	samples []nvdevice.TelemetrySample
	ok      bool
}

var _ prometheus.Collector = (*Collector)(nil)

// NewCollector reads from r at most once per maxAge (DefaultMaxAge if 0).
// ctx carries the logger.
func NewCollector(ctx context.Context, r nvdevice.TelemetryReader, node string, maxAge time.Duration) *Collector {
	if maxAge <= 0 {
		maxAge = DefaultMaxAge
	}
	return &Collector{ctx: ctx, reader: r, node: node, maxAge: maxAge, now: time.Now}
}

// Describe sends every metric's description.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descUp, descUtil, descMemUtil, descFBUsed, descFBFree, descFBTotal, descPower, descPowerLim,
		descTemp, descSMClock, descReasons, descReason, descECC, descRemapped, descRemapPend, descRemapFail, descPCIe,
		descMigUsed, descMigFree, descMigTotal} {
		ch <- d
	}
}

// read returns the cached samples, read again when older than maxAge.
func (c *Collector) read() ([]nvdevice.TelemetrySample, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now()
	if !c.readAt.IsZero() && now.Sub(c.readAt) < c.maxAge {
		return c.samples, c.ok
	}
	samples, err := c.reader.Telemetry(c.ctx)
	if err != nil {
		klog.FromContext(c.ctx).Error(err, "Reading device telemetry failed")
	}
	c.samples, c.ok, c.readAt = samples, err == nil, now
	return c.samples, c.ok
}

// Collect sends the supported readings of every device.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	samples, ok := c.read()
	up := 0.0
	if ok {
		up = 1
	}
	ch <- prometheus.MustNewConstMetric(descUp, prometheus.GaugeValue, up, c.node)
	for i := range samples {
		s := &samples[i]
		if s.IsMIG() {
			c.collectMIG(ch, s)
		} else {
			c.collectGPU(ch, s)
		}
	}
}

// DeviceName is the name the plugin publishes the sample's device under
// (in a ResourceSlice, or as the device plugin's device).
func DeviceName(s *nvdevice.TelemetrySample) string {
	g := &nvdevice.GPU{Minor: s.Minor}
	if s.IsMIG() {
		return slicebuilder.MigDeviceName(g, s.MigProfile, s.MigStart)
	}
	return slicebuilder.GPUDeviceName(g)
}

func send(ch chan<- prometheus.Metric, d *prometheus.Desc, t prometheus.ValueType, r nvdevice.Reading, labels ...string) {
	if r.Supported {
		ch <- prometheus.MustNewConstMetric(d, t, r.Value, labels...)
	}
}

func (c *Collector) collectGPU(ch chan<- prometheus.Metric, s *nvdevice.TelemetrySample) {
	l := []string{s.UUID, DeviceName(s), c.node, s.ProductName}
	with := func(extra ...string) []string { return append(append([]string(nil), l...), extra...) }
	gauge := prometheus.GaugeValue
	send(ch, descUtil, gauge, s.GPUUtilization, l...)
	send(ch, descMemUtil, gauge, s.MemoryUtilization, l...)
	send(ch, descFBUsed, gauge, s.FramebufferUsedBytes, l...)
	send(ch, descFBFree, gauge, s.FramebufferFreeBytes, l...)
	send(ch, descFBTotal, gauge, s.FramebufferTotalBytes, l...)
	send(ch, descPower, gauge, s.PowerWatts, l...)
	send(ch, descPowerLim, gauge, s.PowerLimitWatts, l...)
	send(ch, descTemp, gauge, s.TemperatureCelsius, l...)
	send(ch, descSMClock, gauge, s.SMClockHertz, l...)
	send(ch, descReasons, gauge, s.ClockEventReasons, l...)
	if s.ClockEventReasons.Supported {
		mask := uint64(s.ClockEventReasons.Value)
		for _, r := range nvdevice.ThrottleReasons {
			active := 0.0
			if mask&r.Bit != 0 {
				active = 1
			}
			ch <- prometheus.MustNewConstMetric(descReason, gauge, active, with(r.Name)...)
		}
	}
	counter := prometheus.CounterValue
	send(ch, descECC, counter, s.ECCVolatileCorrected, with("corrected", "volatile")...)
	send(ch, descECC, counter, s.ECCVolatileUncorrected, with("uncorrected", "volatile")...)
	send(ch, descECC, counter, s.ECCAggregateCorrected, with("corrected", "aggregate")...)
	send(ch, descECC, counter, s.ECCAggregateUncorrected, with("uncorrected", "aggregate")...)
	send(ch, descRemapped, gauge, s.RemappedRowsCorrectable, with("correctable")...)
	send(ch, descRemapped, gauge, s.RemappedRowsUncorrectable, with("uncorrectable")...)
	send(ch, descRemapPend, gauge, s.RemapPending, l...)
	send(ch, descRemapFail, gauge, s.RemapFailure, l...)
	send(ch, descPCIe, gauge, s.PCIeTXBytesPerSecond, with("tx")...)
	send(ch, descPCIe, gauge, s.PCIeRXBytesPerSecond, with("rx")...)
}

func (c *Collector) collectMIG(ch chan<- prometheus.Metric, s *nvdevice.TelemetrySample) {
	l := []string{s.ParentUUID, DeviceName(s), c.node, s.ProductName, s.MigProfile}
	send(ch, descMigUsed, prometheus.GaugeValue, s.FramebufferUsedBytes, l...)
	send(ch, descMigFree, prometheus.GaugeValue, s.FramebufferFreeBytes, l...)
	send(ch, descMigTotal, prometheus.GaugeValue, s.FramebufferTotalBytes, l...)
}
