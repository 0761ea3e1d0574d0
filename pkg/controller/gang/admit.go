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
	"github.com/gpudra/gpudra/pkg/controller/queue"
)

// A round decides first (plan: does the item fit now, in queue order) and
// acts after (admit: hand the round's admissions over, then write their
// statuses), so that a round's admissions share one fence and one settle on
// the gate path instead of waiting on each other's.
//
// admit is where the core hands each admission to its path: a gang on the
// Workload API path to kube-scheduler as a PodGroup (workload.go), after
// the claims several of its pods share are written; everything else (every
// reservation, a gang on the gate path) written behind a fence (commit.go,
// fence.go), a gang then released by lifting its gates (gates.go).

// admission is an item a round admitted, with its plan.
type admission struct {
	it     *item
	result allocator.Result
}

// handsOff says whether the item goes to kube-scheduler as a PodGroup: a
// gang on the Workload API path. Reservations are held by the controller on
// both paths.
func (c *Controller) handsOff(it *item) bool {
	return it.kind == KindGang && c.opts.Path == PathWorkload
}

// admit hands a round's admissions over: gangs on the Workload API path as
// PodGroups (their shared claims written first), everything else written
// in one batch behind one fence; then each admitted item's status. An
// admission whose devices were taken meanwhile waits again (planned next
// round).
func (c *Controller) admit(ctx context.Context, batch []*admission, snap *snapshot, now time.Time) error {
	var errs []error
	var writes []*admission
	var plans []commitPlan
	for _, a := range batch {
		// The autoscaler's buffers for the item go first: once its
		// allocation is written or its PodGroup made, its demand is real
		// pods, and a buffer left would keep spare nodes for it. An item
		// whose buffers could not all be deleted waits for the next round.
		if err := c.autoscaler.takeBack(ctx, a.it); err != nil {
			errs = append(errs, fmt.Errorf("admit %s: %w", a.it.Key, err))
			c.kick()
			continue
		}
		if c.handsOff(a.it) {
			if why := c.handOffBlocked(a.it.gang); why != "" {
				// Waits, with nothing written (its plan still counts as
				// used for this round, so the queue behind it keeps its
				// order).
				c.reportGang(ctx, a.it.gang, ReasonHandOffBlocked, why)
				continue
			}
			shared := sharedAllocations(a.it.gang, a.result)
			if len(shared.Allocations) == 0 {
				errs = append(errs, c.handOffAdmitted(ctx, a, now))
				continue
			}
			// Written from the plan first, behind the fence; handed
			// over once written.
			writes = append(writes, a)
			plans = append(plans, commitPlan{result: shared, item: a.it.Key})
			continue
		}
		writes = append(writes, a)
		plans = append(plans, commitPlan{result: a.result, create: a.it.create, item: a.it.Key})
	}
	if len(plans) == 0 {
		return errors.Join(errs...)
	}
	results := c.committer.commitAll(ctx, plans, snap.counters())
	c.checkBeforeRelease(ctx, writes, plans, results, snap.counters())
	for i, err := range results {
		a := writes[i]
		if err == nil && c.handsOff(a.it) {
			errs = append(errs, c.handOffAdmitted(ctx, a, now))
			continue
		}
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
	c.rememberAdmitted(it.Key)
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

// admitGang hands over the waiting members of a gang that needs no planning
// (admitted before, or all its claims allocated): on the gate path their
// gates are lifted; on the Workload API path its PodGroup is made.
func (c *Controller) admitGang(ctx context.Context, g *Gang) error {
	// Whatever demand it had goes before it is handed over (admit).
	if err := c.autoscaler.takeBack(ctx, &item{kind: KindGang, gang: g, Item: queue.Item{Key: KindGang + "/" + g.Key, Namespace: g.Namespace}}); err != nil {
		c.kick()
		return fmt.Errorf("hand over gang %s: %w", g.Key, err)
	}
	if c.opts.Path == PathWorkload {
		if err := c.handOff(ctx, g, ""); err != nil {
			return err
		}
		return c.markHandedOff(ctx, g)
	}
	return c.release(ctx, g)
}
