//go:build cgo && linux

package nvml

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// fakeGPM is GPM on the fake library. Each sample a GPU or a GPU instance
// takes is numbered (its owner's 1st, 2nd, ...); the metrics of two samples
// are only given for two consecutive samples of one owner, and carry the
// second's number (a GPU's) or the GPU instance's id (a MIG device's), so
// that a test sees which samples a figure came from.
type fakeGPM struct {
	t         *testing.T
	mu        sync.Mutex
	supported bool
	queries   int                              // GpmQueryDeviceSupport calls
	live      map[*fakeGPMSample]bool          // allocated, not freed
	taken     map[string]int                   // owner -> samples taken
	failGet   map[int]bool                     // the n-th sample get (of any owner, from 1) fails
	metricRet map[nvml.GpmMetricId]nvml.Return // a metric NVML refuses
	gets      int
}

type fakeGPMSample struct {
	owner string
	seq   int
}

func (*fakeGPMSample) Free() nvml.Return                   { panic("freed through the library") }
func (*fakeGPMSample) Get(nvml.Device) nvml.Return         { panic("taken through the device") }
func (*fakeGPMSample) MigGet(nvml.Device, int) nvml.Return { panic("taken through the device") }

// GPM base figures, percent (MiB/s for NVLink).
var gpmBase = map[nvml.GpmMetricId]float64{
	nvml.GPM_METRIC_SM_UTIL: 40, nvml.GPM_METRIC_SM_OCCUPANCY: 20, nvml.GPM_METRIC_ANY_TENSOR_UTIL: 30,
	nvml.GPM_METRIC_DRAM_BW_UTIL: 50, nvml.GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: 1000, nvml.GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: 2000,
}

// withGPM gives the library and the GPUs GPM.
func withGPM(t *testing.T, lib *mock.Interface, gpus []*fakeGPU, f *fakeGPM) *fakeGPM {
	f.t, f.live, f.taken = t, map[*fakeGPMSample]bool{}, map[string]int{}
	lib.GpmSampleAllocFunc = func() (nvml.GpmSample, nvml.Return) {
		f.mu.Lock()
		defer f.mu.Unlock()
		s := &fakeGPMSample{}
		f.live[s] = true
		return s, nvml.SUCCESS
	}
	lib.GpmSampleFreeFunc = func(s nvml.GpmSample) nvml.Return {
		f.mu.Lock()
		defer f.mu.Unlock()
		if !f.live[s.(*fakeGPMSample)] {
			f.t.Errorf("GPM sample %+v freed twice", s)
		}
		delete(f.live, s.(*fakeGPMSample))
		return nvml.SUCCESS
	}
	lib.GpmMetricsGetFunc = f.metricsGet
	for _, g := range gpus {
		uuid, _ := g.GetUUID()
		g.GpmQueryDeviceSupportFunc = func() (nvml.GpmSupport, nvml.Return) {
			f.mu.Lock()
			defer f.mu.Unlock()
			f.queries++
			return nvml.GpmSupport{Version: 1, IsSupportedDevice: boolUint(f.supported)}, nvml.SUCCESS
		}
		g.GpmSampleGetFunc = func(s nvml.GpmSample) nvml.Return { return f.take(uuid, s) }
		g.GpmMigSampleGetFunc = func(gi int, s nvml.GpmSample) nvml.Return {
			return f.take(fmt.Sprintf("%s/gi%d", uuid, gi), s)
		}
	}
	return f
}

func boolUint(b bool) uint32 {
	if b {
		return 1
	}
	return 0
}

func (f *fakeGPM) take(owner string, s nvml.GpmSample) nvml.Return {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.gets++
	if f.failGet[f.gets] {
		return nvml.ERROR_UNKNOWN
	}
	fs := s.(*fakeGPMSample)
	if !f.live[fs] {
		f.t.Errorf("GPM sample taken into a buffer that is not allocated")
	}
	f.taken[owner]++
	fs.owner, fs.seq = owner, f.taken[owner]
	return nvml.SUCCESS
}

func (f *fakeGPM) metricsGet(m *nvml.GpmMetricsGetType) nvml.Return {
	f.mu.Lock()
	defer f.mu.Unlock()
	s1, s2 := m.Sample1.(*fakeGPMSample), m.Sample2.(*fakeGPMSample)
	if !f.live[s1] || !f.live[s2] || s1.owner != s2.owner || s2.seq != s1.seq+1 || m.Version != nvml.GPM_METRICS_GET_VERSION {
		f.t.Errorf("GPM metrics of samples %+v and %+v (version %d)", *s1, *s2, m.Version)
		return nvml.ERROR_INVALID_ARGUMENT
	}
	gi, isMIG := 0, false
	if _, inst, ok := strings.Cut(s2.owner, "/gi"); ok {
		gi, _ = strconv.Atoi(inst)
		isMIG = true
	}
	for i := range m.NumMetrics {
		id := nvml.GpmMetricId(m.Metrics[i].MetricId)
		if ret, ok := f.metricRet[id]; ok {
			m.Metrics[i].NvmlReturn = uint32(ret)
			continue
		}
		v := gpmBase[id] + float64(s2.seq)
		if isMIG {
			v = gpmBase[id] + float64(gi)
		}
		m.Metrics[i].Value = v
	}
	return nvml.SUCCESS
}

// gpmOf is a sample's GPM figures.
func gpmOf(s nvdevice.TelemetrySample) [6]nvdevice.Reading {
	return [6]nvdevice.Reading{s.SMActive, s.SMOccupancy, s.TensorActive, s.DRAMActive, s.NVLinkTXBytesPerSecond, s.NVLinkRXBytesPerSecond}
}

// gpmAt are the figures the fake gives a GPU's n-th sample (with NVLink).
func gpmAt(n float64, nvlink bool) [6]nvdevice.Reading {
	r := [6]nvdevice.Reading{
		nvdevice.Read((40 + n) / 100), nvdevice.Read((20 + n) / 100), nvdevice.Read((30 + n) / 100), nvdevice.Read((50 + n) / 100),
	}
	if nvlink {
		r[4], r[5] = nvdevice.Read((1000+n)*(1<<20)), nvdevice.Read((2000+n)*(1<<20))
	}
	return r
}

func TestGPMOfAGPU(t *testing.T) {
	none := [6]nvdevice.Reading{}
	for _, tc := range []struct {
		name      string
		switches  []string
		fake      fakeGPM
		wantPass  [][6]nvdevice.Reading // per pass
		wantQuery int
	}{
		{
			name: "no figure from the first pass, then figures over each interval", switches: []string{"sw0"},
			fake:      fakeGPM{supported: true},
			wantPass:  [][6]nvdevice.Reading{none, gpmAt(2, true), gpmAt(3, true)},
			wantQuery: 1,
		},
		{
			name: "a GPU without NVLink has no NVLink figure", fake: fakeGPM{supported: true},
			wantPass: [][6]nvdevice.Reading{none, gpmAt(2, false)}, wantQuery: 1,
		},
		{
			name: "a GPU without GPM has none, and is asked once", fake: fakeGPM{supported: false}, switches: []string{"sw0"},
			wantPass: [][6]nvdevice.Reading{none, none, none}, wantQuery: 1,
		},
		{
			name: "a failed sample starts over: no figure across it", switches: []string{"sw0"},
			fake:     fakeGPM{supported: true, failGet: map[int]bool{2: true}},
			wantPass: [][6]nvdevice.Reading{none, none, none, gpmAt(3, true)}, wantQuery: 1,
		},
		{
			name: "a metric NVML refuses is unsupported, the rest read", switches: []string{"sw0"},
			fake: fakeGPM{supported: true, metricRet: map[nvml.GpmMetricId]nvml.Return{
				nvml.GPM_METRIC_ANY_TENSOR_UTIL: nvml.ERROR_NOT_SUPPORTED, nvml.GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: nvml.ERROR_UNKNOWN,
			}},
			wantPass: func() [][6]nvdevice.Reading {
				r := gpmAt(2, true)
				r[2], r[5] = nvdevice.Reading{}, nvdevice.Reading{}
				return [][6]nvdevice.Reading{none, r}
			}(),
			wantQuery: 1,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gpus := board(1, nvml.DEVICE_MIG_DISABLE, tc.switches...)
			withTelemetry(gpus[0], telemetryFake{})
			lib := fakeLib(gpus)
			f := withGPM(t, lib, gpus, &tc.fake)
			b := testBackend(t, lib)
			for pass, want := range tc.wantPass {
				got, err := b.Telemetry(context.Background())
				require.NoError(t, err)
				require.Len(t, got, 1)
				assert.Equal(t, want, gpmOf(got[0]), "pass %d", pass+1)
				assert.True(t, got[0].GPUUtilization.Supported, "the other readings are still there")
			}
			assert.Equal(t, tc.wantQuery, f.queries, "GPM support is asked once per GPU")
			if tc.fake.supported {
				assert.Len(t, f.live, 1, "one sample kept for the next pass")
			}
			require.NoError(t, b.Close())
			assert.Empty(t, f.live, "Close frees every GPM sample")
		})
	}
}

func TestGPMOfMigDevices(t *testing.T) {
	gpus := board(1, nvml.DEVICE_MIG_ENABLE, "sw0")
	gpu := withTelemetry(gpus[0], telemetryFake{})
	gpu.addGI(nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4, nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE) // GI 1, MIG-1
	gpu.addGI(nvml.GPU_INSTANCE_PROFILE_1_SLICE, 0, nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE) // GI 2, MIG-2
	lib := fakeLib(gpus)
	f := withGPM(t, lib, gpus, &fakeGPM{supported: true})
	b := testBackend(t, lib)
	read := func() map[string]nvdevice.TelemetrySample {
		got, err := b.Telemetry(context.Background())
		require.NoError(t, err)
		out := map[string]nvdevice.TelemetrySample{}
		for _, s := range got {
			out[s.UUID] = s
		}
		return out
	}
	first := read()
	require.Len(t, first, 3)
	for _, uuid := range []string{"MIG-1", "MIG-2"} {
		assert.False(t, first[uuid].SMActive.Supported, "%s: no figure from one sample", uuid)
	}
	second := read()
	for _, tc := range []struct {
		uuid string
		gi   float64
	}{{"MIG-1", 1}, {"MIG-2", 2}} {
		s := second[tc.uuid]
		assert.Equal(t, [6]nvdevice.Reading{
			nvdevice.Read((40 + tc.gi) / 100), nvdevice.Read((20 + tc.gi) / 100), nvdevice.Read((30 + tc.gi) / 100), nvdevice.Read((50 + tc.gi) / 100),
		}, gpmOf(s), "%s: its GPU instance's own figures, no NVLink", tc.uuid)
	}
	assert.Equal(t, gpmAt(2, true), gpmOf(second["GPU-0"]), "the GPU's own sample is apart from its instances'")
	assert.Len(t, f.live, 3, "one sample kept per GPU and per GPU instance")

	// A MIG device that goes has its sample freed at the end of the pass.
	gpu.mu.Lock()
	gpu.gis = gpu.gis[:1]
	gpu.mu.Unlock()
	third := read()
	require.Len(t, third, 2)
	assert.Len(t, f.live, 2, "the gone MIG device's sample is freed")
	assert.Equal(t, 1, f.queries)
}
