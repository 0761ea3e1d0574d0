package nodehold

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	gpumetrics "github.com/gpudra/gpudra/pkg/metrics"
)

type metrics struct {
	writes *prometheus.CounterVec
	held   prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		writes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gpudra_node_hold_writes_total",
			Help: "Node annotation patches that tell autoscalers to keep (mark), keep with a new reason (update) or no longer keep (unmark) a node holding gpudra devices in use, by result (success, error: retried).",
		}, []string{"operation", "result"}),
		held: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "gpudra_nodes_held",
			Help: "Nodes that carry gpudra's do-not-disrupt marks after the last round: nodes holding gpudra devices in use.",
		}),
	}
	for _, op := range []string{opMark, opUpdate, opUnmark} {
		for _, r := range []string{"success", "error"} {
			m.writes.WithLabelValues(op, r)
		}
	}
	if reg == nil {
		return m, nil
	}
	var errs []error
	m.writes = gpumetrics.RegisterOrReuse(reg, m.writes, &errs)
	m.held = gpumetrics.RegisterOrReuse(reg, m.held, &errs)
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("node hold controller: metrics: %w", err)
	}
	return m, nil
}
