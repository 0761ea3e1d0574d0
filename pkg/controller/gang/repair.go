package gang

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// The double-allocation repair, beside the fence-and-write hand-off and on
// both paths: a device that two claims hold, whoever wrote them, is found
// among the claims allocated since the last look and the allocation nobody
// uses is taken back (its item planned again); a gang left half written is
// taken back to be planned whole (a reservation: takeBack, reservations.go).

// ReasonDoubleAllocation is the Event reason when a device was found in two
// claims and the allocation nobody used was taken back.
const ReasonDoubleAllocation = "DoubleAllocationRepaired"

// ReasonDoubleAllocationUnrepaired is the Event reason when a device is in
// two claims and neither could be taken back.
const ReasonDoubleAllocationUnrepaired = "DoubleAllocationUnrepaired"

// doubleAllocation is a device (or a counter) that allocated claims hold
// beyond what it has.
type doubleAllocation struct {
	what   string
	claims []*resourceapi.ResourceClaim
}

// findDoubleAllocations lists, among allocated claims, every exclusive
// device in two of them and every shared counter they overdraw, where one
// of the claims is one that involves says to look at. One pass over the
// claims; counters are added up only for the sets worth a look.
func findDoubleAllocations(claims []*resourceapi.ResourceClaim, counters *counterIndex, involves func(*resourceapi.ResourceClaim) bool) []doubleAllocation {
	byDevice := map[deviceRef][]*resourceapi.ResourceClaim{}
	bySet := map[counterSet][]deviceRef{}
	holders := map[counterSet][]*resourceapi.ResourceClaim{}
	for _, cl := range claims {
		for _, d := range exclusiveDevices(cl) {
			if !slices.Contains(byDevice[d], cl) {
				byDevice[d] = append(byDevice[d], cl)
			}
			if counters == nil {
				continue
			}
			for set := range counters.consumes[d] {
				bySet[set] = append(bySet[set], d)
				if !slices.Contains(holders[set], cl) {
					holders[set] = append(holders[set], cl)
				}
			}
		}
	}
	worthALook := func(cls []*resourceapi.ResourceClaim) bool {
		return len(cls) > 1 && slices.ContainsFunc(cls, involves)
	}
	var out []doubleAllocation
	for d, cls := range byDevice {
		if worthALook(cls) {
			out = append(out, doubleAllocation{what: "device " + d.pool + "/" + d.device, claims: cls})
		}
	}
	for set, cls := range holders {
		if !worthALook(cls) {
			continue
		}
		if over := counters.overdrawnIn(set, bySet[set]); over != "" {
			out = append(out, doubleAllocation{what: over, claims: cls})
		}
	}
	slices.SortFunc(out, func(a, b doubleAllocation) int { return strings.Compare(a.what, b.what) })
	return out
}

// exclusiveDevices are the devices a claim's allocation holds alone (not
// shared by ID, not admin access).
func exclusiveDevices(cl *resourceapi.ResourceClaim) []deviceRef {
	if cl.Status.Allocation == nil {
		return nil
	}
	var out []deviceRef
	for _, r := range cl.Status.Allocation.Devices.Results {
		if r.ShareID != nil || ptr.Deref(r.AdminAccess, false) {
			continue
		}
		out = append(out, deviceRef{r.Driver, r.Pool, r.Device})
	}
	return out
}

// deviceIndex indexes allocated claims by each device they hold alone, so
// that the claims next to a newly allocated one are found without a list.
const deviceIndex = "device"

func (d deviceRef) key() string { return d.driver + "/" + d.pool + "/" + d.device }

func claimDevices(obj any) ([]string, error) {
	cl, ok := obj.(*resourceapi.ResourceClaim)
	if !ok {
		return nil, nil
	}
	var out []string
	for _, d := range exclusiveDevices(cl) {
		out = append(out, d.key())
	}
	return out, nil
}

// noteAllocation is the claim informer's update hook: a claim whose
// allocation appeared or changed, by whoever wrote it (this controller or
// kube-scheduler), is looked at by the next round's repair. Only those:
// two allocations collide when the second is written, so a round's repair
// costs the claims allocated since the last one, not the cluster's.
func (c *Controller) noteAllocation(old, cur *resourceapi.ResourceClaim) {
	if cur == nil || cur.Status.Allocation == nil {
		return
	}
	if old != nil && old.Status.Allocation != nil && slices.Equal(exclusiveDevices(old), exclusiveDevices(cur)) {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.fresh == nil {
		c.fresh = sets.New[string]()
	}
	c.fresh.Insert(cur.Namespace + "/" + cur.Name)
}

// takeFresh returns and forgets the claims allocated since the last repair.
func (c *Controller) takeFresh() sets.Set[string] {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := c.fresh
	c.fresh = nil
	return out
}

// freshPools are the pools (driver/pool) of the claims allocated since the
// last repair.
func (c *Controller) freshPools() sets.Set[string] {
	c.mu.Lock()
	keys := c.fresh.UnsortedList()
	c.mu.Unlock()
	pools := sets.New[string]()
	for _, key := range keys {
		if cl := c.claim(splitKey(key)); cl != nil {
			for _, d := range exclusiveDevices(cl) {
				pools.Insert(d.driver + "/" + d.pool)
			}
		}
	}
	return pools
}

// claimFacts is what the repair knows of one claim of a collision.
type claimFacts struct {
	claim *resourceapi.ResourceClaim
	use   use
	// written: this controller (any leader) wrote the allocation from its
	// plan (writtenBy); item is that plan's item (a reservation's or a
	// gang's key).
	written bool
	item    string
	// released: the claim's gang was let go (its gates lifted, or its
	// PodGroup made): taking the allocation back would let kube-scheduler
	// allocate it anywhere, outside the gang's NVLink plan.
	released bool
}

// repairDecision is what to do about one collision: which claim keeps the
// device, which allocations are taken back (takeBackClaim checks each once
// more on the API server: in use meanwhile, or reserved within its grace,
// it is left), and why the others cannot be.
type repairDecision struct {
	keep       *resourceapi.ResourceClaim
	takeBack   []claimFacts
	unrepaired []string
}

// keepRank orders the claims of a collision by how much taking their
// allocation back would cost: a claim in use keeps its device, then a
// released gang's (its plan), then one reserved for pods, then one nobody
// planned with, and last this controller's own unused write, which its item
// plans again.
func keepRank(f claimFacts) int {
	switch {
	case f.use == useInUse:
		return 4
	case f.released:
		return 3
	case f.use == useReserved:
		return 2
	case !f.written:
		return 1
	}
	return 0
}

// decideRepair decides one collision: the claim with the highest keepRank
// (then the oldest allocation, then the name) keeps the device; every other
// one that is not in use and that no released gang planned with is to be
// taken back.
func decideRepair(claims []claimFacts) repairDecision {
	claims = slices.Clone(claims)
	slices.SortStableFunc(claims, func(a, b claimFacts) int {
		if r := cmp.Compare(keepRank(b), keepRank(a)); r != 0 {
			return r
		}
		if r := writtenOrMade(a.claim).Compare(writtenOrMade(b.claim)); r != 0 {
			return r
		}
		return strings.Compare(a.claim.Namespace+"/"+a.claim.Name, b.claim.Namespace+"/"+b.claim.Name)
	})
	d := repairDecision{keep: claims[0].claim}
	for _, f := range claims[1:] {
		name := f.claim.Namespace + "/" + f.claim.Name
		switch {
		case f.use == useInUse:
			d.unrepaired = append(d.unrepaired, name+" is in use")
		case f.released:
			d.unrepaired = append(d.unrepaired, name+" belongs to a gang already released on its plan")
		default:
			d.takeBack = append(d.takeBack, f)
		}
	}
	return d
}

// writtenOrMade orders the claims of a collision, oldest first: the
// allocation's time, or the claim's creation where the informer's copy
// does not say (allocatedAt).
func writtenOrMade(cl *resourceapi.ResourceClaim) time.Time {
	if at, ok := allocatedAt(cl); ok {
		return at
	}
	return cl.CreationTimestamp.Time
}

// repairDoubleAllocations finds devices that two allocated claims hold (the
// fence makes it rare on the gate path, not impossible: a scheduler whose
// informer had not seen the fence; kube-scheduler alone did it on the
// Workload API path, kubernetes/kubernetes#140053) among the claims
// allocated since the last round, and takes back the allocation nobody
// uses (decideRepair): a bounded, visible event (a metric, a Warning Event,
// a log line) instead of pods stuck Pending or in ContainerCreating on the
// plugin's refusal. A reservation whose claim was taken back is queued
// again and planned anew.
func (c *Controller) repairDoubleAllocations(ctx context.Context, snap *snapshot) error {
	fresh := c.takeFresh()
	if fresh.Len() == 0 {
		return nil
	}
	counters := snap.counters()
	// The fresh claims and every claim holding one of their devices, or a
	// device that shares a counter with one.
	near := map[string]*resourceapi.ResourceClaim{}
	for key := range fresh {
		cl := c.claim(splitKey(key))
		if cl == nil {
			continue
		}
		devices := exclusiveDevices(cl)
		if counters != nil {
			devices = append(devices, counters.siblings(devices)...)
		}
		for _, d := range devices {
			objs, _ := c.claims.ByIndex(deviceIndex, d.key())
			for _, o := range objs {
				other := o.(*resourceapi.ResourceClaim)
				near[other.Namespace+"/"+other.Name] = other
			}
		}
	}
	claims := make([]*resourceapi.ResourceClaim, 0, len(near))
	for _, key := range sortedKeys(near) {
		claims = append(claims, near[key])
	}
	involves := func(cl *resourceapi.ResourceClaim) bool { return fresh.Has(cl.Namespace + "/" + cl.Name) }
	var errs []error
	for _, d := range findDoubleAllocations(claims, counters, involves) {
		var facts []claimFacts
		var names []string
		for _, cl := range d.claims {
			w, written := writtenBy(cl)
			facts = append(facts, claimFacts{claim: cl, use: c.claimUse(cl), written: written, item: w.item, released: written && w.forGang()})
			names = append(names, cl.Namespace+"/"+cl.Name)
		}
		dec := decideRepair(facts)
		unrepaired := func(why string) {
			c.metrics.doubles.WithLabelValues("unrepaired").Inc()
			msg := fmt.Sprintf("%s is allocated to claims %s; kept by %s/%s; not taken back: %s", d.what, strings.Join(names, ", "), dec.keep.Namespace, dec.keep.Name, why)
			klog.FromContext(ctx).Error(nil, "Device allocated twice and not repaired", "what", d.what, "claims", names, "why", why)
			c.recordClaim(dec.keep, corev1.EventTypeWarning, ReasonDoubleAllocationUnrepaired, msg)
		}
		for _, why := range dec.unrepaired {
			unrepaired(why)
		}
		for _, f := range dec.takeBack {
			// Cheap first: reserved and within its grace by the informer's
			// copy, it is looked at again later without asking the API
			// server.
			if at, ok := allocatedAt(f.claim); f.use == useReserved && ok && c.opts.Now().Sub(at) < reservedUnboundGrace {
				c.noteAllocation(nil, f.claim)
				continue
			}
			took, err := takeBackClaim(ctx, c.opts.Client, f.claim, c.opts.Now())
			switch {
			case errors.Is(err, errInGrace):
				c.noteAllocation(nil, f.claim) // looked at again next round
				continue
			case errors.Is(err, errInUse):
				unrepaired(f.claim.Namespace + "/" + f.claim.Name + " is in use")
				continue
			case err != nil:
				errs = append(errs, fmt.Errorf("take back claim %s/%s allocated twice (%s): %w", f.claim.Namespace, f.claim.Name, d.what, err))
				c.noteAllocation(nil, f.claim) // looked at again next round
				continue
			case !took:
				continue // gone or changed meanwhile
			}
			c.metrics.doubles.WithLabelValues("repaired").Inc()
			msg := fmt.Sprintf("%s was allocated to claims %s; took back the allocation of %s/%s, which nobody used, and left %s/%s's", d.what,
				strings.Join(names, ", "), f.claim.Namespace, f.claim.Name, dec.keep.Namespace, dec.keep.Name)
			klog.FromContext(ctx).Info("Repaired a double allocation", "what", d.what, "claims", names, "takenBack", klog.KObj(f.claim), "kept", klog.KObj(dec.keep))
			c.recordClaim(f.claim, corev1.EventTypeWarning, ReasonDoubleAllocation, msg)
			errs = append(errs, c.fenceKept(ctx, dec.keep, f.claim))
			errs = append(errs, c.requeueReservation(ctx, f, d.what))
			c.kick()
		}
	}
	return errors.Join(errs...)
}

func splitKey(key string) (namespace, name string) {
	namespace, name, _ = strings.Cut(key, "/")
	return namespace, name
}

// requeueReservation puts a held reservation whose claim was taken back in
// its queue again, where it keeps its place (QueuedAt) and is planned anew
// in the next round; before, it stayed Held holding nothing until its TTL.
func (c *Controller) requeueReservation(ctx context.Context, f claimFacts, what string) error {
	name := f.claim.Labels[gpudrav1.LabelReservation]
	if name == "" {
		return nil
	}
	r := c.reservation(f.claim.Namespace, name)
	if r == nil || !ownedBy(f.claim, r) || r.Status.Phase != gpudrav1.ReservationHeld {
		return nil
	}
	c.rememberRequeued(r.Namespace, r.Name)
	return c.setReservationStatus(ctx, r, func(st *gpudrav1.GpuReservationStatus) {
		st.Phase, st.Reason = gpudrav1.ReservationQueued, gpudrav1.ReasonWaitingForDevices
		st.Message = fmt.Sprintf("%s was allocated twice; claim %s was taken back and the reservation is planned again", what, f.claim.Name)
		if st.QueuedAt == nil {
			st.QueuedAt = ptr.To(r.CreationTimestamp)
		}
		st.HeldAt, st.ExpiresAt, st.Claims, st.Devices, st.Nodes, st.NVLinkDomains = nil, nil, nil, 0, nil, nil
	})
}

// halfWrittenGang lists the claims of a gang still to be planned (some of
// its claims are not allocated) that hold an allocation this controller
// (any leader: writtenBy) wrote for it and that no pod uses.
func (c *Controller) halfWrittenGang(g *Gang) []*resourceapi.ResourceClaim {
	seen := sets.New[string]()
	var out []*resourceapi.ResourceClaim
	for _, p := range g.Pods {
		cls, err := c.podClaims(p)
		if err != nil {
			continue
		}
		for _, cl := range cls {
			key := cl.Namespace + "/" + cl.Name
			if seen.Has(key) || cl.Status.Allocation == nil || len(cl.Status.ReservedFor) > 0 {
				continue
			}
			seen.Insert(key)
			if w, ok := writtenBy(cl); ok && w.item == KindGang+"/"+g.Key {
				out = append(out, cl)
			}
		}
	}
	return out
}

// takeBackGang clears the allocations of a half-written gang's claims, and
// says how many it cleared.
func (c *Controller) takeBackGang(ctx context.Context, g *Gang, claims []*resourceapi.ResourceClaim) (int, error) {
	var errs []error
	n := 0
	for _, cl := range claims {
		took, err := takeBackClaim(ctx, c.opts.Client, cl, c.opts.Now())
		if err != nil {
			errs = append(errs, fmt.Errorf("take back claim %s/%s of half-written gang %s: %w", cl.Namespace, cl.Name, g.Key, err))
			continue
		}
		if took {
			n++
			klog.FromContext(ctx).Info("Took back the allocation of a half-written gang", "gang", g.Key, "claim", klog.KObj(cl))
		}
	}
	return n, errors.Join(errs...)
}
