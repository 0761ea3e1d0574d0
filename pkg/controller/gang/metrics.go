package gang

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	gpumetrics "github.com/gpudra/gpudra/pkg/metrics"
)

// metrics of the gang and reservation controller. Gauges are set from each
// round's state, so they never drift from what the statuses say.
type metrics struct {
	queueLength  *prometheus.GaugeVec
	queueDevices *prometheus.GaugeVec
	waitSeconds  *prometheus.HistogramVec
	held         prometheus.Gauge
	consumed     prometheus.Gauge
	expired      prometheus.Counter
	admitted     *prometheus.CounterVec
	conflicts    prometheus.Counter
	doubles      *prometheus.CounterVec
	// handOffsNotPlaced counts gangs handed to kube-scheduler that it did
	// not place within schedulerActGrace, by reason.
	handOffsNotPlaced *prometheus.CounterVec
	planSeconds       prometheus.Histogram
	roundSeconds      prometheus.Histogram
	devices           *prometheus.GaugeVec
	waitingDemand     *prometheus.GaugeVec
	unsatisfiable     *prometheus.GaugeVec
	demand            *prometheus.GaugeVec
	// Autoscaler demand (autoscalerwrite.go).
	demandBuffers           prometheus.Gauge
	demandWriteFailures     *prometheus.CounterVec
	demandDiscoveryFailures prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		queueLength: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "gpudra_queue_length", Help: "Reservations and gangs waiting, by queue.",
		}, []string{"queue"}),
		queueDevices: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "gpudra_queue_waiting_devices", Help: "Devices the waiting reservations and gangs ask for, by queue.",
		}, []string{"queue"}),
		waitSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "gpudra_queue_wait_seconds", Help: "Time from queued to allocated, by queue and kind (GpuReservation, Gang).",
			Buckets: prometheus.ExponentialBuckets(0.1, 3, 12),
		}, []string{"queue", "kind"}),
		held: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "gpudra_reservation_held_devices", Help: "Devices held by reservations that no pod uses yet.",
		}),
		consumed: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "gpudra_reservation_consumed_devices", Help: "Devices of reservations that pods use.",
		}),
		expired: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "gpudra_reservations_expired_total", Help: "Reservations released at their TTL.",
		}),
		admitted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gpudra_gang_allocations_total", Help: "Reservations and gangs whose devices were allocated, by kind.",
		}, []string{"kind"}),
		doubles: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gpudra_gang_double_allocations_total",
			Help: "Devices found allocated to two claims (whoever wrote them), by outcome: repaired (the allocation nobody used taken back) or unrepaired.",
		}, []string{"outcome"}),
		handOffsNotPlaced: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gpudra_gang_handoffs_not_placed_total",
			Help: "Gangs handed to kube-scheduler as PodGroups that it had not placed 30 s later, by reason: SchedulerNotActing (nothing happened) or PodGroupUnschedulable.",
		}, []string{"reason"}),
		conflicts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "gpudra_gang_fence_conflicts_total", Help: "Plans dropped because a device was taken between planning and writing (planned again).",
		}),
		roundSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "gpudra_gang_round_duration_seconds", Help: "Time of one round over every waiting reservation and gang (an idle controller runs none).",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 14),
		}),
		planSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "gpudra_gang_plan_duration_seconds", Help: "Time to plan one reservation or gang with pkg/allocator.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 14),
		}),
		devices: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "gpudra_class_devices", Help: "Devices matching each DeviceClass, by node pool (the node's first label of --node-pool-labels, \"\" for none) and state: free, held (by a reservation, unused) or allocated.",
		}, []string{"device_class", "node_pool", "state"}),
		waitingDemand: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "gpudra_class_waiting_demand_devices", Help: "Devices of each DeviceClass that waiting reservations and gangs ask for: what an autoscaler would add.",
		}, []string{"device_class"}),
		demand: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "gpudra_class_demand_devices",
			Help: "Devices of each DeviceClass waited for, by source: queued gangs, queued reservations (node_pool \"\"), or pending pods' unallocated claims (node_pool from the pod's nodeSelector).",
		}, []string{"device_class", "node_pool", "source"}),
		unsatisfiable: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "gpudra_queue_unsatisfiable", Help: "Waiting reservations and gangs that would not fit even on an empty cluster, by queue.",
		}, []string{"queue"}),
		demandBuffers: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "gpudra_autoscaler_demand_buffers",
			Help: "CapacityBuffers published for an autoscaler: one per pod of each gang, or claim of each reservation, that waits because its devices do not fit now.",
		}),
		demandWriteFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gpudra_autoscaler_demand_write_failures_total",
			Help: "Failed writes of autoscaler demand objects (CapacityBuffers, their PodTemplates and demand claims), by operation: create or delete.",
		}, []string{"operation"}),
		demandDiscoveryFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "gpudra_autoscaler_demand_discovery_failures_total",
			Help: "API discovery calls that could not tell whether CapacityBuffers are served (the last answer was kept).",
		}),
	}
	if reg == nil {
		return m, nil
	}
	// The leader starts a new controller when the gang path changes: the
	// second one takes the collectors the first registered.
	var errs []error
	m.queueLength = gpumetrics.RegisterOrReuse(reg, m.queueLength, &errs)
	m.queueDevices = gpumetrics.RegisterOrReuse(reg, m.queueDevices, &errs)
	m.waitSeconds = gpumetrics.RegisterOrReuse(reg, m.waitSeconds, &errs)
	m.held = gpumetrics.RegisterOrReuse(reg, m.held, &errs)
	m.consumed = gpumetrics.RegisterOrReuse(reg, m.consumed, &errs)
	m.expired = gpumetrics.RegisterOrReuse(reg, m.expired, &errs)
	m.admitted = gpumetrics.RegisterOrReuse(reg, m.admitted, &errs)
	m.conflicts = gpumetrics.RegisterOrReuse(reg, m.conflicts, &errs)
	m.doubles = gpumetrics.RegisterOrReuse(reg, m.doubles, &errs)
	m.handOffsNotPlaced = gpumetrics.RegisterOrReuse(reg, m.handOffsNotPlaced, &errs)
	m.planSeconds = gpumetrics.RegisterOrReuse(reg, m.planSeconds, &errs)
	m.roundSeconds = gpumetrics.RegisterOrReuse(reg, m.roundSeconds, &errs)
	m.devices = gpumetrics.RegisterOrReuse(reg, m.devices, &errs)
	m.waitingDemand = gpumetrics.RegisterOrReuse(reg, m.waitingDemand, &errs)
	m.unsatisfiable = gpumetrics.RegisterOrReuse(reg, m.unsatisfiable, &errs)
	m.demand = gpumetrics.RegisterOrReuse(reg, m.demand, &errs)
	m.demandBuffers = gpumetrics.RegisterOrReuse(reg, m.demandBuffers, &errs)
	m.demandWriteFailures = gpumetrics.RegisterOrReuse(reg, m.demandWriteFailures, &errs)
	m.demandDiscoveryFailures = gpumetrics.RegisterOrReuse(reg, m.demandDiscoveryFailures, &errs)
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("register gang controller metrics: %w", err)
	}
	return m, nil
}
