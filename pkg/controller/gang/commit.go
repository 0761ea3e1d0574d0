package gang

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/allocator"
)

// FenceTaintKey is the key of the device taint that fences devices while
// the controller writes their allocation; LabelFence marks the
// DeviceTaintRules so that leftovers of a crashed leader are found.
const (
	FenceTaintKey = gpudrav1.GroupName + "/fence"
	LabelFence    = gpudrav1.GroupName + "/fence"
)

// ErrConflict says that a planned device was taken before its allocation
// was written; nothing was written and the item is planned again.
var ErrConflict = errors.New("a planned device was allocated by someone else")

// committer writes a plan: it fences the devices with a DeviceTaintRule
// each (the scheduler stops choosing them), waits for the fence to reach
// the scheduler, checks with the API server that the devices are still
// free, writes the allocations, and lifts the fence. The kubelet plugin's
// refusal of a device prepared twice stays the last line.
type committer struct {
	client kubernetes.Interface
	// settle is how long a fence is given to reach the scheduler's
	// informer, and an allocation the scheduler decided before it to be
	// written, before the check.
	settle time.Duration
}

// deviceRef names one allocated device.
type deviceRef struct{ driver, pool, device string }

func planDevices(plan allocator.Result) []deviceRef {
	var out []deviceRef
	for _, a := range plan.Allocations {
		for _, r := range a.Result.Devices.Results {
			if ptr.Deref(r.AdminAccess, false) || r.ShareID != nil {
				continue // not exclusive: nothing to fence
			}
			out = append(out, deviceRef{r.Driver, r.Pool, r.Device})
		}
	}
	return out
}

// fenceName is a DeviceTaintRule's name: stable per device, so that a
// second fence of the same device (two rounds racing after a leader
// change) collides instead of stacking.
func fenceName(d deviceRef) string {
	sum := sha256.Sum256([]byte(d.driver + "/" + d.pool + "/" + d.device))
	return "gpudra-fence-" + hex.EncodeToString(sum[:8])
}

// commit writes plan's allocations. create says which claims do not exist
// yet (a reservation's): they are created first, with the scheduler's
// finalizer so that the claim controller deallocates them when their last
// user goes.
func (c *committer) commit(ctx context.Context, plan allocator.Result, create sets.Set[string]) error {
	logger := klog.FromContext(ctx)
	devices := planDevices(plan)
	var fences []string
	defer func() {
		// Lift the fence whatever happened: a leftover fence only keeps the
		// scheduler away from free devices (and is swept up later).
		for _, name := range fences {
			if err := c.client.ResourceV1().DeviceTaintRules().Delete(context.WithoutCancel(ctx), name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
				logger.Error(err, "Lift device fence", "deviceTaintRule", name)
			}
		}
	}()
	for _, d := range devices {
		rule := &resourceapi.DeviceTaintRule{
			ObjectMeta: metav1.ObjectMeta{Name: fenceName(d), Labels: map[string]string{LabelFence: "true"}},
			Spec: resourceapi.DeviceTaintRuleSpec{
				DeviceSelector: &resourceapi.DeviceTaintSelector{Driver: &d.driver, Pool: &d.pool, Device: &d.device},
				Taint:          resourceapi.DeviceTaint{Key: FenceTaintKey, Value: "allocating", Effect: resourceapi.DeviceTaintEffectNoSchedule},
			},
		}
		if _, err := c.client.ResourceV1().DeviceTaintRules().Create(ctx, rule, metav1.CreateOptions{}); err != nil {
			if apierrors.IsAlreadyExists(err) {
				return fmt.Errorf("device %s/%s is fenced by another allocation: %w", d.pool, d.device, ErrConflict)
			}
			return fmt.Errorf("fence device %s/%s: %w", d.pool, d.device, err)
		}
		fences = append(fences, rule.Name)
	}
	if c.settle > 0 {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(c.settle):
		}
	}
	if err := c.checkFree(ctx, devices, plan); err != nil {
		return err
	}
	for i, a := range plan.Allocations {
		if err := c.write(ctx, a, create.Has(a.Claim.Namespace+"/"+a.Claim.Name)); err != nil {
			// All or nothing: take back what was written.
			for _, done := range plan.Allocations[:i] {
				if uerr := c.unwrite(context.WithoutCancel(ctx), done.Claim, create.Has(done.Claim.Namespace+"/"+done.Claim.Name)); uerr != nil {
					logger.Error(uerr, "Take back a partly written plan", "claim", klog.KObj(done.Claim))
				}
			}
			return err
		}
	}
	return nil
}

// unwrite takes back one written allocation: a claim it created is
// deleted (the claim controller clears its allocation and finalizer), an
// existing one gets its allocation cleared.
func (c *committer) unwrite(ctx context.Context, claim *resourceapi.ResourceClaim, created bool) error {
	claims := c.client.ResourceV1().ResourceClaims(claim.Namespace)
	if created {
		if err := claims.Delete(ctx, claim.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return err
		}
		return nil
	}
	cur, err := claims.Get(ctx, claim.Name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	if len(cur.Status.ReservedFor) > 0 {
		return fmt.Errorf("claim %s/%s is already in use", claim.Namespace, claim.Name)
	}
	cur.Status.Allocation = nil
	_, err = claims.UpdateStatus(ctx, cur, metav1.UpdateOptions{})
	return err
}

// checkFree lists the claims from the API server (not the informer, which
// may lag) and fails with ErrConflict when another claim holds one of the
// devices, or a device sharing a counter set with it is not visible here:
// the structured allocator's plan already accounted for counters against
// the snapshot, so only exact device collisions are checked.
func (c *committer) checkFree(ctx context.Context, devices []deviceRef, plan allocator.Result) error {
	mine := sets.New[types.UID]()
	for _, a := range plan.Allocations {
		if a.Claim.UID != "" {
			mine.Insert(a.Claim.UID)
		}
	}
	want := sets.New[deviceRef](devices...)
	list, err := c.client.ResourceV1().ResourceClaims("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("check planned devices are free: %w", err)
	}
	for _, claim := range list.Items {
		if claim.Status.Allocation == nil || mine.Has(claim.UID) {
			continue
		}
		for _, r := range claim.Status.Allocation.Devices.Results {
			if r.ShareID != nil || ptr.Deref(r.AdminAccess, false) {
				continue
			}
			if want.Has(deviceRef{r.Driver, r.Pool, r.Device}) {
				return fmt.Errorf("device %s/%s is now in claim %s/%s: %w", r.Pool, r.Device, claim.Namespace, claim.Name, ErrConflict)
			}
		}
	}
	return nil
}

// write creates the claim if asked, adds the scheduler's finalizer, and
// writes the allocation into its status.
func (c *committer) write(ctx context.Context, a allocator.ClaimAllocation, create bool) error {
	claims := c.client.ResourceV1().ResourceClaims(a.Claim.Namespace)
	claim := a.Claim.DeepCopy()
	var err error
	if create {
		claim.Finalizers = append(claim.Finalizers, resourceapi.Finalizer)
		if claim, err = claims.Create(ctx, claim, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create claim %s/%s: %w", a.Claim.Namespace, a.Claim.Name, err)
		}
	} else if !slices.Contains(claim.Finalizers, resourceapi.Finalizer) {
		claim.Finalizers = append(claim.Finalizers, resourceapi.Finalizer)
		if claim, err = claims.Update(ctx, claim, metav1.UpdateOptions{}); err != nil {
			if apierrors.IsNotFound(err) || apierrors.IsConflict(err) {
				// Deleted or changed since the snapshot: plan again.
				return fmt.Errorf("claim %s/%s changed: %w: %w", a.Claim.Namespace, a.Claim.Name, err, ErrConflict)
			}
			return fmt.Errorf("add finalizer to claim %s/%s: %w", a.Claim.Namespace, a.Claim.Name, err)
		}
	}
	if claim.Status.Allocation != nil {
		return fmt.Errorf("claim %s/%s was allocated meanwhile: %w", claim.Namespace, claim.Name, ErrConflict)
	}
	claim.Status.Allocation = a.Result.DeepCopy()
	claim.Status.Allocation.AllocationTimestamp = ptr.To(metav1.Now())
	if _, err := claims.UpdateStatus(ctx, claim, metav1.UpdateOptions{}); err != nil {
		if apierrors.IsNotFound(err) || apierrors.IsConflict(err) {
			return fmt.Errorf("claim %s/%s changed: %w: %w", claim.Namespace, claim.Name, err, ErrConflict)
		}
		return fmt.Errorf("write allocation of claim %s/%s: %w", claim.Namespace, claim.Name, err)
	}
	return nil
}

// ungate removes gpudra's scheduling gate from a pod with a JSON patch
// that tests the gates first, so that a concurrent change (Grove lifting
// its own gate) is not lost; on such a change it reads the pod again.
func ungate(ctx context.Context, client kubernetes.Interface, p *corev1.Pod) error {
	for attempt := 0; ; attempt++ {
		if !gated(p) {
			return nil
		}
		var gates []corev1.PodSchedulingGate
		for _, g := range p.Spec.SchedulingGates {
			if g.Name != gpudrav1.SchedulingGate {
				gates = append(gates, g)
			}
		}
		if gates == nil {
			gates = []corev1.PodSchedulingGate{}
		}
		patch, err := json.Marshal([]map[string]any{
			{"op": "test", "path": "/spec/schedulingGates", "value": p.Spec.SchedulingGates},
			{"op": "replace", "path": "/spec/schedulingGates", "value": gates},
		})
		if err != nil {
			return err
		}
		_, err = client.CoreV1().Pods(p.Namespace).Patch(ctx, p.Name, types.JSONPatchType, patch, metav1.PatchOptions{})
		switch {
		case err == nil || apierrors.IsNotFound(err):
			return nil
		case (apierrors.IsInvalid(err) || apierrors.IsBadRequest(err)) && attempt < 3:
			// The test failed: the gates changed meanwhile.
			fresh, gerr := client.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
			if apierrors.IsNotFound(gerr) {
				return nil
			}
			if gerr != nil {
				return fmt.Errorf("lift the gang gate of pod %s/%s: %w", p.Namespace, p.Name, gerr)
			}
			p = fresh
		default:
			return fmt.Errorf("lift the gang gate of pod %s/%s: %w", p.Namespace, p.Name, err)
		}
	}
}

// sweepFences deletes fences older than maxAge: a leader that died between
// fencing and lifting leaves them behind.
func sweepFences(ctx context.Context, client kubernetes.Interface, now time.Time, maxAge time.Duration) error {
	list, err := client.ResourceV1().DeviceTaintRules().List(ctx, metav1.ListOptions{LabelSelector: LabelFence + "=true"})
	if err != nil {
		return fmt.Errorf("list device fences: %w", err)
	}
	for _, r := range list.Items {
		if now.Sub(r.CreationTimestamp.Time) < maxAge {
			continue
		}
		if err := client.ResourceV1().DeviceTaintRules().Delete(ctx, r.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete stale device fence %s: %w", r.Name, err)
		}
	}
	return nil
}
