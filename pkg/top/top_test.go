package top

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/local"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/prepared"
	"github.com/gpudra/gpudra/pkg/telemetry"
)

var at = time.Date(2026, 11, 27, 14, 0, 0, 0, time.UTC)

// testMachine is two H100s, the second in MIG mode with one 3g.40gb.
const testMachine = "name: top-test\ngpuCount: 2\nnvlink: none\nmigEnabled: [1]\nmigDevices:\n- {gpu: 1, profile: 3g.40gb, start: 4}\n"

// PluginEndpoint serves a kubelet plugin's telemetry over the simulated
// machine, as the plugin does: the collector sampled once, the claims
// given, on a registry behind promhttp. It returns the server and the
// machine's UUIDs (GPU 0, GPU 1, its MIG device).
func pluginEndpoint(t *testing.T, claimsOf func(uuids [3]string) []prepared.Claim, load map[int]float64) (srv *httptest.Server, uuids [3]string) {
	t.Helper()
	spec, err := sim.ParseSpec([]byte(testMachine))
	require.NoError(t, err)
	m, err := sim.New(spec, "node-a")
	require.NoError(t, err)
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	require.Len(t, inv.GPUs, 2)
	require.Len(t, inv.GPUs[1].MIG.Devices, 1)
	uuids = [3]string{inv.GPUs[0].UUID, inv.GPUs[1].UUID, inv.GPUs[1].MIG.Devices[0].UUID}
	for i, l := range load {
		require.NoError(t, m.SetLoad(uuids[i], l))
	}
	c := telemetry.NewCollector(m, "node-a", 0)
	c.Sample(context.Background())
	if claimsOf != nil {
		claims := claimsOf(uuids)
		c.SetClaims(func() []prepared.Claim { return claims })
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	srv = httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	t.Cleanup(srv.Close)
	return srv, uuids
}

func scrape(t *testing.T, url string) *Snapshot {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	fams, err := ParseMetrics(resp.Body)
	require.NoError(t, err)
	return FromMetrics(fams, url, at)
}

// TestFromMetricsOnAScrape parses a real scrape of pkg/telemetry's
// collector over the simulator: devices in order, the claim on each, the
// readings the loads set, and nothing read where the plugin exports
// nothing (no attribution series yet).
func TestFromMetricsOnAScrape(t *testing.T) {
	claims := func(u [3]string) []prepared.Claim {
		return []prepared.Claim{
			{UID: "u1", Namespace: "ml", Name: "train", State: prepared.PrepareCompleted, Devices: []prepared.Device{{Device: "gpu-0", UUID: u[0], GPUUUID: u[0]}}},
			{UID: "u2", Namespace: "ml", Name: "infer", State: prepared.PrepareCompleted,
				Devices: []prepared.Device{{Device: "gpu-1-mig-3g-40gb-4", UUID: u[2], GPUUUID: u[1], Mig: true}}},
		}
	}
	srv, uuids := pluginEndpoint(t, claims, map[int]float64{0: 0.5, 2: 0.25})
	s := scrape(t, srv.URL)

	assert.Equal(t, "node-a", s.Node)
	var names []string
	for _, d := range s.Devices {
		names = append(names, d.Name)
	}
	require.Equal(t, []string{"gpu-0", "gpu-1", "gpu-1-mig-3g-40gb-4"}, names)
	gpu0, gpu1, mig := s.Devices[0], s.Devices[1], s.Devices[2]

	assert.Equal(t, uuids[0], gpu0.UUID)
	assert.Equal(t, []Holder{{Claim: "ml/train"}}, gpu0.Holders)
	require.NotNil(t, gpu0.Free)
	assert.False(t, *gpu0.Free)
	require.NotNil(t, gpu0.Utilization, "a loaded GPU's utilization")
	assert.Greater(t, *gpu0.Utilization, 0.0)
	require.NotNil(t, gpu0.MemoryUsedBytes)
	require.NotNil(t, gpu0.MemoryTotalBytes)
	assert.Greater(t, *gpu0.MemoryUsedBytes, 0.0, "a loaded GPU holds memory")
	assert.NotNil(t, gpu0.PowerWatts)
	assert.NotNil(t, gpu0.TemperatureC)
	assert.Equal(t, "NVIDIA H100 80GB HBM3", gpu0.Model)

	assert.Equal(t, uuids[1], gpu1.UUID)
	assert.Empty(t, gpu1.Holders)
	require.NotNil(t, gpu1.Free)
	assert.False(t, *gpu1.Free, "its MIG device is claimed")

	assert.Equal(t, uuids[1], mig.GPU, "a MIG device names its GPU")
	assert.Equal(t, "3g.40gb", mig.Profile)
	assert.Equal(t, []Holder{{Claim: "ml/infer"}}, mig.Holders)
	require.NotNil(t, mig.MemoryTotalBytes)
	assert.InDelta(t, 39.5*(1<<30), *mig.MemoryTotalBytes, 1<<30, "a 3g.40gb holds about 40 GB")
	assert.Nil(t, mig.PowerWatts, "no power per MIG device: not read, not 0")

	for _, d := range s.Devices {
		assert.False(t, d.ProcessesRead, "%s: no attribution series", d.Name)
		assert.Empty(t, d.Processes, d.Name)
	}
	assert.Contains(t, s.Notes, "the plugin exports no process attribution: no processes shown")

	var table bytes.Buffer
	require.NoError(t, Table(&table, s))
	assert.Contains(t, table.String(), "ml/train")
	assert.Regexp(t, `gpu-1-mig-3g-40gb-4\s+3g.40gb\s+ml/infer`, table.String())
}

// attribution is a scrape's attribution part, in the contract's names
// (issue 36), on the devices of a two-device node.
const attributionScrape = `
gpudra_gpu_utilization_ratio{device="gpu-0",gpu="GPU-0",model="H100",node="n1"} 0.5
gpudra_mig_framebuffer_used_bytes{device="gpu-1-mig-1g-10gb-6",gpu="GPU-1",model="H100",node="n1",profile="1g.10gb"} 1073741824
gpudra_device_claim_info{claim_name="a",claim_namespace="ns",claim_uid="u1",device="gpu-0",gpu="GPU-0",node="n1"} 1
gpudra_device_free{device="gpu-0",gpu="GPU-0",node="n1"} 0
gpudra_device_free{device="gpu-1-mig-1g-10gb-6",gpu="GPU-1",node="n1"} 1
`

func TestFromMetricsAttribution(t *testing.T) {
	const pods = `
gpudra_device_pod_info{claim="a",container="main",device="gpu-0",gpu="GPU-0",namespace="ns",node="n1",pod="p1"} 1
gpudra_device_pod_info{claim="a",container="side",device="gpu-0",gpu="GPU-0",namespace="ns",node="n1",pod="p1"} 1
gpudra_container_gpu_memory_used_bytes{container="main",device="gpu-0",gpu="GPU-0",namespace="ns",node="n1",pod="p1"} 2147483648
gpudra_container_gpu_sm_utilization_ratio{container="main",device="gpu-0",gpu="GPU-0",namespace="ns",node="n1",pod="p1"} 0.4
gpudra_container_gpu_processes{container="main",device="gpu-0",gpu="GPU-0",namespace="ns",node="n1",pod="p1"} 2
gpudra_unattributed_gpu_memory_used_bytes{device="gpu-0",gpu="GPU-0",node="n1"} 1048576
gpudra_unattributed_gpu_processes{device="gpu-0",gpu="GPU-0",node="n1"} 1
gpudra_unattributed_gpu_processes{device="gpu-1-mig-1g-10gb-6",gpu="GPU-1",node="n1"} 0
`
	two := 2.0
	one := 1.0
	for _, tc := range []struct {
		name      string
		scrape    string
		read      bool
		holders   []Holder
		processes []Process
		notes     []string
	}{
		{name: "no attribution series: the devices without processes", scrape: attributionScrape,
			holders: []Holder{{Claim: "ns/a"}}, notes: []string{"the plugin exports no process attribution: no processes shown"}},
		{name: "attribution down: nothing said about processes", scrape: attributionScrape + "gpudra_telemetry_attribution_up{node=\"n1\"} 0\n",
			holders: []Holder{{Claim: "ns/a"}}, notes: []string{"the plugin could not read the kubelet's pod-resources API: no processes shown"}},
		{name: "attribution up: pods under their claim, containers and what runs outside them",
			scrape: attributionScrape + pods + "gpudra_telemetry_attribution_up{node=\"n1\"} 1\ngpudra_telemetry_unresolved_processes{node=\"n1\"} 3\n",
			read:   true, holders: []Holder{{Claim: "ns/a", Pods: []string{"ns/p1/main", "ns/p1/side"}}},
			processes: []Process{
				{Unattributed: true, Count: &one, MemoryBytes: ptr(1 << 20)},
				{Container: "ns/p1/main", Count: &two, MemoryBytes: ptr(2 << 30), SMUtilization: ptr(0.4)},
			},
			notes: []string{"3 processes whose container could not be told: their devices' container figures are left out"}},
		{name: "device plugin mode: pods without a claim",
			scrape: strings.ReplaceAll(attributionScrape, `gpudra_device_claim_info{claim_name="a",claim_namespace="ns",claim_uid="u1",device="gpu-0",gpu="GPU-0",node="n1"} 1`, "") +
				`gpudra_device_pod_info{claim="",container="main",device="gpu-0",gpu="GPU-0",namespace="ns",node="n1",pod="p1"} 1` + "\ngpudra_telemetry_attribution_up{node=\"n1\"} 1\n",
			read: true, holders: []Holder{{Pods: []string{"ns/p1/main"}}}},
	} {
		// Today's plugins name the labels as dcgm-exporter does; a plugin
		// from before gave them names of its own, which top still reads.
		today := strings.NewReplacer(`device="`, `dra_device_name="`, `claim_name="`, `dra_claim_name="`,
			`claim_namespace="`, `dra_claim_namespace="`, `profile="`, `dra_mig_profile="`,
			`{claim="a",`, `{dra_claim_name="a",dra_claim_namespace="ns",`, `{claim="",`, `{`).Replace(tc.scrape)
		require.NotContains(t, today, `device="`)
		for names, scrape := range map[string]string{"dcgm-exporter's label names": today, "a plugin from before them": tc.scrape} {
			t.Run(tc.name+", "+names, func(t *testing.T) {
				fams, err := ParseMetrics(strings.NewReader(scrape))
				require.NoError(t, err)
				s := FromMetrics(fams, "http://n1:9477/metrics", at)
				require.Len(t, s.Devices, 2)
				d := s.Devices[0]
				assert.Equal(t, "gpu-0", d.Name)
				assert.Equal(t, "GPU-0", d.UUID)
				assert.Equal(t, tc.read, d.ProcessesRead)
				assert.Equal(t, tc.holders, d.Holders)
				assert.Equal(t, tc.processes, d.Processes)
				assert.Empty(t, s.Devices[1].Processes, "no process outside the MIG device's containers: no row")
				assert.Equal(t, "GPU-1", s.Devices[1].GPU)
				assert.Equal(t, tc.notes, s.Notes)
			})
		}
	}
}

func TestFromMachine(t *testing.T) {
	samples := []nvdevice.TelemetrySample{
		{UUID: "MIG-x", ParentUUID: "GPU-1", Minor: 1, MigProfile: "3g.40gb", MigStart: 4, ProductName: "H100",
			FramebufferUsedBytes: nvdevice.Read(1 << 30), FramebufferTotalBytes: nvdevice.Read(40 << 30),
			ProcessesRead: true, Processes: []nvdevice.ProcessSample{{PID: 77, UsedMemoryBytes: nvdevice.Read(1 << 30)}}},
		{UUID: "GPU-1", Minor: 1, ProductName: "H100", ProcessesRead: true},
		{UUID: "GPU-0", Minor: 0, ProductName: "H100", GPUUtilization: nvdevice.Read(0.9), PowerWatts: nvdevice.Read(400),
			ProcessesRead: true, Processes: []nvdevice.ProcessSample{
				{PID: 12, UsedMemoryBytes: nvdevice.Read(3 << 30), SMUtilization: nvdevice.Read(0.6)},
				{PID: 9, UsedMemoryBytes: nvdevice.Reading{}},
			}},
		{UUID: "GPU-2", Minor: 2, ProductName: "H100"}, // processes not read
	}
	users := map[int]string{12: "alice", 77: "bob"}
	userOf := func(pid int) string { return users[pid] }
	for _, tc := range []struct {
		name    string
		state   *local.State
		free    []*bool // per device, in order
		holders [][]Holder
		waiting []LocalWaiter
	}{
		{name: "no local state: nothing said about holders", free: []*bool{nil, nil, nil, nil}, holders: [][]Holder{nil, nil, nil, nil}},
		{name: "a local allocation of a MIG device: its GPU in use",
			state: &local.State{
				Allocations: []local.Allocation{{Request: local.Request{Name: "job", User: "bob", Holder: local.Holder{PID: 70}},
					Devices: []local.Device{{Name: "gpu-1-mig-3g-40gb-4", UUID: "MIG-x"}}}},
				Waiters: []local.Waiter{{Request: local.Request{Name: "next", User: "carol"}, QueuedAt: at}},
			},
			free:    []*bool{ptrBool(true), ptrBool(false), ptrBool(false), ptrBool(true)},
			holders: [][]Holder{nil, nil, {{Local: "job", User: "bob", PID: 70}}, nil},
			waiting: []LocalWaiter{{Name: "next", User: "carol", QueuedAt: at}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := FromMachine(samples, "n1", "sim", tc.state, userOf, at)
			var names []string
			for _, d := range s.Devices {
				names = append(names, d.Name)
			}
			require.Equal(t, []string{"gpu-0", "gpu-1", "gpu-1-mig-3g-40gb-4", "gpu-2"}, names)
			for i, d := range s.Devices {
				assert.Equal(t, tc.free[i], d.Free, d.Name)
				assert.Equal(t, tc.holders[i], d.Holders, d.Name)
			}
			assert.Equal(t, []Process{{PID: 9}, {PID: 12, User: "alice", MemoryBytes: ptr(3 << 30), SMUtilization: ptr(0.6)}}, s.Devices[0].Processes,
				"by PID; an unread memory reading stays unread")
			assert.Equal(t, []Process{{PID: 77, User: "bob", MemoryBytes: ptr(1 << 30)}}, s.Devices[2].Processes)
			assert.Nil(t, s.Devices[1].Utilization)
			assert.Equal(t, []string{"processes not readable on gpu-2"}, s.Notes)
			assert.Equal(t, tc.waiting, s.Waiting)
		})
	}
}

func ptrBool(b bool) *bool { return &b }

func TestTable(t *testing.T) {
	f, tr := ptrBool(false), ptrBool(true)
	for _, tc := range []struct {
		name string
		s    Snapshot
		want string
	}{
		{name: "unread readings are dashes, not zeros",
			s: Snapshot{Node: "n1", Source: "sim", At: at, Devices: []Device{{Name: "gpu-0"}}},
			want: "n1  sim  14:00:00\n" +
				"DEVICE  PROFILE  HOLDER  UTIL  SM-ACTIVE  MEMORY  POWER  TEMP\n" +
				"gpu-0   gpu      -       -     -          -       -      -\n"},
		{name: "a claim with its pods and their containers' processes",
			s: Snapshot{Node: "n1", Source: "http://n1:9477/metrics", At: at, Devices: []Device{
				{Name: "gpu-0", Free: f, Holders: []Holder{{Claim: "ns/a", Pods: []string{"ns/p/main"}}}, Utilization: ptr(0.87), SMActive: ptr(0.5),
					MemoryUsedBytes: ptr(20 << 30), MemoryTotalBytes: ptr(80 << 30), PowerWatts: ptr(412.4), TemperatureC: ptr(61), ProcessesRead: true,
					Processes: []Process{{Container: "ns/p/main", Count: ptr(2), MemoryBytes: ptr(19 << 30), SMUtilization: ptr(0.8)},
						{Unattributed: true, Count: ptr(1), MemoryBytes: ptr(1 << 30)}}},
				{Name: "gpu-1", Free: tr},
			}, Notes: []string{"something"}},
			want: "n1  http://n1:9477/metrics  14:00:00\n" +
				"DEVICE                      PROFILE  HOLDER                   UTIL  SM-ACTIVE  MEMORY        POWER  TEMP\n" +
				"gpu-0                       gpu      ns/a <- ns/p/main        87%   50%        20.0/80.0GiB  412W   61C\n" +
				"  container                          ns/p/main (2 processes)  80%              19.0GiB              \n" +
				"  (outside its containers)           (1 processes)            -                1.0GiB               \n" +
				"gpu-1                       gpu      free                     -     -          -             -      -\n" +
				"note: something\n"},
		{name: "local holders, processes with users, waiters",
			s: Snapshot{Node: "n1", Source: "nvml", At: at, Devices: []Device{
				{Name: "gpu-0", Free: f, Holders: []Holder{{Local: "job", User: "bob"}}, ProcessesRead: true,
					Processes: []Process{{PID: 12, User: "bob", MemoryBytes: ptr(1 << 30)}, {PID: 13}}},
			}, Waiting: []LocalWaiter{{Name: "next", User: "carol", QueuedAt: at}}},
			want: "n1  nvml  14:00:00\n" +
				"DEVICE    PROFILE  HOLDER           UTIL  SM-ACTIVE  MEMORY  POWER  TEMP\n" +
				"gpu-0     gpu      local job (bob)  -     -          -       -      -\n" +
				"  pid 12           bob              -                1.0GiB         \n" +
				"  pid 13           -                -                -              \n" +
				"\nWAITING (gpudra local)\n" +
				"NAME  USER   QUEUED               ERROR\n" +
				"next  carol  2026-11-27 14:00:00  \n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var b bytes.Buffer
			require.NoError(t, Table(&b, &tc.s))
			assert.Equal(t, tc.want, b.String())
		})
	}
}

func TestJSON(t *testing.T) {
	for _, tc := range []struct {
		name string
		s    Snapshot
		want string
	}{
		{name: "unread readings are absent",
			s:    Snapshot{Node: "n1", Source: "sim", At: at, Devices: []Device{{Name: "gpu-0"}}},
			want: `{"node":"n1","source":"sim","at":"2026-11-27T14:00:00Z","devices":[{"name":"gpu-0","processesRead":false}]}`},
		{name: "a zero reading is there",
			s: Snapshot{Source: "sim", At: at, Devices: []Device{{Name: "gpu-0", Utilization: ptr(0), Free: ptrBool(true), ProcessesRead: true,
				Processes: []Process{{PID: 5, User: "a", MemoryBytes: ptr(0)}}}}},
			want: `{"source":"sim","at":"2026-11-27T14:00:00Z","devices":[{"name":"gpu-0","free":true,"utilization":0,"processesRead":true,"processes":[{"pid":5,"user":"a","memoryBytes":0}]}]}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var b bytes.Buffer
			require.NoError(t, JSON(&b, &tc.s))
			assert.Equal(t, tc.want+"\n", b.String(), "one line per snapshot")
			var back Snapshot
			require.NoError(t, json.Unmarshal(b.Bytes(), &back))
			assert.Equal(t, tc.s.Devices, back.Devices, "programs read back what was shown")
		})
	}
}

func TestFromMetricsTelemetryDown(t *testing.T) {
	for _, tc := range []struct {
		name, scrape string
		want         []string
	}{
		{"up", `gpudra_telemetry_up{node="n1"} 1` + "\n" + `gpudra_telemetry_last_sample_age_seconds{node="n1"} 4` + "\n", nil},
		{"no read completed yet", `gpudra_telemetry_up{node="n1"} 0` + "\n",
			[]string{"the plugin's telemetry is down (no read completed yet, or the last failed): the device figures are missing"}},
		{"a read hangs", `gpudra_telemetry_up{node="n1"} 0` + "\n" + `gpudra_telemetry_last_sample_age_seconds{node="n1"} 80.4` + "\n",
			[]string{"the plugin's telemetry is down (the last read, 1m20s ago, failed, or a read hangs): the device figures are missing"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fams, err := ParseMetrics(strings.NewReader(tc.scrape + `gpudra_telemetry_attribution_up{node="n1"} 1` + "\n"))
			require.NoError(t, err)
			assert.Equal(t, tc.want, FromMetrics(fams, "n1", at).Notes)
		})
	}
}
