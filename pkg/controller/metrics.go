package controller

import (
	"github.com/prometheus/client_golang/prometheus"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

type controllerMetrics struct {
	leader prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer) *controllerMetrics {
	m := &controllerMetrics{leader: prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: "gpudra", Subsystem: "controller", Name: "leader",
		Help: "1 while this replica holds the leader lease and runs the leader-only work, else 0.",
	})}
	reg.MustRegister(m.leader)
	return m
}

func metav1ObjectMeta(namespace, name string) metav1.ObjectMeta {
	return metav1.ObjectMeta{Namespace: namespace, Name: name}
}
