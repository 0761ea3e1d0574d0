package telemetry

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// Register exports the backend's device telemetry (issue 36) on reg, in
// either mode, when the backend reads any and interval is not 0; it
// samples in the background every interval until ctx is done. It returns
// the collector, nil when there is none; in DRA mode, hand it the plugin's
// claims (SetClaims with Plugin.PreparedClaims) once the plugin runs. The
// kubelet plugin's binary and devcluster's nodes both use it.
func Register(ctx context.Context, reg prometheus.Registerer, backend nvdevice.Interface, node string, interval time.Duration) *Collector {
	logger := klog.FromContext(ctx)
	if interval <= 0 {
		logger.V(2).Info("Telemetry disabled (--telemetry-interval=0); /metrics has none")
		return nil
	}
	r, ok := backend.(nvdevice.TelemetryReader)
	if !ok {
		logger.V(2).Info("The GPU backend reads no telemetry; /metrics has none")
		return nil
	}
	c := NewCollector(r, node, interval)
	reg.MustRegister(c)
	go c.Run(ctx)
	return c
}
