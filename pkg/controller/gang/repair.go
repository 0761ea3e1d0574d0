package gang

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
)

// ReasonDoubleAllocation is the Event reason when a device was found in two
// claims and this controller took its own allocation back.
const ReasonDoubleAllocation = "DoubleAllocationRepaired"

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
		if cl.Status.Allocation == nil {
			continue
		}
		for _, r := range cl.Status.Allocation.Devices.Results {
			if r.ShareID != nil || ptr.Deref(r.AdminAccess, false) {
				continue
			}
			d := deviceRef{r.Driver, r.Pool, r.Device}
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

// repairDoubleAllocations finds devices that this controller and the
// scheduler both allocated (the fence makes it rare, not impossible: a
// scheduler whose informer had not seen the fence) and takes back this
// controller's own allocation when no pod uses it yet, so that the item is
// planned again: a bounded, visible event (a metric, a Warning Event, a log
// line) instead of a pod stuck in ContainerCreating on the plugin's refusal.
//
// Only devices that one of its own recent writes holds are looked at: the
// scheduler alone keeps its own allocations apart, and a round with no
// recent write of this controller does no work that grows with the
// cluster here.
func (c *Controller) repairDoubleAllocations(ctx context.Context, snap *snapshot) error {
	if len(c.committer.written) == 0 {
		return nil
	}
	counters := snap.counters()
	var claims []*resourceapi.ResourceClaim
	for _, o := range c.claims.List() {
		claims = append(claims, o.(*resourceapi.ResourceClaim))
	}
	mine := func(cl *resourceapi.ResourceClaim) bool {
		_, ok := c.committer.written[cl.UID]
		return ok
	}
	var errs []error
	for _, d := range findDoubleAllocations(claims, counters, mine) {
		var ours *resourceapi.ResourceClaim
		for _, cl := range d.claims {
			if _, mine := c.committer.written[cl.UID]; mine && len(cl.Status.ReservedFor) == 0 {
				ours = cl
				break
			}
		}
		var names []string
		for _, cl := range d.claims {
			names = append(names, cl.Namespace+"/"+cl.Name)
		}
		if ours == nil {
			c.metrics.doubles.WithLabelValues("unrepaired").Inc()
			klog.FromContext(ctx).Error(nil, "Device allocated twice; this controller's claim is in use already", "what", d.what, "claims", names)
			continue
		}
		if err := c.committer.unwrite(ctx, ours, false); err != nil {
			errs = append(errs, fmt.Errorf("take back claim %s/%s allocated twice (%s): %w", ours.Namespace, ours.Name, d.what, err))
			continue
		}
		delete(c.committer.written, ours.UID)
		c.metrics.doubles.WithLabelValues("repaired").Inc()
		msg := fmt.Sprintf("%s was allocated to claims %s; took back this controller's allocation of %s/%s, which is planned again", d.what, strings.Join(names, ", "), ours.Namespace, ours.Name)
		klog.FromContext(ctx).Info("Repaired a double allocation", "what", d.what, "claims", names, "takenBack", klog.KObj(ours))
		if c.opts.Recorder != nil {
			c.opts.Recorder.Eventf(ours, nil, corev1.EventTypeWarning, ReasonDoubleAllocation, ActionPlan, "%s", truncate(msg))
		}
		c.kick()
	}
	return errors.Join(errs...)
}
