package gang

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/allocator"
)

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

// takeBack clears the allocations of a reservation's claims that no pod
// uses, after a half-written plan.
func (c *Controller) takeBack(ctx context.Context, r *gpudrav1.GpuReservation, claims []*resourceapi.ResourceClaim) error {
	var errs []error
	for _, cl := range claims {
		if cl.UID == "" || cl.Status.Allocation == nil || len(cl.Status.ReservedFor) > 0 {
			continue
		}
		if err := c.committer.unwrite(ctx, cl, false); err != nil {
			errs = append(errs, fmt.Errorf("take back claim %s/%s of reservation %s: %w", cl.Namespace, cl.Name, r.Name, err))
			continue
		}
		klog.FromContext(ctx).Info("Took back the allocation of a half-written reservation", "reservation", klog.KObj(r), "claim", klog.KObj(cl))
	}
	return errors.Join(errs...)
}
