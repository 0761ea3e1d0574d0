package nodehold

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
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
	m.writes = register(reg, m.writes, &errs)
	m.held = register(reg, m.held, &errs)
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("node hold controller: metrics: %w", err)
	}
	return m, nil
}

// register registers c, or returns the same collector registered before
// (a controller made again in the same process).
func register[T prometheus.Collector](reg prometheus.Registerer, c T, errs *[]error) T {
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
