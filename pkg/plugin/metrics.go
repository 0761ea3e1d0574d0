package plugin

import (
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpudra/gpudra/pkg/metrics"
	"github.com/gpudra/gpudra/pkg/plugin/checkpoint"
	"github.com/gpudra/gpudra/pkg/prepared"
)

// Operations in the plugin's metric labels.
const (
	opPrepare   = "prepare"
	opUnprepare = "unprepare"
)

// Metrics are the plugin's Prometheus metrics, on their own registry so that
// tests and several plugins in one process do not collide.
type Metrics struct {
	Registry         *prometheus.Registry
	operations       *prometheus.CounterVec
	duration         *prometheus.HistogramVec
	prepareSteps     *prometheus.HistogramVec
	inFlight         *prometheus.GaugeVec
	preparedClaims   prometheus.Gauge
	devicesPublished prometheus.Gauge
	unhealthyGPUs    prometheus.Gauge
	mpsRestarts      *prometheus.CounterVec
	slicesDeleted    prometheus.Counter
}

// NewMetrics registers the plugin's metrics, with the Go, process and build
// metrics every gpudra component exports.
func NewMetrics() *Metrics {
	m := &Metrics{
		Registry: metrics.NewRegistry(metrics.ComponentKubeletPlugin),
		operations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "plugin", Name: "claim_operations_total",
			Help: "Claims prepared or unprepared, by operation and result (success, error).",
		}, []string{"operation", "result"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: metrics.Namespace, Subsystem: "plugin", Name: "claim_operation_duration_seconds",
			Help:    "Time to prepare or unprepare one claim, waiting for the node lock included.",
			Buckets: metrics.DurationBuckets,
		}, []string{"operation"}),
		prepareSteps: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: metrics.Namespace, Subsystem: "plugin", Name: "prepare_step_duration_seconds",
			Help:    "Time of each step of a claim's prepare that got that far: lock (the node lock and checkpoint load), inventory, plan, mig, sharing, cdi, checkpoint.",
			Buckets: PrepareStepBuckets,
		}, []string{"step"}),
		inFlight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: metrics.Namespace, Subsystem: "plugin", Name: "operations_in_flight",
			Help: "Claims being prepared or unprepared now, by operation.",
		}, []string{"operation"}),
		preparedClaims: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: metrics.Namespace, Subsystem: "plugin", Name: "prepared_claims",
			Help: "Claims prepared on the node, as of the plugin's last look at the node state.",
		}),
		devicesPublished: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: metrics.Namespace, Subsystem: "plugin", Name: "devices_published",
			Help: "Devices in the node's published ResourceSlices.",
		}),
		unhealthyGPUs: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: metrics.Namespace, Subsystem: "plugin", Name: "unhealthy_gpus",
			Help: "GPUs marked unhealthy (critical XID or lost).",
		}),
		mpsRestarts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "plugin", Name: "mps_daemon_restarts_total",
			Help: "MPS control daemons found dead and started again, by result (success, error).",
		}, []string{"result"}),
		slicesDeleted: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "plugin", Name: "resourceslices_deleted_total",
			Help: "The node's ResourceSlices seen deleted (a starting kubelet deletes them all), each followed by a publish.",
		}),
	}
	m.Registry.MustRegister(m.operations, m.duration, m.prepareSteps, m.inFlight, m.preparedClaims, m.devicesPublished, m.unhealthyGPUs, m.mpsRestarts, m.slicesDeleted)
	// Every series exists from the start, at zero: an error-rate alert
	// then has something to compute before the first error, and a
	// dashboard shows 0 instead of "no data".
	for _, op := range []string{opPrepare, opUnprepare} {
		m.inFlight.WithLabelValues(op)
		m.duration.WithLabelValues(op)
		for _, r := range []string{"success", "error"} {
			m.operations.WithLabelValues(op, r)
		}
	}
	return m
}

func (m *Metrics) mpsRestart(err error) {
	if m == nil {
		return
	}
	m.mpsRestarts.WithLabelValues(resultLabel(err)).Inc()
}

func (m *Metrics) sliceWipe() {
	if m == nil {
		return
	}
	m.slicesDeleted.Inc()
}

func resultLabel(err error) string {
	if err != nil {
		return "error"
	}
	return "success"
}

// PrepareStepBuckets are the prepare steps' histogram buckets: 50 µs to
// about 1.6 s, doubling; a step of a prepare is sub-millisecond on a quiet
// node, and a MIG creation or an MPS start-up takes up to seconds.
var PrepareStepBuckets = prometheus.ExponentialBuckets(0.00005, 2, 16)

// onPrepareStep is the node state's hook for the prepare steps' histogram;
// nil without metrics.
func (m *Metrics) onPrepareStep() func(string, time.Duration) {
	if m == nil {
		return nil
	}
	return func(step string, d time.Duration) { m.prepareSteps.WithLabelValues(step).Observe(d.Seconds()) }
}

// begin counts a claim operation in flight until its observe, and returns
// its start.
func (m *Metrics) begin(op string) time.Time {
	if m != nil {
		m.inFlight.WithLabelValues(op).Inc()
	}
	return time.Now()
}

// observe ends a claim operation that begin started.
func (m *Metrics) observe(op string, start time.Time, err error) {
	if m == nil {
		return
	}
	m.inFlight.WithLabelValues(op).Dec()
	m.operations.WithLabelValues(op, resultLabel(err)).Inc()
	m.duration.WithLabelValues(op).Observe(time.Since(start).Seconds())
}

// onPreparedClaims is the node state's hook for the prepared claims gauge;
// nil without metrics, so that the state does not count for nobody.
func (m *Metrics) onPreparedClaims() func(int) {
	if m == nil {
		return nil
	}
	return func(n int) { m.preparedClaims.Set(float64(n)) }
}

// countPrepared counts the claims whose prepare completed. The node state
// calls it under the node lock on the checkpoint it holds in memory: a
// gauge that costs no disk read, and a loop over at most a few hundred
// claims.
func countPrepared(cp *checkpoint.Checkpoint) int {
	n := 0
	for _, c := range cp.Claims {
		if c.State == prepared.PrepareCompleted {
			n++
		}
	}
	return n
}

// socketsAlive dials the plugin's sockets: the liveness check is that the
// kubelet could reach the plugin, not that the process runs.
func socketsAlive(sockets ...string) error {
	for _, s := range sockets {
		conn, err := net.DialTimeout("unix", s, time.Second)
		if err != nil {
			return fmt.Errorf("socket %s: %w", s, err)
		}
		conn.Close()
	}
	return nil
}

// Handler serves /metrics and /healthz.
func (m *Metrics) Handler(sockets ...string) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", metrics.Handler(m.Registry))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		if err := socketsAlive(sockets...); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	return mux
}
