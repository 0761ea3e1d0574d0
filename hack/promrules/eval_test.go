package promrules

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/klog/v2"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/gpudra/gpudra/pkg/controller/gang"
	"github.com/gpudra/gpudra/pkg/deviceplugin"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/plugin"
	"github.com/gpudra/gpudra/pkg/prepared"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
	"github.com/gpudra/gpudra/pkg/telemetry"
)

// node is one simulated GPU node and its kubelet plugin's registry, as
// the plugin binary builds it: the mode's metrics, the device telemetry
// and the health metrics.
type node struct {
	name   string
	dra    bool
	m      *sim.Machine
	gpus   []nvdevice.GPU
	rd     *reader
	tel    *telemetry.Collector
	health *telemetry.HealthMetrics
	reg    *prometheus.Registry
	kube   *kubelet
	target map[string]string
	// clock is the collector's: the timeline's time at each scrape.
	clock *clocktesting.FakeClock

	mu     sync.Mutex
	claims []prepared.Claim // DRA mode: what the plugin prepared
}

func newNode(t *testing.T, ctx context.Context, name string, dra bool) *node {
	t.Helper()
	m, err := sim.NewBuiltin("dgx-h100-nomig", name)
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Close() })
	inv, err := m.Inventory(ctx)
	require.NoError(t, err)
	n := &node{name: name, dra: dra, m: m, gpus: inv.GPUs, rd: newReader(t, m), kube: newKubelet(t), clock: clocktesting.NewFakeClock(base)}
	n.tel = telemetry.NewCollector(n.rd, name, scrapeInterval)
	n.tel.SetClock(n.clock)
	n.tel.SetAttribution(n.kube.cfg) // in both modes, as the plugin binary does
	n.health = telemetry.NewHealthMetrics(name, inv.GPUs)
	require.NoError(t, telemetry.FollowHealth(ctx, m, n.health, nvdevice.DefaultXIDPolicy))
	if dra {
		n.reg = plugin.NewMetrics().Registry
		n.tel.SetClaims(func() []prepared.Claim {
			n.mu.Lock()
			defer n.mu.Unlock()
			return slices.Clone(n.claims)
		})
		n.target = targetLabels(name, "gpudra-kubelet-plugin-metrics")
	} else {
		n.reg = deviceplugin.NewMetrics().Registry
		n.target = targetLabels(name, "gpudra-kubelet-plugin-metrics")
	}
	n.reg.MustRegister(n.tel, n.health)
	return n
}

func (n *node) gpu(i int) nvdevice.GPU { return n.gpus[i] }

// sample runs the sampler's pass at the timeline's time at, as the
// plugin's sampler would, and returns when it completed or hangs in the
// reader (the next passes then return at once: one read at a time).
func (n *node) sample(ctx context.Context, at time.Duration) {
	n.clock.SetTime(base.Add(at))
	done := make(chan struct{})
	go func() { defer close(done); n.tel.Sample(ctx) }()
	select {
	case <-done:
	case <-n.rd.hung:
	}
}

// claim prepares a claim of ns/name on GPU i (DRA mode).
func (n *node) claim(i int, ns, name string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	g := n.gpu(i)
	n.claims = append(n.claims, prepared.Claim{UID: "uid-" + name, Namespace: ns, Name: name, State: prepared.PrepareCompleted,
		Devices: []prepared.Device{{Device: telemetryDeviceName(g), UUID: g.UUID, GPUUUID: g.UUID}}})
}

func telemetryDeviceName(g nvdevice.GPU) string {
	return telemetry.DeviceName(&nvdevice.TelemetrySample{UUID: g.UUID, Minor: g.Minor})
}

// claimedBy runs a container of pod ns/pod that uses claim on GPU i (DRA
// mode): the kubelet lists the claim's device on it.
func (n *node) claimedBy(t *testing.T, i int, ns, pod, name, claim string) container {
	return n.kube.run(t, ns, pod, name, nil, []*podresourcesv1.DynamicResource{{ClaimName: claim, ClaimNamespace: ns,
		ClaimResources: []*podresourcesv1.ClaimResource{{DriverName: slicebuilder.DriverName, PoolName: n.name, DeviceName: telemetryDeviceName(n.gpu(i))}}}})
}

// allocatedTo runs a container of pod ns/pod that the device plugin gave
// GPU i (device plugin mode).
func (n *node) allocatedTo(t *testing.T, i int, ns, pod, name string) container {
	return n.kube.run(t, ns, pod, name, []*podresourcesv1.ContainerDevices{{ResourceName: deviceplugin.DefaultGPUResourceName, DeviceIds: []string{n.gpu(i).UUID}}}, nil)
}

// start starts (or, for a PID already on the GPU, changes) process pid of
// c on GPU i in the simulator, keeping smShare of its SMs busy and holding
// memoryBytes.
func (n *node) start(t *testing.T, i, pid int, c container, smShare float64, memoryBytes uint64) {
	n.kube.process(t, pid, c)
	require.NoError(t, n.m.StartProcess(n.gpu(i).UUID, pid, smShare, memoryBytes))
}

// ecc counts uncorrected ECC errors on GPU i in the simulated driver.
func (n *node) ecc(t *testing.T, i int, uncorrected uint64) {
	require.NoError(t, n.m.InjectECC(n.gpu(i).UUID, 0, uncorrected))
}

// xid injects an XID through the simulated driver and waits until the
// health metrics counted it.
func (n *node) xid(t *testing.T, i int, xid uint64) {
	t.Helper()
	before := sumOf(t, n.reg, "gpudra_gpu_xid_errors_total")
	require.NoError(t, n.m.InjectXID(n.gpu(i).UUID, "", xid))
	require.Eventually(t, func() bool { return sumOf(t, n.reg, "gpudra_gpu_xid_errors_total") == before+1 },
		5*time.Second, time.Millisecond, "the health metrics count the XID")
}

// run is one Prometheus's view of a small cluster: node-a in DRA mode,
// node-b in device plugin mode, and the controller's per-class gauges.
type run struct {
	a, b *node
	ctl  *prometheus.Registry
	// The workloads' containers and their processes' PIDs (fake, in each
	// node's fake /proc).
	trainer, server container
}

const (
	pidTrainer = 4100 // team-a's trainer on node-a's gpu-2
	pidServer  = 4200 // team-b's server on node-b's gpu-4
)

func newRun(t *testing.T, ctx context.Context) *run {
	r := &run{a: newNode(t, ctx, "node-a", true), b: newNode(t, ctx, "node-b", false), ctl: prometheus.NewRegistry()}
	// The healthy baseline: a claim of team-a, prepared on node-a's gpu-2,
	// whose pod's container trains on it; a pod of team-b whose container
	// node-b's device plugin gave gpu-4 keeps it 90% busy.
	r.a.claim(2, "team-a", "train")
	r.trainer = r.a.claimedBy(t, 2, "team-a", "train-0", "trainer", "train")
	r.a.start(t, 2, pidTrainer, r.trainer, 0.6, 20<<30)
	r.server = r.b.allocatedTo(t, 4, "team-b", "infer-0", "server")
	r.b.start(t, 4, pidServer, r.server, 0.9, 10<<30)

	// The controller's leader: the gang controller's per-class gauges,
	// stood in for (driving the controller to these counts takes
	// ResourceSlices, DeviceClasses, claims and pods), by its own metrics'
	// names and label names, and its demand sources' values.
	devices := standIn(t, "gpudra_class_devices", "device_class", "node_pool", "state")
	demand := standIn(t, "gpudra_class_demand_devices", "device_class", "node_pool", "source")
	r.ctl.MustRegister(devices, demand)
	for _, d := range []struct {
		pool, state string
		v           float64
	}{{"pool-1", "free", 10}, {"pool-1", "allocated", 5}, {"pool-1", "held", 1}, {"pool-2", "free", 0}, {"pool-2", "allocated", 8}, {"pool-2", "held", 0}} {
		devices.WithLabelValues("gpu.gpudra.dev", d.pool, d.state).Set(d.v)
	}
	demand.WithLabelValues("gpu.gpudra.dev", "pool-1", gang.DemandPendingPods).Set(3)
	demand.WithLabelValues("gpu.gpudra.dev", "pool-2", gang.DemandGangs).Set(4)
	demand.WithLabelValues("gpu.gpudra.dev", "pool-2", gang.DemandReservations).Set(0)
	return r
}

// standIn is a gauge vector named as one of the controller's metrics,
// after checking that the real controller describes it with these label
// names: a rename in pkg/controller/gang fails here.
func standIn(t *testing.T, name string, labelNames ...string) *prometheus.GaugeVec {
	t.Helper()
	got, ok := controllerLabels(t)[name]
	require.True(t, ok, "the controller describes no %s", name)
	require.Equal(t, labelNames, got, "%s's label names", name)
	return prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: "test"}, labelNames)
}

// adjustment edits a scrape of one node at a time since the start: what a
// failing plugin would have counted.
type adjustment func(at time.Duration, node string, s []sample)

// set sets the value of the node's series of name whose labels include
// match.
func set(s []sample, name string, match map[string]string, v float64) {
	for i := range s {
		if s[i].lset.Get(labels.MetricName) != name {
			continue
		}
		ok := true
		for k, want := range match {
			ok = ok && s[i].lset.Get(k) == want
		}
		if ok {
			s[i].v = v
		}
	}
}

func minutesSince(at, from time.Duration) float64 {
	if at < from {
		return 0
	}
	return (at - from).Minutes()
}

func bit(name string) float64 {
	for _, r := range nvdevice.ThrottleReasons {
		if r.Name == name {
			return float64(r.Bit)
		}
	}
	panic("no throttle reason " + name)
}

type scenario struct {
	name string
	// setup runs before the first scrape (what happened before this
	// Prometheus started).
	setup func(t *testing.T, r *run)
	// at runs before the scrape at that time.
	at     map[time.Duration]func(t *testing.T, r *run)
	adjust adjustment
	// want: the alerts that fire at some evaluation, by alertKey; none
	// other may.
	want  []string
	check func(t *testing.T, ev evaluation)
}

// timelineEnd: long enough for the idle alert (an hour, then for: 1h).
const timelineEnd = 130 * time.Minute

func (sc scenario) run(t *testing.T) evaluation {
	// The collector logs each failed read; the telemetry-down case has
	// hundreds.
	ctx, cancel := context.WithCancel(klog.NewContext(context.Background(), logr.Discard()))
	t.Cleanup(cancel)
	r := newRun(t, ctx)
	if sc.setup != nil {
		sc.setup(t, r)
	}
	var tl timeline
	for at := time.Duration(0); at <= timelineEnd; at += scrapeInterval {
		if f := sc.at[at]; f != nil {
			f(t, r)
		}
		for _, n := range []*node{r.a, r.b} {
			n.sample(ctx, at)
			s := scrape(t, n.reg, n.target)
			if sc.adjust != nil {
				sc.adjust(at, n.name, s)
			}
			tl.add(at, n.name, s)
		}
		tl.add(at, "controller", scrape(t, r.ctl, map[string]string{"job": "gpudra-controller-metrics", "instance": "10.0.1.1:9478", "namespace": "gpudra", "pod": "gpudra-controller-0"}))
	}
	ev := evaluate(t, &tl, timelineEnd)
	var fired []string
	for k := range ev.fired {
		fired = append(fired, k)
	}
	slices.Sort(fired)
	want := slices.Clone(sc.want)
	slices.Sort(want)
	assert.Equal(t, want, fired, "alerts fired")
	return ev
}

func TestRulesOverScrapes(t *testing.T) {
	// The simulator has no thermal throttling: the reader sets the reason.
	thermal := func(on bool) func(t *testing.T, r *run) {
		return func(t *testing.T, r *run) {
			r.a.rd.set(false, r.a.gpu(2).UUID, func(s *nvdevice.TelemetrySample) {
				if on {
					s.ClockEventReasons = nvdevice.Read(bit("hw_thermal_slowdown"))
				}
			})
		}
	}
	ecc := func(i int, n uint64) func(t *testing.T, r *run) {
		return func(t *testing.T, r *run) { r.a.ecc(t, i, n) }
	}
	for _, sc := range []scenario{
		{name: "healthy: nothing fires", check: func(t *testing.T, ev evaluation) {
			checkHealthyRecords(t, ev)
			checkDCGMDocQueries(t, ev)
		}},

		// XIDs.
		{name: "an application XID on a claimed GPU (DRA)",
			at:   map[time.Duration]func(*testing.T, *run){20 * time.Minute: func(t *testing.T, r *run) { r.a.xid(t, 2, 13) }},
			want: []string{`GpudraXIDOnGPUInUse{dra_device_name="gpu-2",node="node-a",xid="13"}`}},
		{name: "a critical XID on a claimed GPU: it is unhealthy too",
			at:   map[time.Duration]func(*testing.T, *run){20 * time.Minute: func(t *testing.T, r *run) { r.a.xid(t, 2, 79) }},
			want: []string{`GpudraXIDOnGPUInUse{dra_device_name="gpu-2",node="node-a",xid="79"}`, `GpudraUnhealthyGPUInUse{dra_device_name="gpu-2",node="node-a"}`},
			check: func(t *testing.T, ev evaluation) {
				assert.Equal(t, 1.0, one(t, ev, "cluster:gpudra_gpus_unhealthy:count"))
			}},
		{name: "a critical XID on a free GPU",
			at: map[time.Duration]func(*testing.T, *run){20 * time.Minute: func(t *testing.T, r *run) { r.a.xid(t, 5, 79) }}},
		{name: "an XID on a GPU a container holds (device plugin mode)",
			at:   map[time.Duration]func(*testing.T, *run){20 * time.Minute: func(t *testing.T, r *run) { r.b.xid(t, 4, 13) }},
			want: []string{`GpudraXIDOnGPUInUse{dra_device_name="gpu-4",node="node-b",xid="13"}`}},
		{name: "an XID on a GPU no container holds (device plugin mode)",
			at: map[time.Duration]func(*testing.T, *run){20 * time.Minute: func(t *testing.T, r *run) { r.b.xid(t, 6, 13) }}},
		{name: "XIDs counted before Prometheus started: their series appear at 3",
			setup: func(t *testing.T, r *run) {
				for range 3 {
					r.a.xid(t, 2, 13)
					r.b.xid(t, 4, 13)
				}
			}},
		{name: "one more XID of a code counted before Prometheus started",
			setup: func(t *testing.T, r *run) { r.a.xid(t, 2, 13) },
			at:    map[time.Duration]func(*testing.T, *run){40 * time.Minute: func(t *testing.T, r *run) { r.a.xid(t, 2, 13) }},
			want:  []string{`GpudraXIDOnGPUInUse{dra_device_name="gpu-2",node="node-a",xid="13"}`}},

		// ECC.
		{name: "uncorrected ECC errors on a claimed GPU",
			at:   map[time.Duration]func(*testing.T, *run){20 * time.Minute: ecc(2, 2)},
			want: []string{`GpudraUncorrectedECCOnGPUInUse{dra_device_name="gpu-2",node="node-a"}`}},
		{name: "uncorrected ECC errors on a free GPU",
			at: map[time.Duration]func(*testing.T, *run){20 * time.Minute: ecc(5, 2)}},
		{name: "uncorrected ECC errors counted before Prometheus started",
			setup: func(t *testing.T, r *run) { ecc(2, 4)(t, r) }},

		// Throttling.
		{name: "thermal throttling for an hour",
			at:   map[time.Duration]func(*testing.T, *run){20 * time.Minute: thermal(true), 80 * time.Minute: thermal(false)},
			want: []string{`GpudraGPUThrottled{dra_device_name="gpu-2",node="node-a",reason="hw_thermal_slowdown"}`}},
		{name: "thermal throttling for six minutes",
			at: map[time.Duration]func(*testing.T, *run){20 * time.Minute: thermal(true), 26 * time.Minute: thermal(false)}},

		// Idle claims.
		{name: "a claimed GPU idle for two hours (DRA)",
			setup: func(t *testing.T, r *run) { r.a.start(t, 2, pidTrainer, r.trainer, 0, 20<<30) },
			want:  []string{`GpudraClaimedGPUIdle{dra_device_name="gpu-2",node="node-a"}`}},
		{name: "a GPU a container holds idle for two hours (device plugin mode)",
			setup: func(t *testing.T, r *run) { r.b.start(t, 4, pidServer, r.server, 0, 10<<30) },
			want:  []string{`GpudraClaimedGPUIdle{dra_device_name="gpu-4",node="node-b"}`}},
		{name: "a claimed GPU idle for 50 minutes, then busy",
			setup: func(t *testing.T, r *run) { r.a.start(t, 2, pidTrainer, r.trainer, 0, 20<<30) },
			at: map[time.Duration]func(*testing.T, *run){50 * time.Minute: func(t *testing.T, r *run) {
				r.a.start(t, 2, pidTrainer, r.trainer, 0.5, 20<<30)
			}}},

		// Telemetry.
		{name: "the GPUs cannot be read",
			at:   map[time.Duration]func(*testing.T, *run){20 * time.Minute: func(t *testing.T, r *run) { r.a.rd.set(true, "", nil) }},
			want: []string{`GpudraTelemetryDown{node="node-a"}`}},
		{name: "a read hangs in the driver",
			at:   map[time.Duration]func(*testing.T, *run){20 * time.Minute: func(t *testing.T, r *run) { r.a.rd.hang() }},
			want: []string{`GpudraTelemetryStale{node="node-a"}`},
			check: func(t *testing.T, ev evaluation) {
				assert.Empty(t, ev.query(`gpudra_gpu_utilization_ratio{node="node-a"}`, timelineEnd), "no frozen figures")
				assert.Len(t, ev.query(`gpudra_gpu_utilization_ratio{node="node-b"}`, timelineEnd), 8)
			}},
		{name: "a claimed GPU idle for 50 minutes, then its read hangs",
			setup: func(t *testing.T, r *run) { r.a.start(t, 2, pidTrainer, r.trainer, 0, 20<<30) },
			at:    map[time.Duration]func(*testing.T, *run){50 * time.Minute: func(t *testing.T, r *run) { r.a.rd.hang() }},
			want:  []string{`GpudraTelemetryStale{node="node-a"}`}},
		// The idle alert's own guard: figures a plugin still sends while
		// it says they are not up are not judged.
		{name: "a claimed GPU idle for two hours, its figures not up after 30 minutes",
			setup: func(t *testing.T, r *run) { r.a.start(t, 2, pidTrainer, r.trainer, 0, 20<<30) },
			adjust: func(at time.Duration, n string, s []sample) {
				if n == "node-a" && at >= 30*time.Minute {
					set(s, "gpudra_telemetry_up", nil, 0)
				}
			},
			want: []string{`GpudraTelemetryDown{node="node-a"}`}},
		{name: "the pod-resources API cannot be read",
			at: map[time.Duration]func(*testing.T, *run){20 * time.Minute: func(t *testing.T, r *run) {
				r.b.kube.setDown(true)
			}},
			want: []string{`GpudraAttributionDown{node="node-b"}`}},

		// The plugin's operations.
		{name: "a third of the prepares fail",
			adjust: func(at time.Duration, n string, s []sample) {
				if n == "node-a" {
					set(s, "gpudra_plugin_claim_operations_total", map[string]string{"operation": "prepare", "result": "success"}, 10*minutesSince(at, 0))
					set(s, "gpudra_plugin_claim_operations_total", map[string]string{"operation": "prepare", "result": "error"}, 5*minutesSince(at, 20*time.Minute))
				}
			},
			want: []string{`GpudraPrepareErrors{node="node-a"}`}},
		{name: "prepares take 30 to 60 s",
			adjust: func(at time.Duration, n string, s []sample) {
				if n != "node-b" {
					for _, le := range []string{"60", "120", "300", "+Inf"} {
						set(s, "gpudra_plugin_claim_operation_duration_seconds_bucket", map[string]string{"operation": "prepare", "le": le}, minutesSince(at, 20*time.Minute))
					}
					set(s, "gpudra_plugin_claim_operation_duration_seconds_count", map[string]string{"operation": "prepare"}, minutesSince(at, 20*time.Minute))
				}
			},
			want: []string{`GpudraPrepareSlow{node="node-a"}`}},
		{name: "a prepare never finishes",
			adjust: func(at time.Duration, n string, s []sample) {
				if n == "node-a" && at >= 20*time.Minute {
					set(s, "gpudra_plugin_operations_in_flight", map[string]string{"operation": "prepare"}, 1)
				}
			},
			want: []string{`GpudraOperationStuck{node="node-a"}`}},
		{name: "the plugin counts an unhealthy GPU",
			adjust: func(at time.Duration, n string, s []sample) {
				if n == "node-a" && at >= 20*time.Minute {
					set(s, "gpudra_plugin_unhealthy_gpus", nil, 1)
				}
			},
			want: []string{`GpudraUnhealthyGPUs{node="node-a"}`}},
		{name: "an MPS server could not be restarted (device plugin mode)",
			adjust: func(at time.Duration, n string, s []sample) {
				if n == "node-b" && at >= 30*time.Minute {
					set(s, "gpudra_device_plugin_mps_daemon_restarts_total", map[string]string{"result": "error"}, 1)
				}
			},
			want: []string{`GpudraMPSRestartFailures{node="node-b"}`}},
	} {
		t.Run(sc.name, func(t *testing.T) {
			ev := sc.run(t)
			if sc.check != nil {
				sc.check(t, ev)
			}
		})
	}
}

// one is the single value of a recorded series at the end.
func one(t *testing.T, ev evaluation, expr string) float64 {
	t.Helper()
	v := ev.query(expr, timelineEnd)
	require.Len(t, v, 1, expr)
	return v[0].F
}

// byLabel is a recorded series' values at the end, by one label.
func byLabel(t *testing.T, ev evaluation, expr, label string) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	for _, s := range ev.query(expr, timelineEnd) {
		out[s.Metric.Get(label)] = s.F
	}
	return out
}

func checkHealthyRecords(t *testing.T, ev evaluation) {
	for expr, want := range map[string]float64{
		"cluster:gpudra_gpus:count":           16,
		"cluster:gpudra_gpus_in_use:count":    2, // node-a gpu-2 by its claim, node-b gpu-4 by its container
		"cluster:gpudra_gpus_free:count":      14,
		"cluster:gpudra_gpus_busy:count":      2,
		"cluster:gpudra_gpus_unhealthy:count": 0,
	} {
		assert.Equal(t, want, one(t, ev, expr), expr)
	}
	assert.Equal(t, map[string]float64{"team-a": 1, "team-b": 1}, byLabel(t, ev, "namespace:gpudra_devices_held:count", "namespace"),
		"devices per namespace: team-a's through its claim, team-b's through its container; never the plugin pod's namespace")
	assert.Equal(t, map[string]float64{"team-a": 20 << 30, "team-b": 10 << 30}, byLabel(t, ev, "namespace:gpudra_container_gpu_memory_used_bytes:sum", "namespace"))
	assert.Equal(t, map[string]float64{"team-a": 0.6, "team-b": 0.9}, byLabel(t, ev, "namespace:gpudra_container_gpu_sm_utilization_ratio:sum", "namespace"))
	for expr, want := range map[string]float64{
		"device_class:gpudra_class_devices_capacity:sum":  24,
		"device_class:gpudra_class_devices_allocated:sum": 13,
		"device_class:gpudra_class_devices_held:sum":      1,
		"device_class:gpudra_class_devices_free:sum":      10,
		"device_class:gpudra_class_demand_devices:sum":    7,
	} {
		assert.Equal(t, map[string]float64{"gpu.gpudra.dev": want}, byLabel(t, ev, expr, "device_class"), expr)
	}
	assert.Equal(t, map[string]float64{"pending_pods": 3, "gangs": 4, "reservations": 0},
		byLabel(t, ev, `device_class_source:gpudra_class_demand_devices:sum{device_class="gpu.gpudra.dev"}`, "source"))
	// Device-hours as docs/metrics.md says to compute them: over the last
	// hour, each namespace held one device all along.
	hours := byLabel(t, ev, "sum_over_time(namespace:gpudra_devices_held:count[1h:1m]) / 60", "namespace")
	for _, ns := range []string{"team-a", "team-b"} {
		assert.InDelta(t, 1.0, hours[ns], 0.02, "device-hours of %s", ns)
	}
	assert.False(t, strings.Contains(strings.Join(keys(hours), ","), "gpudra"))
}

func keys(m map[string]float64) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// docQueries are the queries of the first promql block of the section
// of docs/metrics.md with that heading: each starts after a comment line
// and runs to the next comment or the block's end.
func docQueries(t *testing.T, heading string) []string {
	t.Helper()
	doc := string(readFile(t, metricsDoc))
	_, section, ok := strings.Cut(doc, "\n"+heading+"\n")
	require.True(t, ok, "docs/metrics.md has %q", heading)
	_, block, ok := strings.Cut(section, "```promql\n")
	require.True(t, ok, "%s has a promql block", heading)
	block, _, ok = strings.Cut(block, "```")
	require.True(t, ok)
	var out []string
	var cur []string
	flush := func() {
		if len(cur) > 0 {
			out = append(out, strings.Join(cur, " "))
			cur = nil
		}
	}
	for _, l := range strings.Split(block, "\n") {
		switch l = strings.TrimSpace(l); {
		case strings.HasPrefix(l, "#"):
			flush()
		case l != "":
			cur = append(cur, l)
		}
	}
	flush()
	return out
}

// checkDCGMDocQueries runs docs/metrics.md's queries written with
// dcgm-exporter's labels over the healthy timeline: the memory of
// team-a's trainer (its claim on node-a's gpu-2) and of team-b's server
// (node-b's device plugin gave it gpu-4), and the utilization of the one
// claim's GPU.
func checkDCGMDocQueries(t *testing.T, ev evaluation) {
	qs := docQueries(t, "### dcgm-exporter's label names")
	require.Len(t, qs, 2, "%q", qs)
	byPod := map[string]float64{}
	for _, s := range ev.query(qs[0], timelineEnd) {
		byPod[s.Metric.Get("namespace")+"/"+s.Metric.Get("pod")] = s.F
	}
	assert.Equal(t, map[string]float64{"team-a/train-0": 20 << 30, "team-b/infer-0": 10 << 30}, byPod, qs[0])
	byClaim := map[string]float64{}
	for _, s := range ev.query(qs[1], timelineEnd) {
		byClaim[s.Metric.Get("dra_claim_namespace")+"/"+s.Metric.Get("dra_claim_name")] = s.F
	}
	assert.Equal(t, map[string]float64{"team-a/train": 0.6}, byClaim, qs[1])
}
