package gang

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/allocator"
	"github.com/gpudra/gpudra/pkg/controller/queue"
)

// Kinds of queue items.
const (
	KindReservation = gpudrav1.KindGpuReservation
	KindGang        = "Gang"
)

// item is one reservation or gang waiting in a queue.
type item struct {
	queue.Item
	kind      string
	queueName string
	// res or gang, by kind.
	res  *gpudrav1.GpuReservation
	gang *Gang
	// claims (a reservation's) and groups (a gang's) are what to plan;
	// create are the claims (namespace/name) that do not exist yet.
	claims     []*resourceapi.ResourceClaim
	groups     []allocator.Group
	create     sets.Set[string]
	sameDomain bool
	classes    []string
}

// outcome is what a round decided for a waiting item.
type outcome struct {
	reason, message string
	position        int
}

// round plans every waiting item, in queue order, and brings every
// reservation's status up to date.
func (c *Controller) round(ctx context.Context) error {
	logger := klog.FromContext(ctx)
	now := c.opts.Now()
	// Fences of written plans go once the informer shows the writes (the
	// scheduler's informer lags the same way).
	c.committer.liftKept(ctx, func(key string) bool {
		ns, name, _ := strings.Cut(key, "/")
		cl := c.claim(ns, name)
		return cl == nil || cl.Status.Allocation != nil
	})
	snap := c.snapshot()
	var errs []error
	// A device both this controller and the scheduler allocated: take ours
	// back and plan again, before planning anything else.
	errs = append(errs, c.repairDoubleAllocations(ctx, snap))

	// Reservations: held ones are kept up to date (in use, TTL); queued
	// ones become items.
	var items []*item
	// FairShare weighs each namespace's allocated devices (held or used,
	// by reservations, gangs or single pods) against its share.
	heldByNamespace := map[string]int64{}
	for _, cl := range snap.allocated {
		heldByNamespace[cl.Namespace] += int64(len(cl.Status.Allocation.Devices.Results))
	}
	heldClaims := sets.New[string]()
	var heldDevices, consumedDevices int
	// busy: something in this round needs later rounds even if no event
	// comes (a reservation's TTL, a gang waiting for its pods).
	busy := false
	for _, obj := range c.reservations.List() {
		r, err := gpudrav1.FromUnstructured[gpudrav1.GpuReservation](obj.(*unstructured.Unstructured))
		if err != nil {
			logger.Error(err, "Unreadable GpuReservation")
			continue
		}
		r.Default()
		if r.Status.Phase != gpudrav1.ReservationFailed {
			busy = true
		}
		switch r.Status.Phase {
		case gpudrav1.ReservationFailed:
			continue
		case gpudrav1.ReservationHeld, gpudrav1.ReservationConsumed, gpudrav1.ReservationExpired:
			if r.Status.Phase == gpudrav1.ReservationHeld && c.isRecent(requeuedKey(r.Namespace, r.Name)) {
				continue // queued again by the repair; the informer has not caught up
			}
			claims := c.reservationClaimsOf(r)
			for _, cl := range claims {
				heldClaims.Insert(cl.Namespace + "/" + cl.Name)
				if cl.Status.Allocation != nil {
					n := len(cl.Status.Allocation.Devices.Results)
					if len(cl.Status.ReservedFor) > 0 {
						consumedDevices += n
					} else {
						heldDevices += n
					}
				}
			}
			if err := c.syncHeld(ctx, r, claims, snap, now); err != nil {
				errs = append(errs, err)
			}
			continue
		}
		if c.isRecent(KindReservation + "/" + r.Namespace + "/" + r.Name) {
			continue // just held; the informer has not caught up
		}
		if verrs := gpudrav1.ValidateReservation(r); len(verrs) > 0 {
			errs = append(errs, c.setReservationStatus(ctx, r, func(st *gpudrav1.GpuReservationStatus) {
				st.Phase, st.Reason, st.Message, st.QueuePosition = gpudrav1.ReservationFailed, gpudrav1.ReasonInvalid, verrs.ToAggregate().Error(), 0
			}))
			continue
		}
		it := &item{kind: KindReservation, queueName: r.Spec.Queue, res: r, create: sets.New[string](), sameDomain: r.Spec.SameNVLinkDomain,
			classes: []string{r.Spec.DeviceClassName}}
		it.claims = reservationClaims(r, func(ns, name string) *resourceapi.ResourceClaim {
			if cl := c.claim(ns, name); cl != nil && ownedBy(cl, r) {
				return cl
			}
			return nil
		})
		allocated := 0
		for _, cl := range it.claims {
			if cl.UID == "" {
				it.create.Insert(cl.Namespace + "/" + cl.Name)
			}
			if cl.Status.Allocation != nil {
				allocated++
			}
		}
		if allocated == len(it.claims) {
			// Held before its status said so (a leader that stopped
			// between the two writes): say so now.
			errs = append(errs, c.syncHeld(ctx, r, it.claims, snap, now))
			continue
		}
		if allocated > 0 {
			// Half written: a leader stopped between two claim writes.
			// Planned around, those claims could break sameNVLinkDomain,
			// and planned again they are refused as already allocated,
			// so the reservation stayed Queued holding devices. They are
			// taken back, and the whole reservation is planned anew.
			errs = append(errs, c.takeBack(ctx, r, it.claims))
			c.kick()
			continue
		}
		queuedAt := r.CreationTimestamp.Time
		if r.Status.QueuedAt != nil {
			queuedAt = r.Status.QueuedAt.Time
		}
		var dur *time.Duration
		if r.Spec.Duration != nil {
			dur = &r.Spec.Duration.Duration
		}
		it.Item = queue.Item{Key: KindReservation + "/" + r.Namespace + "/" + r.Name, Namespace: r.Namespace, Priority: r.Spec.Priority,
			QueuedAt: queuedAt, Duration: dur, Devices: demand(nil, it.claims)}
		items = append(items, it)
	}
	c.metrics.held.Set(float64(heldDevices))
	c.metrics.consumed.Set(float64(consumedDevices))

	// Gangs: complete ones become items; the others wait for their pods.
	for _, g := range collectGangs(c.gangPods(), c.waits, c.podGang, c.podClaims) {
		busy = true
		if g.Admitted {
			// Released before: its remaining waiting members go now (a
			// gate lift that failed, a pod recreated by its owner).
			errs = append(errs, c.admitGang(ctx, g))
			continue
		}
		if g.Missing != "" {
			c.reportGang(ctx, g, ReasonWaitingForPods, "waiting for "+g.Missing)
			continue
		}
		groups, err := gangGroups(g, snap.nodes, c.podClaims)
		if err != nil {
			c.reportGang(ctx, g, ReasonWaitingForPods, "waiting for "+err.Error())
			continue
		}
		if len(groups) == 0 {
			// Everything is allocated (a round stopped between writing and
			// lifting the gates, or the pods use held claims only).
			errs = append(errs, c.admitGang(ctx, g))
			continue
		}
		if half := c.halfWrittenGang(g); len(half) > 0 {
			// Some of its claims hold this controller's writes, others
			// none (a hand-off that failed after the shared claims were
			// written, a leader that stopped between writes): planned
			// around them, the gang could leave its NVLink domain. They
			// are taken back and the whole gang is planned anew, as a
			// half-written reservation is.
			errs = append(errs, c.takeBackGang(ctx, g, half))
			c.kick()
			continue
		}
		it := &item{kind: KindGang, queueName: g.Queue, gang: g, groups: groups}
		it.Item = queue.Item{Key: KindGang + "/" + g.Key, Namespace: g.Namespace, Priority: g.Priority, QueuedAt: g.QueuedAt,
			Duration: g.Duration, Devices: demand(groups, nil)}
		for _, grp := range groups {
			for _, cl := range grp.Claims {
				it.classes = append(it.classes, requestClasses(cl)...)
			}
		}
		items = append(items, it)
	}

	errs = append(errs, c.planQueues(ctx, items, snap, heldByNamespace, now))
	errs = append(errs, c.sweepWorkloads(ctx))
	// Kept from events: setting the gauges costs the classes, not the devices.
	c.countsStale.Store(false)
	c.countClasses(heldClaims)
	c.lastRound = now
	c.idle.Store(!busy && len(items) == 0 && c.settled(now))
	return errors.Join(errs...)
}

// idleResync is how often an idle controller runs a round anyway.
const idleResync = 5 * time.Minute

// settled says that nothing this controller did lately needs a later round:
// no write the informers may not show yet, no gang handed to kube-scheduler
// and not bound, no fence kept, no new allocation the repair has not looked
// at, no Workload left to sweep.
func (c *Controller) settled(now time.Time) bool {
	c.mu.Lock()
	for k, t := range c.recent {
		if now.Sub(t) > recentTTL {
			delete(c.recent, k)
		}
	}
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

// countClasses sets the per-class device gauges from the counter.
func (c *Controller) countClasses(heldClaims sets.Set[string]) {
	c.counter.setHeld(heldClaims)
	for class, cnt := range c.counter.snapshot() {
		c.metrics.devices.WithLabelValues(class, "free").Set(float64(cnt.free))
		c.metrics.devices.WithLabelValues(class, "held").Set(float64(cnt.held))
		c.metrics.devices.WithLabelValues(class, "allocated").Set(float64(cnt.allocated))
	}
}

// planQueues orders each queue's items by its policy and plans them in
// order. An item that would fit on the cluster but not now holds back the
// items behind it (no small item starves a big one); one that could never
// fit does not.
func (c *Controller) planQueues(ctx context.Context, items []*item, snap *snapshot, held map[string]int64, now time.Time) error {
	byQueue := map[string][]*item{}
	for _, it := range items {
		byQueue[it.queueName] = append(byQueue[it.queueName], it)
	}
	c.metrics.queueLength.Reset()
	c.metrics.queueDevices.Reset()
	c.metrics.unsatisfiable.Reset()
	c.metrics.waitingDemand.Reset()
	var errs []error
	var batch []*admission
	for _, name := range sortedKeys(byQueue) {
		policy := queue.PolicyFor(c.queue(name))
		keyed := map[string]*item{}
		var qitems []queue.Item
		for _, it := range byQueue[name] {
			keyed[it.Key] = it
			qitems = append(qitems, it.Item)
		}
		blocked := ""
		waiting, waitingDevices, unsatisfiable := 0, int64(0), 0
		for _, qi := range queue.Order(policy, qitems, now, held) {
			it := keyed[qi.Key]
			var out outcome
			if blocked != "" {
				out = outcome{reason: gpudrav1.ReasonBehindInQueue, message: "behind " + blocked + " in queue " + name}
				// An item that could never fit says so even behind others.
				if msg := c.unsatisfiable(ctx, it, snap); msg != "" {
					out = outcome{reason: gpudrav1.ReasonUnsatisfiable, message: msg}
					unsatisfiable++
				}
			} else {
				var err error
				var adm *admission
				out, adm, err = c.plan(ctx, it, snap)
				if err != nil {
					errs = append(errs, err)
				}
				if adm != nil {
					batch = append(batch, adm)
				}
				switch out.reason {
				case gpudrav1.ReasonAllocated:
					held[it.Namespace] += it.Devices
					continue
				case gpudrav1.ReasonWaitingForDevices:
					blocked = it.Key
				case gpudrav1.ReasonUnsatisfiable:
					unsatisfiable++
				}
			}
			waiting++
			waitingDevices += it.Devices
			for _, class := range it.classes {
				c.metrics.waitingDemand.WithLabelValues(class).Add(float64(it.Devices) / float64(len(it.classes)))
			}
			out.position = waiting
			errs = append(errs, c.reportWaiting(ctx, it, out, now))
		}
		c.metrics.queueLength.WithLabelValues(name).Set(float64(waiting))
		c.metrics.queueDevices.WithLabelValues(name).Set(float64(waitingDevices))
		c.metrics.unsatisfiable.WithLabelValues(name).Set(float64(unsatisfiable))
		errs = append(errs, c.setQueueStatus(ctx, name, waiting, waitingDevices, blocked))
	}
	errs = append(errs, c.admit(ctx, batch, snap, now))
	return errors.Join(errs...)
}

// unsatisfiable says why an item would not fit even on an empty cluster,
// or "" when it would. The answer depends only on the item and the
// cluster's devices, so it is kept until the slices, classes or nodes
// change: waiting items are asked every round.
func (c *Controller) unsatisfiable(ctx context.Context, it *item, snap *snapshot) string {
	fp := snap.fingerprint()
	c.mu.Lock()
	v, ok := c.verdicts[it.Key]
	c.mu.Unlock()
	// Kept a minute at most: a gang made again under its name with other
	// node selectors asks for the same number of devices.
	if ok && v.fingerprint == fp && v.devices == it.Devices && c.opts.Now().Sub(v.seen) < time.Minute {
		return v.message
	}
	var msg string
	empty, err := allocator.Plan(ctx, snap.input(c.opts.Strategy, it.claims, it.groups, true))
	switch {
	case err != nil:
		msg = fmt.Sprintf("%d devices cannot be allocated even on an empty cluster: %v", it.Devices, err)
	case it.sameDomain && len(empty.NVLinkDomains) > 1:
		msg = fmt.Sprintf("%d devices do not fit in one NVLink domain even on an empty cluster", it.Devices)
	}
	c.mu.Lock()
	c.verdicts[it.Key] = verdict{fingerprint: fp, devices: it.Devices, message: msg, seen: c.opts.Now()}
	for k, v := range c.verdicts {
		if c.opts.Now().Sub(v.seen) > time.Minute {
			delete(c.verdicts, k)
		}
	}
	c.mu.Unlock()
	return msg
}

// verdict is a remembered answer of unsatisfiable.
type verdict struct {
	fingerprint uint64
	devices     int64
	message     string
	seen        time.Time
}

// requestClasses are the device classes a claim asks for.
func requestClasses(cl *resourceapi.ResourceClaim) []string {
	var out []string
	for _, r := range cl.Spec.Devices.Requests {
		switch {
		case r.Exactly != nil:
			out = append(out, r.Exactly.DeviceClassName)
		case len(r.FirstAvailable) > 0:
			out = append(out, r.FirstAvailable[0].DeviceClassName)
		}
	}
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
