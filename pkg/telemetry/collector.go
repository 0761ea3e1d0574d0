// Package telemetry exports device telemetry (what dcgm-exporter exports,
// read through NVML) on the kubelet plugin's /metrics, in both of its modes.
// A sampler goroutine reads the devices once per interval (Run); a scrape
// only sends the last sample, so that no scrape, however many scrapers
// there are, ever reads NVML or waits for it. A sample that grew old, or a
// read that hangs, is not sent: telemetry_up says 0 and the sample's age
// says how old it is (stale).
package telemetry

import (
	"context"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/gpudra/gpudra/pkg/metrics"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// DefaultInterval is how often the sampler reads the devices.
const DefaultInterval = 10 * time.Second

// DefaultSlowInterval is how often the sampler reads the readings that
// change slowly (nvdevice.CopySlowReadings: power limit, ECC counts, row
// remapping): a full pass. The passes between are fast passes, which send
// the last full pass's slow readings. A minute keeps an ECC count or a new
// power limit at most a minute late, against the ten minutes over which the
// alerts judge them (docs/alerts.md).
const DefaultSlowInterval = time.Minute

// DeviceInterval is how often a pass has the backend read its devices
// again (which GPUs, their MIG devices, their handles; the NVML backend
// checks each kept entry with a few calls and reads in full only those
// that changed, and asks again the readings NVML refused) rather than keep them
// (nvdevice.TelemetryOptions.KeepDevices). The backend reads them at once
// after the changes it sees (a MIG change made through it, a GPU lost);
// the interval bounds how late a MIG device made by another tool
// (nvidia-smi) shows.
const DeviceInterval = 10 * time.Minute

func desc(name, help string, labels []string, extra ...string) *prometheus.Desc {
	return prometheus.NewDesc(prometheus.BuildFQName(metrics.Namespace, "", name), help, append(append([]string(nil), labels...), extra...), nil)
}

// The metrics. docs/metrics.md maps each to its DCGM field.
var (
	descUp = prometheus.NewDesc(prometheus.BuildFQName(metrics.Namespace, "", "telemetry_up"),
		"1 when the last telemetry read of the node's devices succeeded and is fresh, 0 when it failed, none has completed yet, it is older than three sampling intervals, or the read under way has taken longer than one (the device series are then missing).", []string{"node"}, nil)
	descSampleDur = prometheus.NewDesc(prometheus.BuildFQName(metrics.Namespace, "", "telemetry_sample_duration_seconds"),
		"How long the last telemetry read of the node's devices took.", []string{"node"}, nil)
	descSampleTS = prometheus.NewDesc(prometheus.BuildFQName(metrics.Namespace, "", "telemetry_last_sample_timestamp_seconds"),
		"When the last telemetry read of the node's devices completed, in seconds since the Unix epoch.", []string{"node"}, nil)
	descSampleAge = prometheus.NewDesc(prometheus.BuildFQName(metrics.Namespace, "", "telemetry_last_sample_age_seconds"),
		"How long ago, at the scrape, the last telemetry read of the node's devices completed: it grows while a read hangs.", []string{"node"}, nil)
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
	descSMActive  = desc("gpu_sm_active_ratio", "Fraction of the GPU's SMs with a warp resident, over the time since the previous telemetry pass (GPM; DCGM_FI_PROF_SM_ACTIVE).", gpuLabels)
	descSMOcc     = desc("gpu_sm_occupancy_ratio", "Warps resident on the GPU's SMs against the most they can hold, over the time since the previous pass (GPM; DCGM_FI_PROF_SM_OCCUPANCY).", gpuLabels)
	descTensor    = desc("gpu_tensor_active_ratio", "Fraction of the time the GPU's tensor pipes were busy, over the time since the previous pass (GPM; DCGM_FI_PROF_PIPE_TENSOR_ACTIVE).", gpuLabels)
	descDRAM      = desc("gpu_dram_active_ratio", "Fraction of its peak the GPU's memory interface was busy, over the time since the previous pass (GPM; DCGM_FI_PROF_DRAM_ACTIVE).", gpuLabels)
	descNVLink    = desc("gpu_nvlink_bytes_per_second", "NVLink throughput over all of the GPU's links, by direction, over the time since the previous pass (GPM; DCGM_FI_PROF_NVLINK_TX_BYTES, RX_BYTES).", gpuLabels, "direction")
	descMigSMAct  = desc("mig_sm_active_ratio", "Fraction of the MIG device's SMs with a warp resident, over the time since the previous pass (GPM of its GPU instance; DCGM_FI_PROF_SM_ACTIVE).", migLabels)
	descMigSMOcc  = desc("mig_sm_occupancy_ratio", "Warps resident on the MIG device's SMs against the most they can hold (GPM; DCGM_FI_PROF_SM_OCCUPANCY).", migLabels)
	descMigTensor = desc("mig_tensor_active_ratio", "Fraction of the time the MIG device's tensor pipes were busy (GPM; DCGM_FI_PROF_PIPE_TENSOR_ACTIVE).", migLabels)
	descMigDRAM   = desc("mig_dram_active_ratio", "Fraction of its peak the MIG device's memory interface was busy (GPM; DCGM_FI_PROF_DRAM_ACTIVE).", migLabels)
	descMigUsed   = desc("mig_framebuffer_used_bytes", "MIG device framebuffer memory used.", migLabels)
	descMigFree   = desc("mig_framebuffer_free_bytes", "MIG device framebuffer memory free.", migLabels)
	descMigTotal  = desc("mig_framebuffer_total_bytes", "MIG device framebuffer memory in all.", migLabels)
)

// Collector exports the last sample of every device's telemetry. Register
// it on the plugin's registry and start Run.
type Collector struct {
	reader   nvdevice.TelemetryReader
	node     string
	interval time.Duration
	clock    clock.WithTicker

	mu       sync.Mutex // never held across a read
	sampled  bool       // a read has completed
	at       time.Time  // when the last read completed
	took     time.Duration
	samples  []nvdevice.TelemetrySample
	ok       bool
	sampling bool      // a read is under way (Sample is not reentrant)
	started  time.Time // when the read under way started
	claims   ClaimsFunc
	// Process attribution (attribution.go): its config, nil while off,
	// and the last pass's result.
	attribCfg *AttributionConfig
	attrib    *attribution

	// The slow cadence (DefaultSlowInterval). slowInterval is under mu;
	// the rest is only touched by the pass under way (sampling says there
	// is one at most).
	slowInterval time.Duration // 0: every pass reads everything
	lastFull     time.Time     // when the last full pass that worked started
	lastDevices  time.Time     // when the last pass that read the devices again and worked started
	fullDue      bool          // a GPU has no slow readings yet: the next pass is full
	// slow are the last full pass's slow readings, by GPU UUID.
	slow map[string]nvdevice.TelemetrySample
}

var _ prometheus.Collector = (*Collector)(nil)

// NewCollector samples r every interval (DefaultInterval if 0) once Run
// starts.
func NewCollector(r nvdevice.TelemetryReader, node string, interval time.Duration) *Collector {
	if interval <= 0 {
		interval = DefaultInterval
	}
	return &Collector{reader: r, node: node, interval: interval, clock: clock.RealClock{}, slowInterval: DefaultSlowInterval}
}

// SetSlowInterval sets how often a pass is a full pass (DefaultSlowInterval);
// 0 makes every pass read everything, the devices too, as before the slow
// cadence (issue 50).
// A reader that is no nvdevice.CadencedTelemetryReader always reads
// everything. Call it before Run.
func (c *Collector) SetSlowInterval(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.slowInterval = max(0, d)
}

// Stale reports: a sample older than staleAfter intervals, or a read under
// way for longer than hungAfter intervals, is not sent.
const (
	staleAfter = 3
	hungAfter  = 1
)

// SetClock makes the collector tell time, and tick, by clk: for tests and
// simulations that run on a clock of their own. Call it before Run.
func (c *Collector) SetClock(clk clock.WithTicker) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.clock = clk
}

// Run samples at once and then every interval until ctx is done. A read
// that takes longer than the interval delays the next one: there is never
// more than one read in flight.
func (c *Collector) Run(ctx context.Context) {
	c.mu.Lock()
	clk := c.clock
	c.mu.Unlock()
	t := clk.NewTicker(c.interval)
	defer t.Stop()
	for {
		c.Sample(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C():
		}
	}
}

// Sample reads the devices once and keeps what it read for the scrapes;
// it returns at once while another Sample is under way. ctx carries the
// logger.
func (c *Collector) Sample(ctx context.Context) {
	c.mu.Lock()
	if c.sampling {
		c.mu.Unlock()
		return
	}
	c.sampling = true
	clk := c.clock
	start := clk.Now()
	c.started = start
	attribCfg, claims, slowInterval := c.attribCfg, c.claims, c.slowInterval
	c.mu.Unlock()
	samples, err := c.read(ctx, start, slowInterval, mpsDevicesOf(claims))
	end := clk.Now()
	if err != nil {
		klog.FromContext(ctx).Error(err, "Reading device telemetry failed")
		samples = nil // telemetry_up says why the device series are missing
	}
	var attrib *attribution // not up: nothing read to attribute
	if attribCfg != nil && err == nil {
		attrib = c.attribute(ctx, *attribCfg, samples, claims)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.attrib = attrib
	c.sampling, c.sampled = false, true
	c.samples, c.ok, c.at, c.took = samples, err == nil, end, end.Sub(start)
}

// read takes one pass: a full one when the slow cadence says so, else a
// fast one whose GPUs get the last full pass's slow readings; it has the
// backend read its devices again every DeviceInterval, and the MPS client
// lists of the devices shared with MPS only (mps; nil: of every device).
func (c *Collector) read(ctx context.Context, start time.Time, slowInterval time.Duration, mps map[string]bool) ([]nvdevice.TelemetrySample, error) {
	cr, ok := c.reader.(nvdevice.CadencedTelemetryReader)
	if !ok {
		return c.reader.Telemetry(ctx)
	}
	everything := slowInterval <= 0
	full := everything || c.lastFull.IsZero() || c.fullDue || start.Sub(c.lastFull) >= slowInterval
	devices := everything || c.lastDevices.IsZero() || start.Sub(c.lastDevices) >= DeviceInterval
	samples, err := cr.TelemetryWith(ctx, nvdevice.TelemetryOptions{SkipSlow: !full, KeepDevices: !devices, MPSDevices: mps})
	if err != nil {
		return nil, err // the next pass reads what this one was to read
	}
	if devices {
		c.lastDevices = start
	}
	if full {
		slow := make(map[string]nvdevice.TelemetrySample, len(samples))
		for i := range samples {
			if s := &samples[i]; !s.IsMIG() {
				var kept nvdevice.TelemetrySample
				nvdevice.CopySlowReadings(&kept, s)
				slow[s.UUID] = kept // a GPU gone since is forgotten
			}
		}
		c.slow, c.lastFull, c.fullDue = slow, start, false
		return samples, nil
	}
	for i := range samples {
		s := &samples[i]
		if s.IsMIG() {
			continue
		}
		if kept, ok := c.slow[s.UUID]; ok {
			nvdevice.CopySlowReadings(s, &kept)
		} else {
			// A GPU new since the last full pass: its slow series are
			// missing until the next pass, which reads them.
			c.fullDue = true
		}
	}
	return samples, nil
}

// Describe sends every metric's description.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descUp, descSampleDur, descSampleTS, descSampleAge, descUtil, descMemUtil, descFBUsed, descFBFree, descFBTotal, descPower, descPowerLim,
		descTemp, descSMClock, descReasons, descReason, descECC, descRemapped, descRemapPend, descRemapFail, descPCIe,
		descSMActive, descSMOcc, descTensor, descDRAM, descNVLink,
		descMigUsed, descMigFree, descMigTotal, descMigSMAct, descMigSMOcc, descMigTensor, descMigDRAM,
		descClaimInfo, descFree} {
		ch <- d
	}
	for _, d := range attributionDescs() {
		ch <- d
	}
}

// Collect sends the last sample's supported readings of every device,
// unless the sample is not fresh (fresh). It never reads the devices.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	samples, ok, sampled, at, took, claims := c.samples, c.ok, c.sampled, c.at, c.took, c.claims
	sampling, started, now := c.sampling, c.started, c.clock.Now()
	attribOn, attrib := c.attribCfg != nil, c.attrib
	c.mu.Unlock()
	up := ok && c.fresh(now, at, sampling, started)
	if !up {
		// What a stale pass read, of the devices or of the kubelet, is
		// not sent: alerts would judge it as now.
		samples, attrib = nil, nil
	}
	c.collectAttribution(ch, attribOn, attrib)
	var h *holders
	if claims != nil && len(samples) > 0 {
		hs := holdersOf(claims())
		h = &hs
	}
	upValue := 0.0
	if up {
		upValue = 1
	}
	ch <- prometheus.MustNewConstMetric(descUp, prometheus.GaugeValue, upValue, c.node)
	if sampled {
		ch <- prometheus.MustNewConstMetric(descSampleDur, prometheus.GaugeValue, took.Seconds(), c.node)
		ch <- prometheus.MustNewConstMetric(descSampleTS, prometheus.GaugeValue, float64(at.UnixNano())/1e9, c.node)
		ch <- prometheus.MustNewConstMetric(descSampleAge, prometheus.GaugeValue, max(0, now.Sub(at).Seconds()), c.node)
	}
	for i := range samples {
		s := &samples[i]
		if s.IsMIG() {
			c.collectMIG(ch, s)
		} else {
			c.collectGPU(ch, s)
		}
		if h != nil {
			c.collectClaims(ch, *h, s)
		}
	}
}

// fresh says whether, at now, the last sample (completed at at) may still
// be sent: it is no older than staleAfter intervals, and no read under way
// (since started) has taken longer than hungAfter intervals. A read that
// hangs in the driver otherwise leaves its last figures up for ever.
func (c *Collector) fresh(now, at time.Time, sampling bool, started time.Time) bool {
	if now.Sub(at) > staleAfter*c.interval {
		return false
	}
	return !sampling || now.Sub(started) <= hungAfter*c.interval
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
	l := append(deviceValues(c.node, s.UUID, DeviceName(s)), s.ProductName)
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
	send(ch, descSMActive, gauge, s.SMActive, l...)
	send(ch, descSMOcc, gauge, s.SMOccupancy, l...)
	send(ch, descTensor, gauge, s.TensorActive, l...)
	send(ch, descDRAM, gauge, s.DRAMActive, l...)
	send(ch, descNVLink, gauge, s.NVLinkTXBytesPerSecond, with("tx")...)
	send(ch, descNVLink, gauge, s.NVLinkRXBytesPerSecond, with("rx")...)
}

func (c *Collector) collectMIG(ch chan<- prometheus.Metric, s *nvdevice.TelemetrySample) {
	l := append(deviceValues(c.node, s.ParentUUID, DeviceName(s)), s.ProductName, s.MigProfile, s.UUID)
	send(ch, descMigUsed, prometheus.GaugeValue, s.FramebufferUsedBytes, l...)
	send(ch, descMigFree, prometheus.GaugeValue, s.FramebufferFreeBytes, l...)
	send(ch, descMigTotal, prometheus.GaugeValue, s.FramebufferTotalBytes, l...)
	send(ch, descMigSMAct, prometheus.GaugeValue, s.SMActive, l...)
	send(ch, descMigSMOcc, prometheus.GaugeValue, s.SMOccupancy, l...)
	send(ch, descMigTensor, prometheus.GaugeValue, s.TensorActive, l...)
	send(ch, descMigDRAM, prometheus.GaugeValue, s.DRAMActive, l...)
}
