package grove

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are gauges over the groups the controller knows, recomputed from
// its state after every sync, so they never drift from what it reports.
type metrics struct {
	groups    prometheus.Gauge
	consumers prometheus.Gauge
	problems  *prometheus.GaugeVec
	events    *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		groups: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "gpudra_controller_sharing_groups",
			Help: "Grove sharing groups (Grove ResourceClaims of gpudra) the controller tracks.",
		}),
		consumers: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "gpudra_controller_sharing_group_consumers",
			Help: "Pods that reference a Grove sharing group's claim, summed over all groups.",
		}),
		problems: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "gpudra_controller_sharing_group_problems",
			Help: "Grove sharing groups that have a problem, by reason.",
		}, []string{"reason"}),
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gpudra_controller_sharing_group_events_total",
			Help: "Warning Events recorded for Grove sharing group problems, by reason.",
		}, []string{"reason"}),
	}
	for _, r := range Reasons {
		// Every reason is exported from the start, so that an alert on it
		// sees 0 rather than nothing.
		m.problems.WithLabelValues(r)
		m.events.WithLabelValues(r)
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.groups, m.consumers, m.problems, m.events} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register grove controller metrics: %w", err)
		}
	}
	return m, nil
}
