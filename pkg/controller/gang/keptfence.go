package gang

import (
	"context"
	"fmt"
	"slices"

	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// Kept-device fences: after the repair takes back one of two allocations
// of a device, kube-scheduler's own record of allocated devices has
// dropped the device with the claim taken back, though the claim that kept
// it still holds it, and it may give the device out again. A
// DeviceTaintRule (NoSchedule: the keeping claim's pods are not touched)
// keeps it off the device until the keeping claim no longer holds it. The
// rule names the claim, so that any leader lifts it (liftEndedKeptFences).

// KeptTaintKey is the device taint's key; LabelKeptFor marks the rules and
// holds the keeping claim's UID; AnnotationKeptClaim its namespace/name.
const (
	KeptTaintKey        = gpudrav1.GroupName + "/kept"
	LabelKeptFor        = gpudrav1.GroupName + "/kept-for"
	AnnotationKeptClaim = gpudrav1.GroupName + "/kept-claim"
)

// keptFencesFor are the rules that fence the kept claim's devices that
// the claim taken back held too.
func keptFencesFor(keep, takenBack *resourceapi.ResourceClaim) []*resourceapi.DeviceTaintRule {
	var out []*resourceapi.DeviceTaintRule
	theirs := exclusiveDevices(takenBack)
	for _, d := range exclusiveDevices(keep) {
		if !slices.Contains(theirs, d) {
			continue
		}
		out = append(out, &resourceapi.DeviceTaintRule{
			ObjectMeta: metav1.ObjectMeta{
				Name:        "gpudra-kept-" + fenceName(d)[len("gpudra-fence-"):],
				Labels:      map[string]string{LabelKeptFor: string(keep.UID)},
				Annotations: map[string]string{AnnotationKeptClaim: keep.Namespace + "/" + keep.Name},
			},
			Spec: resourceapi.DeviceTaintRuleSpec{
				DeviceSelector: &resourceapi.DeviceTaintSelector{Driver: ptr.To(d.driver), Pool: ptr.To(d.pool), Device: ptr.To(d.device)},
				Taint:          resourceapi.DeviceTaint{Key: KeptTaintKey, Value: "double-allocation-repaired", Effect: resourceapi.DeviceTaintEffectNoSchedule},
			},
		})
	}
	return out
}

// fenceKept fences the devices the kept claim shares with the one taken
// back.
func (c *Controller) fenceKept(ctx context.Context, keep, takenBack *resourceapi.ResourceClaim) error {
	for _, r := range keptFencesFor(keep, takenBack) {
		_, err := c.opts.Client.ResourceV1().DeviceTaintRules().Create(ctx, r, metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("fence device %s kept by claim %s/%s: %w", fenceSubject(r), keep.Namespace, keep.Name, err)
		}
		klog.FromContext(ctx).V(2).Info("Fenced a repaired device until its claim ends", "deviceTaintRule", r.Name, "claim", klog.KObj(keep))
	}
	return nil
}

// keptFenceEnded says whether a kept-device fence can go: its claim is gone
// or another, or no longer holds the device. claim looks the claim up in
// the informer.
func keptFenceEnded(r *resourceapi.DeviceTaintRule, claim func(namespace, name string) *resourceapi.ResourceClaim) bool {
	ns, name := splitKey(r.Annotations[AnnotationKeptClaim])
	cl := claim(ns, name)
	if cl == nil || string(cl.UID) != r.Labels[LabelKeptFor] || r.Spec.DeviceSelector == nil {
		return true
	}
	sel := r.Spec.DeviceSelector
	return !slices.Contains(exclusiveDevices(cl), deviceRef{ptr.Deref(sel.Driver, ""), ptr.Deref(sel.Pool, ""), ptr.Deref(sel.Device, "")})
}

// liftEndedKeptFences deletes the kept-device fences whose claim ended,
// from the informer of DeviceTaintRules (nil: none is watched).
func (c *Controller) liftEndedKeptFences(ctx context.Context) {
	if c.taintRules == nil {
		return
	}
	for _, obj := range c.taintRules.List() {
		r := obj.(*resourceapi.DeviceTaintRule)
		if r.Labels[LabelKeptFor] == "" || !keptFenceEnded(r, c.claim) {
			continue
		}
		err := c.opts.Client.ResourceV1().DeviceTaintRules().Delete(ctx, r.Name,
			metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: ptr.To(types.UID(r.UID))}})
		if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			klog.FromContext(ctx).Error(err, "Lift the fence of a repaired device", "deviceTaintRule", r.Name)
			continue
		}
		klog.FromContext(ctx).V(2).Info("Lifted the fence of a repaired device: its claim ended", "deviceTaintRule", r.Name)
	}
}
