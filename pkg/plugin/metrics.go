package plugin

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Metrics are the plugin's Prometheus metrics, on their own registry so that
// tests and several plugins in one process do not collide.
type Metrics struct {
	Registry         *prometheus.Registry
	operations       *prometheus.CounterVec
	duration         *prometheus.HistogramVec
	devicesPublished prometheus.Gauge
	unhealthyGPUs    prometheus.Gauge
	mpsRestarts      *prometheus.CounterVec
}

// NewMetrics registers the plugin's metrics.
func NewMetrics() *Metrics {
	m := &Metrics{
		Registry: prometheus.NewRegistry(),
		operations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "gpudra", Subsystem: "plugin", Name: "claim_operations_total",
			Help: "Claims prepared or unprepared, by operation and result (success, error).",
		}, []string{"operation", "result"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "gpudra", Subsystem: "plugin", Name: "claim_operation_duration_seconds",
			Help:    "Time to prepare or unprepare one claim.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14),
		}, []string{"operation"}),
		devicesPublished: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "gpudra", Subsystem: "plugin", Name: "devices_published",
			Help: "Devices in the node's published ResourceSlices.",
		}),
		unhealthyGPUs: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "gpudra", Subsystem: "plugin", Name: "unhealthy_gpus",
			Help: "GPUs marked unhealthy (critical XID or lost).",
		}),
		mpsRestarts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "gpudra", Subsystem: "plugin", Name: "mps_daemon_restarts_total",
			Help: "MPS control daemons found dead and started again, by result (success, error).",
		}, []string{"result"}),
	}
	m.Registry.MustRegister(m.operations, m.duration, m.devicesPublished, m.unhealthyGPUs, m.mpsRestarts)
	return m
}

func (m *Metrics) mpsRestart(err error) {
	if m == nil {
		return
	}
	m.mpsRestarts.WithLabelValues(resultLabel(err)).Inc()
}

func resultLabel(err error) string {
	if err != nil {
		return "error"
	}
	return "success"
}

func (m *Metrics) observe(op string, start time.Time, err error) {
	if m == nil {
		return
	}
	m.operations.WithLabelValues(op, resultLabel(err)).Inc()
	m.duration.WithLabelValues(op).Observe(time.Since(start).Seconds())
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
	mux.Handle("/metrics", promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		if err := socketsAlive(sockets...); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	return mux
}

// Serve runs the metrics and health server until ctx is done.
func Serve(ctx context.Context, addr string, h http.Handler) error {
	srv := &http.Server{Addr: addr, Handler: h, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done()
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdown)
	}()
	if err := srv.ListenAndServe(); err != nil && err != http.ErrServerClosed {
		return fmt.Errorf("metrics server on %s: %w", addr, err)
	}
	return nil
}
