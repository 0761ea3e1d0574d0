package devcluster

import (
	"bytes"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"

	"github.com/gpudra/gpudra/pkg/telemetry"
)

// TelemetryInterval is how often a DRA node samples its GPUs' telemetry:
// short, so that a test sees a change within a second or two (the
// binary's default is 10 s).
const TelemetryInterval = time.Second

// startTelemetry gives a DRA node the telemetry the kubelet plugin's
// binary exports (issue 36), on a registry of its own (ScrapeMetrics),
// sampled every TelemetryInterval until the cluster stops. The claims come
// from the running plugin instance (attachClaimsLocked). A node added in
// device-plugin mode has none.
func (n *Node) startTelemetry() {
	n.metrics = prometheus.NewRegistry()
	n.telemetry = telemetry.Register(n.ctx, n.metrics, n.backend, n.Name, TelemetryInterval)
}

// attachClaimsLocked attributes the node's devices to the claims prepared
// by inst (nil: the plugin is stopped, no attribution series), as the
// binary does with its plugin once it started. Called under n.mu.
func (n *Node) attachClaimsLocked(inst *PluginInstance) {
	if n.telemetry == nil {
		return
	}
	if inst == nil {
		n.telemetry.SetClaims(nil)
		return
	}
	n.telemetry.SetClaims(inst.Plugin.PreparedClaims)
}

// ScrapeMetrics returns the node's telemetry in Prometheus' text
// exposition format, as the plugin's /metrics serves it: the device
// series, the claim attribution (gpudra_device_claim_info,
// gpudra_device_free) and the sampler's own (docs/metrics.md, GPU
// telemetry). It fails on a node without telemetry (added in
// device-plugin mode, or over a backend that reads none).
func (n *Node) ScrapeMetrics() (string, error) {
	if n.telemetry == nil {
		return "", fmt.Errorf("node %s: no telemetry", n.Name)
	}
	families, err := n.metrics.Gather()
	if err != nil {
		return "", fmt.Errorf("node %s: %w", n.Name, err)
	}
	var buf bytes.Buffer
	enc := expfmt.NewEncoder(&buf, expfmt.NewFormat(expfmt.TypeTextPlain))
	for _, mf := range families {
		if err := enc.Encode(mf); err != nil {
			return "", fmt.Errorf("node %s: %w", n.Name, err)
		}
	}
	return buf.String(), nil
}
