package gang

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/allocator"
	"github.com/gpudra/gpudra/pkg/controller/queue"
)

// GpuReservations, held the same way on both paths: each round a queued
// reservation becomes a queue item, and a held one's status is kept true
// (which claims pods use, its TTL). The claims that hold it are created,
// written and owned by the controller.

// reservationItems collects the round's reservations: a queued one becomes
// an item; a held, consumed or expired one is brought up to date
// (syncHeld); a half-written one is taken back to be planned whole.
// heldClaims are the claims (namespace/name) holding reservations; busy
// says that a reservation needs later rounds (any that has not failed).
func (c *Controller) reservationItems(ctx context.Context, snap *snapshot, now time.Time) (items []*item, heldClaims sets.Set[string], busy bool, errs []error) {
	logger := klog.FromContext(ctx)
	heldClaims = sets.New[string]()
	var heldDevices, consumedDevices int
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
			if r.Status.Phase == gpudrav1.ReservationHeld && c.justRequeued(r.Namespace, r.Name) {
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
		if c.justAdmitted(KindReservation + "/" + r.Namespace + "/" + r.Name) {
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
			kept, plan, domain := splitHeld(it.claims, snap.domainOf)
			if len(kept) == 0 {
				// Half written: a leader stopped between two claim writes.
				// Planned around, those claims could break
				// sameNVLinkDomain, and planned again they are refused as
				// already allocated, so the reservation stayed Queued
				// holding devices. They are taken back, and the whole
				// reservation is planned anew next round.
				n, err := c.takeBack(ctx, r, it.claims)
				errs = append(errs, err)
				if n > 0 {
					c.kick()
				}
				continue
			}
			// Some of its claims are in use (a pod consumed them before
			// the repair took another back): those stay, and the others
			// are planned around them, in their NVLink domain when the
			// reservation asks for one.
			it.claims = plan
			if it.sameDomain && domain != "" {
				it.claims, it.asWritten = inDomain(plan, domain), plan
			}
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
	return items, heldClaims, busy, errs
}

// syncHeld keeps a held reservation's status true: which claims pods use,
// and at the TTL, releases (deletes) the claims no pod uses. A claim whose
// pods have all ended was deallocated by the claim controller; it is kept
// until the TTL, so that a pod its owner recreates (a Job's retry, a
// Deployment's replacement) can still name it and have it allocated again.
func (c *Controller) syncHeld(ctx context.Context, r *gpudrav1.GpuReservation, claims []*resourceapi.ResourceClaim, snap *snapshot, now time.Time) error {
	expired := r.Status.ExpiresAt != nil && !now.Before(r.Status.ExpiresAt.Time)
	var errs []error
	var remaining []*resourceapi.ResourceClaim
	everUsed := r.Status.Phase == gpudrav1.ReservationConsumed
	for _, cl := range claims {
		inUse := len(cl.Status.ReservedFor) > 0
		everUsed = everUsed || inUse
		release := expired && !inUse
		if !release {
			remaining = append(remaining, cl)
			continue
		}
		if cl.DeletionTimestamp != nil {
			continue
		}
		err := c.opts.Client.ResourceV1().ResourceClaims(cl.Namespace).Delete(ctx, cl.Name,
			metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &cl.UID, ResourceVersion: &cl.ResourceVersion}})
		if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			errs = append(errs, fmt.Errorf("release claim %s/%s: %w", cl.Namespace, cl.Name, err))
		}
	}
	held, devices, nodes, domains := heldStatus(remaining, snap.domainOf)
	wasExpired := r.Status.Phase == gpudrav1.ReservationExpired
	errs = append(errs, c.setReservationStatus(ctx, r, func(st *gpudrav1.GpuReservationStatus) {
		st.Claims, st.Devices, st.Nodes, st.NVLinkDomains = held, devices, nodes, domains
		st.QueuePosition = 0
		if st.HeldAt == nil {
			// Found held without a status (see round): the TTL starts now.
			st.HeldAt, st.ExpiresAt = metaTime(now), metaTime(now.Add(r.Spec.TTL.Duration))
		}
		inUse := 0
		for _, h := range held {
			if h.InUse {
				inUse++
			}
		}
		switch {
		case expired && inUse == 0:
			st.Phase, st.Reason = gpudrav1.ReservationExpired, gpudrav1.ReasonTTLExpired
			st.Message = "TTL passed; the devices no pod used were released"
		case expired:
			st.Phase, st.Reason = gpudrav1.ReservationConsumed, gpudrav1.ReasonTTLExpired
			st.Message = fmt.Sprintf("TTL passed; %d claims in use stay until their pods end, the others were released", inUse)
		case everUsed:
			st.Phase, st.Reason = gpudrav1.ReservationConsumed, gpudrav1.ReasonAllocated
			st.Message = fmt.Sprintf("%d of %d claims in use", inUse, len(held))
		default:
			st.Phase, st.Reason = gpudrav1.ReservationHeld, gpudrav1.ReasonAllocated
			st.Message = fmt.Sprintf("%d devices held on %v", devices, nodes)
		}
	}))
	if r.Status.Phase == gpudrav1.ReservationExpired && !wasExpired {
		c.metrics.expired.Inc()
	}
	return errors.Join(errs...)
}

// claimName is the name of a reservation's i-th claim.
func claimName(r *gpudrav1.GpuReservation, i int) string {
	return fmt.Sprintf("%s-%d", r.Name, i)
}

// reservationClaims are the claims that hold a reservation's devices, as
// they are created: one request of Count devices in the count form (the
// form the structured allocator searches quickly), with the NVLink domain
// constraint when asked for, owned by the reservation so that deleting it
// deletes them. existing returns a claim that already exists (a round that
// stopped half-way); those are used as they are.
func reservationClaims(r *gpudrav1.GpuReservation, existing func(namespace, name string) *resourceapi.ResourceClaim) []*resourceapi.ResourceClaim {
	spec := r.Spec
	claims := make([]*resourceapi.ResourceClaim, 0, spec.Claims)
	for i := range int(max(spec.Claims, 1)) {
		name := claimName(r, i)
		if c := existing(r.Namespace, name); c != nil {
			claims = append(claims, c)
			continue
		}
		req := resourceapi.ExactDeviceRequest{
			DeviceClassName: spec.DeviceClassName,
			AllocationMode:  resourceapi.DeviceAllocationModeExactCount,
			Count:           max(spec.Count, 1),
		}
		for _, sel := range spec.Selectors {
			req.Selectors = append(req.Selectors, resourceapi.DeviceSelector{CEL: &resourceapi.CELDeviceSelector{Expression: sel}})
		}
		c := &resourceapi.ResourceClaim{
			ObjectMeta: metav1.ObjectMeta{
				Name: name, Namespace: r.Namespace,
				Labels: map[string]string{gpudrav1.LabelReservation: r.Name},
				OwnerReferences: []metav1.OwnerReference{{
					APIVersion: gpudrav1.APIVersion, Kind: gpudrav1.KindGpuReservation, Name: r.Name, UID: r.UID,
					Controller: ptr.To(true),
				}},
			},
			Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
				Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &req}},
			}},
		}
		if spec.SameNVLinkDomain && req.Count > 1 {
			c.Spec.Devices.Constraints = []resourceapi.DeviceConstraint{{
				MatchAttribute: ptr.To(resourceapi.FullyQualifiedName(allocator.NVLinkDomainAttribute)),
			}}
		}
		claims = append(claims, c)
	}
	return claims
}

// heldStatus describes a reservation's claims as they are now: the devices,
// nodes and domains held and which claims pods use.
func heldStatus(claims []*resourceapi.ResourceClaim, deviceDomain func(pool, device string) string) (held []gpudrav1.HeldClaim, devices int32, nodes, domains []string) {
	nodeSet, domainSet := sets.New[string](), sets.New[string]()
	for _, c := range claims {
		if c.Status.Allocation == nil {
			continue
		}
		h := gpudrav1.HeldClaim{Name: c.Name, InUse: len(c.Status.ReservedFor) > 0}
		for _, d := range c.Status.Allocation.Devices.Results {
			h.Devices = append(h.Devices, d.Pool+"/"+d.Device)
			h.Node = d.Pool
			devices++
			if dom := deviceDomain(d.Pool, d.Device); dom != "" {
				domainSet.Insert(dom)
			}
		}
		nodeSet.Insert(h.Node)
		held = append(held, h)
	}
	slices.SortFunc(held, func(a, b gpudrav1.HeldClaim) int { return strings.Compare(a.Name, b.Name) })
	return held, devices, sets.List(nodeSet), sets.List(domainSet)
}

// takeBack clears the allocations of a half-written reservation's claims
// (none in use), and says how many it cleared.
func (c *Controller) takeBack(ctx context.Context, r *gpudrav1.GpuReservation, claims []*resourceapi.ResourceClaim) (int, error) {
	var errs []error
	n := 0
	for _, cl := range claims {
		if cl.UID == "" || cl.Status.Allocation == nil {
			continue
		}
		took, err := takeBackClaim(ctx, c.opts.Client, cl, c.opts.Now())
		if err != nil {
			errs = append(errs, fmt.Errorf("take back claim %s/%s of reservation %s: %w", cl.Namespace, cl.Name, r.Name, err))
			continue
		}
		if took {
			n++
			klog.FromContext(ctx).Info("Took back the allocation of a half-written reservation", "reservation", klog.KObj(r), "claim", klog.KObj(cl))
		}
	}
	return n, errors.Join(errs...)
}

// splitHeld splits a queued reservation's claims: kept are those pods use
// (with every other allocated one: planned around, not taken back), plan
// those to allocate; domain is the NVLink domain of the kept devices ("" for
// none, or for more than one).
func splitHeld(claims []*resourceapi.ResourceClaim, domainOf func(pool, device string) string) (kept, plan []*resourceapi.ResourceClaim, domain string) {
	used := false
	domains := sets.New[string]()
	for _, cl := range claims {
		if cl.Status.Allocation == nil {
			plan = append(plan, cl)
			continue
		}
		kept = append(kept, cl)
		used = used || len(cl.Status.ReservedFor) > 0
		for _, d := range cl.Status.Allocation.Devices.Results {
			domains.Insert(domainOf(d.Pool, d.Device))
		}
	}
	if !used {
		return nil, claims, ""
	}
	if domains.Len() == 1 {
		domain = domains.UnsortedList()[0]
	}
	return kept, plan, domain
}

// inDomain are copies of claims, for planning only, whose requests also
// select the NVLink domain: an allocation planned from them satisfies the
// claims as they are, and lands beside the devices already held. The
// claims as they are (item.asWritten) are what is written.
func inDomain(claims []*resourceapi.ResourceClaim, domain string) []*resourceapi.ResourceClaim {
	sel := resourceapi.DeviceSelector{CEL: &resourceapi.CELDeviceSelector{Expression: fmt.Sprintf("device.attributes[%q].%s == %q",
		allocator.DriverName, strings.TrimPrefix(string(allocator.NVLinkDomainAttribute), allocator.DriverName+"/"), domain)}}
	out := make([]*resourceapi.ResourceClaim, 0, len(claims))
	for _, cl := range claims {
		cl = cl.DeepCopy()
		for i := range cl.Spec.Devices.Requests {
			if r := cl.Spec.Devices.Requests[i].Exactly; r != nil {
				r.Selectors = append(r.Selectors, sel)
			}
		}
		out = append(out, cl)
	}
	return out
}

// ownedBy says whether a claim is one the reservation created (its owner).
func ownedBy(cl *resourceapi.ResourceClaim, r *gpudrav1.GpuReservation) bool {
	for _, o := range cl.OwnerReferences {
		if o.UID == r.UID && o.Kind == gpudrav1.KindGpuReservation {
			return true
		}
	}
	return false
}

// reservationIndex indexes claims by the reservation that holds them.
const reservationIndex = "reservation"

func claimReservation(obj any) ([]string, error) {
	c, ok := obj.(*resourceapi.ResourceClaim)
	if !ok {
		return nil, nil
	}
	if r := c.Labels[gpudrav1.LabelReservation]; r != "" {
		return []string{c.Namespace + "/" + r}, nil
	}
	return nil, nil
}

// reservationClaimsOf are the claims holding a reservation.
func (c *Controller) reservationClaimsOf(r *gpudrav1.GpuReservation) []*resourceapi.ResourceClaim {
	objs, _ := c.claims.ByIndex(reservationIndex, r.Namespace+"/"+r.Name)
	out := make([]*resourceapi.ResourceClaim, 0, len(objs))
	for _, o := range objs {
		cl := o.(*resourceapi.ResourceClaim)
		if ownedBy(cl, r) {
			out = append(out, cl)
		}
	}
	return out
}

// reservation is a GpuReservation from the informer, or nil.
func (c *Controller) reservation(namespace, name string) *gpudrav1.GpuReservation {
	obj, ok, err := c.reservations.GetByKey(namespace + "/" + name)
	if err != nil || !ok {
		return nil
	}
	r, err := gpudrav1.FromUnstructured[gpudrav1.GpuReservation](obj.(*unstructured.Unstructured))
	if err != nil {
		return nil
	}
	r.Default()
	return r
}
