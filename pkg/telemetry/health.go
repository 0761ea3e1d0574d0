package telemetry

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

var (
	descXIDs    = desc("gpu_xid_errors_total", "XID errors the plugin's health watch saw on the GPU since the plugin started, by XID code (critical or not).", gpuLabels, "xid")
	descHealthy = desc("gpu_healthy", "1 when the plugin counts the GPU healthy, 0 when a critical XID or a lost GPU made it unhealthy (its devices are then tainted).", gpuLabels)
)

// HealthMetrics exports what the plugin's health watch saw: the XIDs, by
// code, and each GPU's health. The health watch feeds it (XID,
// SetUnhealthy); it reads no device.
type HealthMetrics struct {
	node string

	mu   sync.Mutex
	gpus map[string]*gpuHealth // by GPU UUID
}

type gpuHealth struct {
	device, model string
	unhealthy     bool
	xids          map[uint64]uint64 // XID -> events
}

var _ prometheus.Collector = (*HealthMetrics)(nil)

// NewHealthMetrics starts with every GPU of gpus healthy and no XID.
func NewHealthMetrics(node string, gpus []nvdevice.GPU) *HealthMetrics {
	h := &HealthMetrics{node: node, gpus: map[string]*gpuHealth{}}
	for i := range gpus {
		g := &gpus[i]
		h.gpus[g.UUID] = &gpuHealth{device: slicebuilder.GPUDeviceName(g), model: g.ProductName, xids: map[uint64]uint64{}}
	}
	return h
}

// gpuLocked is the GPU's entry; one the inventory did not have (it came
// later) is added without device and model.
func (h *HealthMetrics) gpuLocked(uuid string) *gpuHealth {
	g, ok := h.gpus[uuid]
	if !ok {
		g = &gpuHealth{xids: map[uint64]uint64{}}
		h.gpus[uuid] = g
	}
	return g
}

// XID counts one XID event on the GPU.
func (h *HealthMetrics) XID(gpuUUID string, xid uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.gpuLocked(gpuUUID).xids[xid]++
}

// SetUnhealthy makes the GPUs listed unhealthy and every other one healthy.
func (h *HealthMetrics) SetUnhealthy(gpuUUIDs []string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, g := range h.gpus {
		g.unhealthy = false
	}
	for _, uuid := range gpuUUIDs {
		h.gpuLocked(uuid).unhealthy = true
	}
}

// Describe sends the metrics' descriptions.
func (h *HealthMetrics) Describe(ch chan<- *prometheus.Desc) {
	ch <- descXIDs
	ch <- descHealthy
}

// Collect sends each GPU's health and XID counts.
func (h *HealthMetrics) Collect(ch chan<- prometheus.Metric) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for uuid, g := range h.gpus {
		healthy := 1.0
		if g.unhealthy {
			healthy = 0
		}
		l := append(deviceValues(h.node, uuid, g.device), g.model)
		ch <- prometheus.MustNewConstMetric(descHealthy, prometheus.GaugeValue, healthy, l...)
		for _, xid := range slices.Sorted(maps.Keys(g.xids)) {
			ch <- prometheus.MustNewConstMetric(descXIDs, prometheus.CounterValue, float64(g.xids[xid]), append(slices.Clone(l), strconv.FormatUint(xid, 10))...)
		}
	}
}

// FollowHealth feeds h from a health watch of its own on w, under policy,
// until ctx is done: every XID is counted, a critical event makes its GPU
// unhealthy and a recovery healthy again. For device plugin mode; in DRA
// mode the plugin's own health watch feeds h.
func FollowHealth(ctx context.Context, w nvdevice.HealthWatcher, h *HealthMetrics, policy nvdevice.XIDPolicy) error {
	events, err := w.WatchHealth(ctx)
	if err != nil {
		return fmt.Errorf("watch GPU health for the health metrics: %w", err)
	}
	go func() {
		for ev := range events {
			h.Observe(ev, policy)
		}
	}()
	return nil
}

// Observe counts ev if it is an XID and applies it to its GPU's health
// under policy, both at once for a scrape.
func (h *HealthMetrics) Observe(ev nvdevice.HealthEvent, policy nvdevice.XIDPolicy) {
	h.mu.Lock()
	defer h.mu.Unlock()
	g := h.gpuLocked(ev.GPUUUID)
	if ev.Kind == nvdevice.HealthXID {
		g.xids[ev.XID]++
	}
	switch {
	case ev.Kind == nvdevice.HealthRecovered:
		g.unhealthy = false
	case policy.Critical(ev):
		g.unhealthy = true
	}
}
