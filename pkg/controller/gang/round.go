package gang

import (
	"context"
	"errors"
	"strings"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// The round is the core's loop, one goroutine for both paths: collect the
// waiting items (reservations.go, gangs.go), order and plan them per queue
// (queues.go, plan.go), and hand the admitted ones to their path
// (admit.go). An idle controller skips rounds (idleTick).

// round plans every waiting item, in queue order, and brings every
// reservation's status up to date.
func (c *Controller) round(ctx context.Context) error {
	now := c.opts.Now()
	// Fences of written plans go once the informer shows the writes (the
	// scheduler's informer lags the same way).
	c.committer.liftKept(ctx, func(key string) bool {
		ns, name, _ := strings.Cut(key, "/")
		cl := c.claim(ns, name)
		return cl == nil || cl.Status.Allocation != nil
	})
	c.liftEndedKeptFences(ctx)
	snap := c.snapshot()
	var errs []error
	// A device both this controller and the scheduler allocated: take ours
	// back and plan again, before planning anything else.
	errs = append(errs, c.repairDoubleAllocations(ctx, snap))

	// FairShare weighs each namespace's allocated devices (held or used,
	// by reservations, gangs or single pods) against its share.
	heldByNamespace := map[string]int64{}
	for _, cl := range snap.allocated {
		heldByNamespace[cl.Namespace] += int64(len(cl.Status.Allocation.Devices.Results))
	}

	// Reservations: held ones are kept up to date (in use, TTL); queued
	// ones become items. busy: something in this round needs later rounds
	// even if no event comes (a reservation's TTL, a gang waiting for its
	// pods).
	items, heldClaims, busy, rerrs := c.reservationItems(ctx, snap, now)
	errs = append(errs, rerrs...)

	// Gangs: complete ones become items; the others wait for their pods.
	gangs, gangsFound, gerrs := c.gangItems(ctx, snap)
	busy = busy || gangsFound
	items = append(items, gangs...)
	errs = append(errs, gerrs...)

	errs = append(errs, c.planQueues(ctx, items, snap, heldByNamespace, now))
	errs = append(errs, c.publishDemand(ctx))
	if c.opts.Path == PathWorkload {
		c.checkHandedOff(ctx)
	}
	errs = append(errs, c.sweepWorkloads(ctx))
	// Kept from events: setting the gauges costs the classes, not the devices.
	c.countsStale.Store(false)
	c.countClasses(heldClaims)
	c.lastRound = now
	c.idle.Store(!busy && len(items) == 0 && c.settled(now))
	return errors.Join(errs...)
}

// publishDemand publishes, for an autoscaler, the demand of the items that
// wait for devices this round, and takes back the rest (autoscaler.go).
func (c *Controller) publishDemand(ctx context.Context) error {
	if c.autoscaler == nil {
		return nil
	}
	wanted, errs := wantedDemand(c.needDevices, c.template)
	return errors.Join(append(errs, c.autoscaler.publish(ctx, wanted))...)
}

// idleResync is how often an idle controller runs a round anyway.
const idleResync = 5 * time.Minute

// settled says that nothing this controller did lately needs a later round:
// no write the informers may not show yet, no gang handed to kube-scheduler
// and not bound, no fence kept, no new allocation the repair has not looked
// at, no Workload left to sweep.
func (c *Controller) settled(now time.Time) bool {
	c.mu.Lock()
	c.forgetOldLocked(now)
	quiet := len(c.recent) == 0 && len(c.handed) == 0
	c.mu.Unlock()
	if !quiet || len(c.committer.kept) > 0 {
		return false
	}
	c.mu.Lock()
	fresh := c.fresh.Len()
	c.mu.Unlock()
	if fresh > 0 {
		return false // allocations the repair has not looked at
	}
	if c.podGroups != nil {
		for _, obj := range c.podGroups.List() {
			if obj.(metav1.Object).GetLabels()[gpudrav1.LabelGang] != "" {
				return false
			}
		}
	}
	return true
}

// idleTick is what a tick does while the controller is idle: at most the
// per-class gauges, when a claim or slice changed, and the double-allocation
// repair of the claims allocated since the last tick, with the slices of
// their pools only. It reports false when a round is due instead.
func (c *Controller) idleTick(ctx context.Context) bool {
	if !c.idle.Load() || c.opts.Now().Sub(c.lastRound) >= idleResync {
		return false
	}
	c.liftEndedKeptFences(ctx)
	if pools := c.freshPools(); len(pools) > 0 {
		snap := &snapshot{}
		for _, o := range c.slices.List() {
			if sl := o.(*resourceapi.ResourceSlice); pools.Has(sl.Spec.Driver + "/" + sl.Spec.Pool.Name) {
				snap.slices = append(snap.slices, sl)
			}
		}
		if err := c.repairDoubleAllocations(ctx, snap); err != nil {
			klog.FromContext(ctx).Error(err, "Repair of double allocations failed; trying again")
		}
	}
	if c.countsStale.Swap(false) {
		// Idle means no reservation: no claim is held.
		c.countClasses(sets.New[string]())
	}
	return true
}
