package gang

import (
	"context"
	"errors"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/allocator"
)

// A round decides first (plan: does the item fit now, in queue order) and
// acts after (admit: hand the round's admissions over, then write their
// statuses), so that a round's admissions share one fence and one settle on
// the gate path instead of waiting on each other's.

// admission is an item a round admitted, with its plan.
type admission struct {
	it     *item
	result allocator.Result
}

// plan decides whether one item fits now. An item that fits is returned as
// an admission, its devices counted as used for the rest of the round.
func (c *Controller) plan(ctx context.Context, it *item, snap *snapshot) (outcome, *admission, error) {
	start := time.Now()
	result, err := allocator.Plan(ctx, snap.input(c.opts.Strategy, it.claims, it.groups, false))
	c.metrics.planSeconds.Observe(time.Since(start).Seconds())
	if err == nil && it.sameDomain && len(result.NVLinkDomains) > 1 {
		err = &allocator.NotFitError{Unit: it.Key, Devices: it.Devices}
		err = fmt.Errorf("the free devices span %d NVLink domains (%v), one is required: %w", len(result.NVLinkDomains), result.NVLinkDomains, err)
	}
	var nf *allocator.NotFitError
	switch {
	case errors.As(err, &nf):
		// Would it fit on an empty cluster? If not, waiting cannot help.
		if msg := c.unsatisfiable(ctx, it, snap); msg != "" {
			return outcome{reason: gpudrav1.ReasonUnsatisfiable, message: msg}, nil, nil
		}
		return outcome{reason: gpudrav1.ReasonWaitingForDevices, message: fmt.Sprintf("waiting for %d free devices: %v", it.Devices, err)}, nil, nil
	case err != nil:
		return outcome{reason: gpudrav1.ReasonUnsatisfiable, message: err.Error()}, nil, fmt.Errorf("plan %s: %w", it.Key, err)
	}
	// The informers lag (and on the Workload API path the scheduler has not
	// allocated yet): what was just planned counts as used for the rest of
	// the round.
	for _, a := range result.Allocations {
		cl := a.Claim.DeepCopy()
		cl.Status.Allocation = a.Result.DeepCopy()
		snap.allocated = append(snap.allocated, cl)
	}
	return outcome{reason: gpudrav1.ReasonAllocated}, &admission{it: it, result: result}, nil
}

// handsOff says whether the item goes to kube-scheduler as a PodGroup: a
// gang on the Workload API path. Reservations are held by the controller on
// both paths.
func (c *Controller) handsOff(it *item) bool {
	return it.kind == KindGang && c.opts.Path == PathWorkload
}

// admit hands a round's admissions over: gangs on the Workload API path as
// PodGroups, everything else written in one batch behind one fence; then
// each admitted item's status. An admission whose devices were taken
// meanwhile waits again (planned next round).
func (c *Controller) admit(ctx context.Context, batch []*admission, snap *snapshot, now time.Time) error {
	var errs []error
	var writes []*admission
	var plans []commitPlan
	for _, a := range batch {
		if c.handsOff(a.it) {
			if err := c.handOff(ctx, a.it.gang, topologyKey(&a.result)); err != nil {
				errs = append(errs, err)
				c.reportGang(ctx, a.it.gang, gpudrav1.ReasonWaitingForDevices, err.Error())
				continue
			}
			c.rememberHanded(a.it.Key, a.it.gang, a.result)
			errs = append(errs, c.admitted(ctx, a, now))
			continue
		}
		writes = append(writes, a)
		plans = append(plans, commitPlan{result: a.result, create: a.it.create})
	}
	if len(plans) == 0 {
		return errors.Join(errs...)
	}
	for i, err := range c.committer.commitAll(ctx, plans, snap.counters()) {
		a := writes[i]
		switch {
		case errors.Is(err, ErrConflict):
			c.metrics.conflicts.Inc()
			klog.FromContext(ctx).V(2).Info("Planned devices were taken; planning again", "item", a.it.Key, "err", err)
			c.kick()
			errs = append(errs, c.reportWaiting(ctx, a.it, outcome{reason: gpudrav1.ReasonWaitingForDevices, message: err.Error()}, now))
		case err != nil:
			errs = append(errs, fmt.Errorf("allocate %s: %w", a.it.Key, err))
			errs = append(errs, c.reportWaiting(ctx, a.it, outcome{reason: gpudrav1.ReasonWaitingForDevices, message: err.Error()}, now))
		default:
			errs = append(errs, c.admitted(ctx, a, now))
		}
	}
	return errors.Join(errs...)
}

// admitted records an item handed over or written: metrics, log, and its
// status (a reservation's Held, a gang's condition and gate lift).
func (c *Controller) admitted(ctx context.Context, a *admission, now time.Time) error {
	it, result := a.it, a.result
	c.remember(it.Key)
	c.metrics.admitted.WithLabelValues(it.kind).Inc()
	c.metrics.waitSeconds.WithLabelValues(it.queueName, it.kind).Observe(now.Sub(it.QueuedAt).Seconds())
	klog.FromContext(ctx).Info("Admitted", "item", it.Key, "path", c.opts.Path, "devices", it.Devices, "nodes", result.Nodes, "nvlinkDomains", result.NVLinkDomains)
	switch it.kind {
	case KindReservation:
		return c.setReservationStatus(ctx, it.res, func(st *gpudrav1.GpuReservationStatus) {
			st.Phase, st.Reason, st.QueuePosition = gpudrav1.ReservationHeld, gpudrav1.ReasonAllocated, 0
			st.Message = fmt.Sprintf("%d devices held on %v", it.Devices, result.Nodes)
			st.HeldAt = metaTime(now)
			st.ExpiresAt = metaTime(now.Add(it.res.Spec.TTL.Duration))
			st.Nodes, st.NVLinkDomains = result.Nodes, result.NVLinkDomains
			st.Claims, st.Devices = nil, 0
			for _, a := range result.Allocations {
				h := gpudrav1.HeldClaim{Name: a.Claim.Name, Node: a.Node}
				for _, d := range a.Result.Devices.Results {
					h.Devices = append(h.Devices, d.Pool+"/"+d.Device)
				}
				st.Devices += int32(len(h.Devices))
				st.Claims = append(st.Claims, h)
			}
		})
	case KindGang:
		if c.handsOff(it) {
			c.recordGang(it.gang, corev1.EventTypeNormal, ReasonPodGroupCreated,
				fmt.Sprintf("gang %s: %d devices fit (on %v now); handed to kube-scheduler as PodGroup %s, which places all of its pods or none",
					it.gang.Name, it.Devices, result.Nodes, it.gang.Name))
			return c.markHandedOff(ctx, it.gang)
		}
		c.recordGang(it.gang, corev1.EventTypeNormal, ReasonGangAllocated,
			fmt.Sprintf("gang %s: %d devices allocated on %v (NVLink domains %v); scheduling gates lifted", it.gang.Name, it.Devices, result.Nodes, result.NVLinkDomains))
		return c.release(ctx, it.gang)
	}
	return fmt.Errorf("unknown item kind %q", it.kind)
}
