package gang

import (
	"context"
	"errors"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/allocator"
	"github.com/gpudra/gpudra/pkg/webhook"
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
	if c.handsOff(it) {
		if msg := priorityConflict(it.gang); msg != "" {
			return outcome{reason: gpudrav1.ReasonUnsatisfiable, message: msg}, nil, nil
		}
	}
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

// priorityConflict says why kube-scheduler would place no pod of the gang
// as one PodGroup: its pods differ in priority ("all pods in a single pod
// group should have the same priority"); "" when they agree. The webhook
// refuses such a pod, but two made at once can both pass its view, and pods
// made before it checked are there: such a gang is not handed over, and
// says why, instead of waiting for ever on the scheduler.
func priorityConflict(g *Gang) string {
	if g == nil || len(g.Pods) < 2 {
		return ""
	}
	for _, p := range g.Pods[1:] {
		if webhook.PodPriority(p) != webhook.PodPriority(g.Pods[0]) {
			return fmt.Sprintf("gang %s: its pods' priorities differ (%s of pod %s, %s of pod %s); kube-scheduler places no pod of a "+
				"PodGroup whose pods' priorities differ: give every pod of the gang one PriorityClass (docs/gangs.md)",
				g.Name, webhook.DescribePriority(g.Pods[0]), g.Pods[0].Name, webhook.DescribePriority(p), p.Name)
		}
	}
	return ""
}

// handsOff says whether the item goes to kube-scheduler as a PodGroup: a
// gang on the Workload API path. Reservations are held by the controller on
// both paths.
func (c *Controller) handsOff(it *item) bool {
	return it.kind == KindGang && c.opts.Path == PathWorkload
}

// admit hands a round's admissions over: gangs on the Workload API path as
// PodGroups (their shared claims written first), everything else written
// in one batch behind one fence; then each admitted item's status. An admission whose devices were taken
// meanwhile waits again (planned next round).
func (c *Controller) admit(ctx context.Context, batch []*admission, snap *snapshot, now time.Time) error {
	var errs []error
	var writes []*admission
	var plans []commitPlan
	for _, a := range batch {
		if c.handsOff(a.it) {
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

// handOffAdmitted hands an admitted gang to kube-scheduler as a PodGroup
// (Workload API path) and records it.
func (c *Controller) handOffAdmitted(ctx context.Context, a *admission, now time.Time) error {
	if err := c.handOff(ctx, a.it.gang, topologyKey(&a.result)); err != nil {
		c.reportGang(ctx, a.it.gang, gpudrav1.ReasonWaitingForDevices, err.Error())
		return err
	}
	c.rememberHanded(a.it.Key, a.it.gang, a.result)
	return c.admitted(ctx, a, now)
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

// checkBeforeRelease looks again, one settle after the writes, for a device
// of a gang just written (on the Workload API path: its shared claims) that
// another claim holds too (kube-scheduler
// decided before the fence reached it and wrote at PreBind after the
// check), before the gang's gates are lifted: released, its pods would let
// kube-scheduler allocate a cleared claim anywhere, outside the gang's
// NVLink plan. Such a gang's writes are taken back and it is planned
// again (its result becomes ErrConflict). Reservations are left to the
// round's repair, which queues them again.
func (c *Controller) checkBeforeRelease(ctx context.Context, writes []*admission, plans []commitPlan, results []error, counters *counterIndex) {
	mine := map[string]int{} // claim namespace/name -> index into writes
	for i, a := range writes {
		if results[i] != nil || a.it.kind != KindGang {
			continue
		}
		for _, al := range plans[i].result.Allocations {
			mine[al.Claim.Namespace+"/"+al.Claim.Name] = i
		}
	}
	if len(mine) == 0 {
		return
	}
	if c.committer.settle > 0 {
		select {
		case <-ctx.Done():
			return
		case <-time.After(c.committer.settle):
		}
	}
	list, err := c.opts.Client.ResourceV1().ResourceClaims("").List(ctx, metav1.ListOptions{})
	if err != nil {
		// Could not tell: the round's repair looks at these claims again
		// (they are fresh), and a released gang's is reported.
		klog.FromContext(ctx).Error(err, "Check a gang's claims before lifting its gates")
		return
	}
	claims := make([]*resourceapi.ResourceClaim, 0, len(list.Items))
	for i := range list.Items {
		claims = append(claims, &list.Items[i])
	}
	involves := func(cl *resourceapi.ResourceClaim) bool { _, ok := mine[cl.Namespace+"/"+cl.Name]; return ok }
	for _, d := range findDoubleAllocations(claims, counters, involves) {
		for _, cl := range d.claims {
			i, ok := mine[cl.Namespace+"/"+cl.Name]
			if !ok || results[i] != nil {
				continue
			}
			results[i] = fmt.Errorf("%s is in another claim too, found before the gates were lifted: %w", d.what, ErrConflict)
			for _, al := range plans[i].result.Allocations {
				if err := c.committer.unwrite(context.WithoutCancel(ctx), al.Claim, false); err != nil {
					results[i] = fmt.Errorf("%s is in another claim too, and taking back claim %s/%s failed: %w", d.what, al.Claim.Namespace, al.Claim.Name, err)
				}
				delete(c.committer.written, al.Claim.UID)
			}
			c.metrics.doubles.WithLabelValues("repaired").Inc()
			klog.FromContext(ctx).Info("Took back a gang's writes before releasing it: a device is allocated twice", "gang", writes[i].it.Key, "what", d.what)
			c.recordGang(writes[i].it.gang, corev1.EventTypeWarning, ReasonDoubleAllocation,
				fmt.Sprintf("gang %s: %s was allocated to another claim too; took back the gang's allocations before lifting its gates, and planning again", writes[i].it.gang.Name, d.what))
		}
	}
}
