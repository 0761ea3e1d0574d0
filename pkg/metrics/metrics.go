// Package metrics is what every gpudra binary exports besides its own
// measurements: the Go runtime and process metrics, gpudra_build_info, and
// the /metrics handler.
//
// There is no global registry. Each component builds its own with
// NewRegistry: the tests, and devcluster's several kubelet plugins in one
// process, would otherwise register the same metrics twice and panic, or
// read each other's numbers.
package metrics

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net/http"
	"runtime"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/gpudra/gpudra/internal/version"
)

// Namespace prefixes every gpudra metric.
const Namespace = "gpudra"

// Components name the binaries in gpudra_build_info's component label.
const (
	ComponentKubeletPlugin = "kubelet-plugin"
	ComponentController    = "controller"
)

// DurationBuckets (seconds) are for operations that take from under a
// millisecond to minutes: preparing a full GPU takes about 1 ms, creating a
// MIG device seconds, starting an MPS server pod (scheduling, image pull)
// can take a minute. The old exponential buckets ended at 4 s, so the slow
// operations, those worth alerting on, all fell into +Inf. Round values
// keep the le labels readable in PromQL.
var DurationBuckets = []float64{
	0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
	1, 2.5, 5, 10, 20, 30, 60, 120, 300,
}

// NewRegistry returns a new registry holding the Go runtime collector, the
// process collector and gpudra_build_info for the component.
func NewRegistry(component string) *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		buildInfo(component),
	)
	return reg
}

// buildInfo is a constant 1 whose labels say what runs: dashboards join on
// it to show the version beside other series, and a rollout can be watched
// by counting series per version.
func buildInfo(component string) prometheus.Collector {
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: Namespace, Name: "build_info",
		Help: "A metric with a constant '1' value labeled by the version, commit and Go version gpudra was built with, and the component.",
		ConstLabels: prometheus.Labels{
			"version": version.Version, "commit": version.Commit, "go_version": runtime.Version(), "component": component,
		},
	})
	g.Set(1)
	return g
}

// Handler serves the registry in the Prometheus exposition formats. Like
// promhttp.Handler for the global registry, it also counts the scrapes and
// the handler's own errors, in the same registry.
func Handler(reg *prometheus.Registry) http.Handler {
	return promhttp.InstrumentMetricHandler(reg, promhttp.HandlerFor(reg, promhttp.HandlerOpts{
		Registry: reg,
		// A slow or stuck collector must not pile up scrapes.
		MaxRequestsInFlight: 4,
		Timeout:             30 * time.Second,
	}))
}

// Serve runs an HTTP server for h on addr until ctx is done.
func Serve(ctx context.Context, addr string, h http.Handler) error {
	return ServeTLS(ctx, addr, h, nil)
}

// ServeTLS runs an HTTPS server for h on addr until ctx is done; a nil
// tlsConfig: plain HTTP.
func ServeTLS(ctx context.Context, addr string, h http.Handler, tlsConfig *tls.Config) error {
	srv := &http.Server{Addr: addr, Handler: h, ReadHeaderTimeout: 5 * time.Second, TLSConfig: tlsConfig}
	go func() {
		<-ctx.Done()
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdown)
	}()
	var err error
	if tlsConfig != nil {
		err = srv.ListenAndServeTLS("", "")
	} else {
		err = srv.ListenAndServe()
	}
	if err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("metrics server on %s: %w", addr, err)
	}
	return nil
}

// RegisterOrReuse registers c with reg, or returns the collector of the same
// description registered before (a controller made again in the same
// process, as a new leader's is); any other failure is appended to errs.
func RegisterOrReuse[T prometheus.Collector](reg prometheus.Registerer, c T, errs *[]error) T {
	err := reg.Register(c)
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if existing, ok := are.ExistingCollector.(T); ok {
			return existing
		}
	}
	if err != nil {
		*errs = append(*errs, err)
	}
	return c
}
