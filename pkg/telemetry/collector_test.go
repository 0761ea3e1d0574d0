package telemetry

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/common/expfmt"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

// fakeReader counts its reads and returns what it is given.
type fakeReader struct {
	mu      sync.Mutex
	reads   int
	samples []nvdevice.TelemetrySample
	err     error
}

func (f *fakeReader) Telemetry(context.Context) ([]nvdevice.TelemetrySample, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reads++
	return f.samples, f.err
}

var (
	gpuSample = nvdevice.TelemetrySample{
		UUID: "GPU-a", Minor: 3, ProductName: "NVIDIA H100 80GB HBM3",
		GPUUtilization: nvdevice.Read(0.87), MemoryUtilization: nvdevice.Read(0.42),
		FramebufferUsedBytes: nvdevice.Read(1 << 30), FramebufferFreeBytes: nvdevice.Read(3 << 30), FramebufferTotalBytes: nvdevice.Read(4 << 30),
		// PowerWatts unsupported: no series.
		PowerLimitWatts: nvdevice.Read(700), TemperatureCelsius: nvdevice.Read(61), SMClockHertz: nvdevice.Read(1980e6),
		ClockEventReasons:    nvdevice.Read(0x4 | 0x40),
		ECCVolatileCorrected: nvdevice.Read(3), ECCVolatileUncorrected: nvdevice.Read(1),
		ECCAggregateCorrected: nvdevice.Read(30), ECCAggregateUncorrected: nvdevice.Read(2),
		RemappedRowsCorrectable: nvdevice.Read(5), RemappedRowsUncorrectable: nvdevice.Read(0),
		RemapPending: nvdevice.Read(1), RemapFailure: nvdevice.Read(0),
		PCIeTXBytesPerSecond: nvdevice.Read(1024), PCIeRXBytesPerSecond: nvdevice.Read(2048),
		SMActive: nvdevice.Read(0.75), SMOccupancy: nvdevice.Read(0.5), TensorActive: nvdevice.Read(0.25),
		// DRAMActive unsupported (a first pass): no series.
		NVLinkTXBytesPerSecond: nvdevice.Read(1e9), NVLinkRXBytesPerSecond: nvdevice.Read(2e9),
	}
	migSample = nvdevice.TelemetrySample{
		UUID: "MIG-b", ParentUUID: "GPU-a", Minor: 3, ProductName: "NVIDIA H100 80GB HBM3", MigProfile: "1g.10gb+me", MigStart: 6,
		FramebufferUsedBytes: nvdevice.Read(1 << 20), FramebufferFreeBytes: nvdevice.Read(9983 << 20), FramebufferTotalBytes: nvdevice.Read(9984 << 20),
		SMActive: nvdevice.Read(0.5), SMOccupancy: nvdevice.Read(0.25), DRAMActive: nvdevice.Read(0.125),
		// TensorActive unsupported: no series.
	}
)

// sampled is a collector that has sampled r once.
func sampled(r nvdevice.TelemetryReader, node string) *Collector {
	c := NewCollector(r, node, 0)
	c.Sample(context.Background())
	return c
}

const (
	gpuL = `dra_device_name="gpu-3",dra_driver_name="gpu.gpudra.dev",dra_pool_name="n1",gpu="GPU-a",model="NVIDIA H100 80GB HBM3",node="n1"`
	migL = `dra_device_name="gpu-3-mig-1g-10gb-me-6",dra_driver_name="gpu.gpudra.dev",dra_mig_device_uuid="MIG-b",dra_mig_profile="1g.10gb+me",dra_pool_name="n1",gpu="GPU-a",model="NVIDIA H100 80GB HBM3",node="n1"`
)

func TestExposition(t *testing.T) {
	for _, tc := range []struct {
		name   string
		metric string
		want   string // series lines, without HELP and TYPE
	}{
		{"utilization", "gpudra_gpu_utilization_ratio", `gpudra_gpu_utilization_ratio{` + gpuL + `} 0.87`},
		{"an unsupported reading has no series", "gpudra_gpu_power_watts", ``},
		{"power limit", "gpudra_gpu_power_limit_watts", `gpudra_gpu_power_limit_watts{` + gpuL + `} 700`},
		{"framebuffer", "gpudra_gpu_framebuffer_used_bytes", `gpudra_gpu_framebuffer_used_bytes{` + gpuL + `} 1.073741824e+09`},
		{"SM clock", "gpudra_gpu_sm_clock_hertz", `gpudra_gpu_sm_clock_hertz{` + gpuL + `} 1.98e+09`},
		{"throttle bitmask", "gpudra_gpu_clock_throttle_reasons", `gpudra_gpu_clock_throttle_reasons{` + gpuL + `} 68`},
		{"ECC", "gpudra_gpu_ecc_errors_total", strings.Join([]string{
			`gpudra_gpu_ecc_errors_total{counter="aggregate",` + gpuL + `,type="corrected"} 30`,
			`gpudra_gpu_ecc_errors_total{counter="aggregate",` + gpuL + `,type="uncorrected"} 2`,
			`gpudra_gpu_ecc_errors_total{counter="volatile",` + gpuL + `,type="corrected"} 3`,
			`gpudra_gpu_ecc_errors_total{counter="volatile",` + gpuL + `,type="uncorrected"} 1`,
		}, "\n")},
		{"remapped rows", "gpudra_gpu_remapped_rows", `gpudra_gpu_remapped_rows{` + gpuL + `,state="correctable"} 5` + "\n" +
			`gpudra_gpu_remapped_rows{` + gpuL + `,state="uncorrectable"} 0`},
		{"remap pending", "gpudra_gpu_row_remap_pending", `gpudra_gpu_row_remap_pending{` + gpuL + `} 1`},
		{"PCIe", "gpudra_gpu_pcie_bytes_per_second", `gpudra_gpu_pcie_bytes_per_second{direction="rx",` + gpuL + `} 2048` + "\n" +
			`gpudra_gpu_pcie_bytes_per_second{direction="tx",` + gpuL + `} 1024`},
		{"MIG framebuffer, named as published", "gpudra_mig_framebuffer_total_bytes",
			`gpudra_mig_framebuffer_total_bytes{dra_device_name="gpu-3-mig-1g-10gb-me-6",dra_driver_name="gpu.gpudra.dev",dra_mig_device_uuid="MIG-b",dra_mig_profile="1g.10gb+me",dra_pool_name="n1",gpu="GPU-a",model="NVIDIA H100 80GB HBM3",node="n1"} 1.0468982784e+10`},
		{"SM active (GPM)", "gpudra_gpu_sm_active_ratio", `gpudra_gpu_sm_active_ratio{` + gpuL + `} 0.75`},
		{"SM occupancy", "gpudra_gpu_sm_occupancy_ratio", `gpudra_gpu_sm_occupancy_ratio{` + gpuL + `} 0.5`},
		{"tensor active", "gpudra_gpu_tensor_active_ratio", `gpudra_gpu_tensor_active_ratio{` + gpuL + `} 0.25`},
		{"an unsupported GPM figure has no series", "gpudra_gpu_dram_active_ratio", ``},
		{"NVLink", "gpudra_gpu_nvlink_bytes_per_second", `gpudra_gpu_nvlink_bytes_per_second{direction="rx",` + gpuL + `} 2e+09` + "\n" +
			`gpudra_gpu_nvlink_bytes_per_second{direction="tx",` + gpuL + `} 1e+09`},
		{"MIG SM active, the MIG label set", "gpudra_mig_sm_active_ratio", `gpudra_mig_sm_active_ratio{` + migL + `} 0.5`},
		{"MIG SM occupancy", "gpudra_mig_sm_occupancy_ratio", `gpudra_mig_sm_occupancy_ratio{` + migL + `} 0.25`},
		{"MIG DRAM active", "gpudra_mig_dram_active_ratio", `gpudra_mig_dram_active_ratio{` + migL + `} 0.125`},
		{"MIG tensor active unsupported", "gpudra_mig_tensor_active_ratio", ``},
		{"read succeeded", "gpudra_telemetry_up", `gpudra_telemetry_up{node="n1"} 1`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := sampled(&fakeReader{samples: []nvdevice.TelemetrySample{gpuSample, migSample}}, "n1")
			want := ""
			if tc.want != "" {
				want = "# HELP " + tc.metric + " x\n# TYPE " + tc.metric + " " + typeOf(tc.metric) + "\n" + tc.want + "\n"
			}
			got, err := testutil.CollectAndFormat(c, expfmt.TypeTextPlain, tc.metric)
			require.NoError(t, err)
			assert.Equal(t, want, stripHelp(string(got)))
		})
	}
}

func typeOf(metric string) string {
	if strings.HasSuffix(metric, "_total") {
		return "counter"
	}
	return "gauge"
}

// stripHelp replaces HELP texts with "x", so that tests check series only.
func stripHelp(s string) string {
	lines := strings.Split(s, "\n")
	for i, l := range lines {
		if strings.HasPrefix(l, "# HELP ") {
			f := strings.SplitN(l, " ", 4)
			lines[i] = strings.Join(f[:3], " ") + " x"
		}
	}
	return strings.Join(lines, "\n")
}

func TestThrottleReasonSeries(t *testing.T) {
	c := sampled(&fakeReader{samples: []nvdevice.TelemetrySample{gpuSample}}, "n1")
	got, err := testutil.CollectAndFormat(c, expfmt.TypeTextPlain, "gpudra_gpu_clock_throttle_reason_active")
	require.NoError(t, err)
	for _, tc := range []struct {
		reason string
		active string
	}{
		{"sw_power_cap", "1"}, {"hw_thermal_slowdown", "1"}, {"gpu_idle", "0"}, {"hw_slowdown", "0"},
	} {
		assert.Contains(t, string(got), `,reason="`+tc.reason+`"} `+tc.active+"\n", tc.reason)
	}
	assert.Equal(t, len(nvdevice.ThrottleReasons), strings.Count(string(got), "gpudra_gpu_clock_throttle_reason_active{"),
		"one series per reason NVML defines, active or not")
}

func TestFailedReadIsReportedNotFatal(t *testing.T) {
	r := &fakeReader{err: errors.New("NVML went away")}
	c := sampled(r, "n1")
	up := func() string {
		got, err := testutil.CollectAndFormat(c, expfmt.TypeTextPlain, "gpudra_telemetry_up")
		require.NoError(t, err, "the scrape itself succeeds")
		return strings.TrimPrefix(stripHelp(string(got)), "# HELP gpudra_telemetry_up x\n# TYPE gpudra_telemetry_up gauge\n")
	}
	assert.Equal(t, `gpudra_telemetry_up{node="n1"} 0`+"\n", up())
	assert.Equal(t, 4, testutil.CollectAndCount(c), "up, the sample's duration, time and age: no device series after a failed read")

	r.mu.Lock()
	r.err, r.samples = nil, []nvdevice.TelemetrySample{gpuSample}
	r.mu.Unlock()
	c.Sample(context.Background())
	assert.Equal(t, `gpudra_telemetry_up{node="n1"} 1`+"\n", up(), "the next read recovers")
	assert.Greater(t, testutil.CollectAndCount(c), 20)
}

func TestMetricNamesPassLint(t *testing.T) {
	c := sampled(&fakeReader{samples: []nvdevice.TelemetrySample{gpuSample, migSample}}, "n1")
	problems, err := testutil.CollectAndLint(c)
	require.NoError(t, err)
	assert.Empty(t, problems)
}

func TestSimulatedNodeEndToEnd(t *testing.T) {
	m, err := sim.NewBuiltin("dgx-h100", "node-a")
	require.NoError(t, err)
	defer m.Close()
	reg := prometheus.NewRegistry()
	reg.MustRegister(sampled(m, "node-a"))
	n, err := testutil.GatherAndCount(reg, "gpudra_gpu_power_limit_watts")
	require.NoError(t, err)
	assert.Equal(t, 8, n, "a DGX H100 has 8 GPUs")
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "gpudra_gpu_power_limit_watts" {
			continue
		}
		for _, s := range mf.GetMetric() {
			assert.Equal(t, 700.0, s.GetGauge().GetValue())
		}
	}
}

// Every series Collect sends is one Describe announced: a pedantic registry
// refuses the gather otherwise (a metric left out of Describe).
func TestEverySeriesIsDescribed(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(sampled(&fakeReader{samples: []nvdevice.TelemetrySample{gpuSample, migSample}}, "n1"))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	names := map[string]bool{}
	for _, mf := range mfs {
		names[mf.GetName()] = true
	}
	for _, n := range []string{
		"gpudra_gpu_sm_active_ratio", "gpudra_gpu_sm_occupancy_ratio", "gpudra_gpu_tensor_active_ratio",
		"gpudra_gpu_nvlink_bytes_per_second", "gpudra_mig_sm_active_ratio", "gpudra_mig_sm_occupancy_ratio",
		"gpudra_mig_dram_active_ratio",
	} {
		assert.True(t, names[n], n)
	}
}

// A simulated DGX H100 (MIG off) with a process on one GPU exports the GPM
// and NVLink series, through the same collector.
func TestSimulatedGPMSeries(t *testing.T) {
	m, err := sim.NewBuiltin("dgx-h100-nomig", "node-a")
	require.NoError(t, err)
	defer m.Close()
	gpu := m.Devices()[0].UUID
	require.NoError(t, m.StartProcess(gpu, 4242, 0.5, 1<<30))
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(sampled(m, "node-a"))
	for _, tc := range []struct {
		metric string
		series int
	}{
		{"gpudra_gpu_sm_active_ratio", 8}, {"gpudra_gpu_dram_active_ratio", 8},
		{"gpudra_gpu_nvlink_bytes_per_second", 16}, // tx and rx of 8 GPUs
	} {
		n, err := testutil.GatherAndCount(reg, tc.metric)
		require.NoError(t, err)
		assert.Equal(t, tc.series, n, tc.metric)
	}
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "gpudra_gpu_sm_active_ratio" {
			continue
		}
		busy := 0
		for _, s := range mf.GetMetric() {
			if s.GetGauge().GetValue() == 0.5 {
				busy++
			}
		}
		assert.Equal(t, 1, busy, "the one GPU with a process at half its SMs")
	}
}
