package deviceplugin

import (
	"fmt"
	"net"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpudra/gpudra/pkg/metrics"
)

// Results in the metrics' result label.
const (
	resultSuccess = "success"
	resultError   = "error"
)

// Metrics are the device plugin mode's Prometheus metrics, on the node
// agent's registry (the Go, process and build metrics of every component
// included), and its /healthz: every plugin's socket answers. A nil
// *Metrics records nothing.
type Metrics struct {
	Registry      *prometheus.Registry
	allocations   *prometheus.CounterVec
	registrations *prometheus.CounterVec
	devices       *prometheus.GaugeVec
	mpsRestarts   *prometheus.CounterVec

	mu      sync.Mutex
	sockets []string
}

// NewMetrics registers the device plugin metrics.
func NewMetrics() *Metrics {
	m := &Metrics{
		Registry: metrics.NewRegistry(metrics.ComponentKubeletPlugin),
		allocations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "device_plugin", Name: "allocations_total",
			Help: "Containers the kubelet asked devices for through Allocate, by resource and result (success, error).",
		}, []string{"resource", "result"}),
		registrations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "device_plugin", Name: "registrations_total",
			Help: "Registrations with the kubelet (one at start, one after every kubelet restart), by resource and result.",
		}, []string{"resource", "result"}),
		devices: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: metrics.Namespace, Subsystem: "device_plugin", Name: "devices",
			Help: "Device IDs advertised, by resource and health (healthy, unhealthy); replicas count one each.",
		}, []string{"resource", "health"}),
		mpsRestarts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "device_plugin", Name: "mps_daemon_restarts_total",
			Help: "MPS servers of shared GPUs found gone and started again, by result (success, error).",
		}, []string{"result"}),
	}
	m.Registry.MustRegister(m.allocations, m.registrations, m.devices, m.mpsRestarts)
	for _, r := range []string{resultSuccess, resultError} {
		m.mpsRestarts.WithLabelValues(r)
	}
	return m
}

func result(err error) string {
	if err != nil {
		return resultError
	}
	return resultSuccess
}

// resource makes every series of a resource exist from the start, at zero.
func (m *Metrics) resource(name string, healthy, unhealthy int) {
	if m == nil {
		return
	}
	for _, r := range []string{resultSuccess, resultError} {
		m.allocations.WithLabelValues(name, r)
		m.registrations.WithLabelValues(name, r)
	}
	m.setDevices(name, healthy, unhealthy)
}

func (m *Metrics) setDevices(name string, healthy, unhealthy int) {
	if m == nil {
		return
	}
	m.devices.WithLabelValues(name, "healthy").Set(float64(healthy))
	m.devices.WithLabelValues(name, "unhealthy").Set(float64(unhealthy))
}

func (m *Metrics) allocated(name string, err error) {
	if m == nil {
		return
	}
	m.allocations.WithLabelValues(name, result(err)).Inc()
}

func (m *Metrics) registered(name string, err error) {
	if m == nil {
		return
	}
	m.registrations.WithLabelValues(name, result(err)).Inc()
}

func (m *Metrics) mpsRestarted(err error) {
	if m == nil {
		return
	}
	m.mpsRestarts.WithLabelValues(result(err)).Inc()
}

// serving records the plugins' sockets for /healthz.
func (m *Metrics) serving(sockets []string) {
	if m == nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.sockets = slices.Clone(sockets)
}

// Healthz dials every plugin's socket: nil while none is served yet (the
// agent is starting, or has nothing to advertise). The kubelet removes
// the sockets when it restarts; the plugins serve again within a poll
// interval, so a failure that lasts is a plugin that stopped serving.
func (m *Metrics) Healthz() error {
	m.mu.Lock()
	sockets := slices.Clone(m.sockets)
	m.mu.Unlock()
	for _, s := range sockets {
		conn, err := net.DialTimeout("unix", s, time.Second)
		if err != nil {
			return fmt.Errorf("device plugin socket %s: %w", s, err)
		}
		_ = conn.Close()
	}
	return nil
}

// Handler serves /metrics and /healthz.
func (m *Metrics) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", metrics.Handler(m.Registry))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		if err := m.Healthz(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	return mux
}
