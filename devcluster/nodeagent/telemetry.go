package nodeagent

import (
	"bytes"
	"context"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/telemetry"
)

// TelemetryInterval is how often a node samples its GPUs' telemetry:
// short, so that a test sees a change within a second or two (the
// binary's default is 10 s).
const TelemetryInterval = time.Second

// startTelemetry gives the node the telemetry the kubelet plugin's binary
// exports in either mode (issue 36), on a registry of its own
// (ScrapeMetrics), sampled every TelemetryInterval until the cluster
// stops: the device series, their attribution to the claims and to the
// pods' containers (SetAttribution), and the health watch's
// (gpudra_gpu_xid_errors_total, gpudra_gpu_healthy), which the DRA
// plugin's own health watch feeds (plugin.Config.HealthObserver) and a
// watch of the device plugin's own in device-plugin mode
// (followHealthLocked), as in the binary. The claims come from the running
// DRA plugin instance (attachClaimsLocked). Called before the plugin
// starts.
func (n *Node) startTelemetry(ctx context.Context) error {
	n.metrics = prometheus.NewRegistry()
	n.telemetry = telemetry.Register(n.ctx, n.metrics, n.backend, n.Name, TelemetryInterval)
	if n.telemetry != nil {
		// Process attribution from what the node's kubelet keeps, as the
		// binary is configured in the chart: its pod-resources API, the
		// host's /proc (the containers' processes are real), its
		// /var/log/containers links.
		n.telemetry.SetAttribution(telemetry.AttributionConfig{PodResourcesSocket: n.PodResourcesSocket(), ProcRoot: "/proc",
			ContainerLogDir: n.ContainerLogDir()})
	}
	inv, err := n.backend.Inventory(ctx)
	if err != nil {
		return fmt.Errorf("node %s: the GPUs of the health metrics: %w", n.Name, err)
	}
	n.health = telemetry.NewHealthMetrics(n.Name, inv.GPUs)
	n.metrics.MustRegister(n.health)
	n.pluginCfg.HealthObserver = n.health
	return nil
}

// followHealthLocked feeds the health metrics from a health watch of the
// device plugin's own until ctx (its instance's) ends, under the device
// plugins' XID policy, as the binary's device-plugin mode does.
func (n *Node) followHealthLocked(ctx context.Context) error {
	if n.health == nil {
		return nil
	}
	if err := telemetry.FollowHealth(ctx, n.backend, n.health, nvdevice.NewXIDPolicy(n.pluginCfg.HealthIgnoredXIDs)); err != nil {
		return fmt.Errorf("node %s: %w", n.Name, err)
	}
	return nil
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
// telemetry). It fails on a node without telemetry (over a backend that
// reads none).
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
