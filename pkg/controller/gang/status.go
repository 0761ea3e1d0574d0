package gang

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// Reasons of the Events and the pod condition for gangs.
const (
	ReasonWaitingForPods = "WaitingForPods"
	ReasonGangAllocated  = "GangAllocated"
	// PodConditionGang is the condition gpudra sets on a gated gang pod:
	// False with the reason it waits, while it waits.
	PodConditionGang corev1.PodConditionType = gpudrav1.GroupName + "/GangAllocated"
	// ActionPlan is the action of the controller's Events.
	ActionPlan = "Plan"
)

func metaTime(t time.Time) *metav1.Time {
	mt := metav1.NewTime(t.Truncate(time.Second))
	return &mt
}

func ownedBy(cl *resourceapi.ResourceClaim, r *gpudrav1.GpuReservation) bool {
	for _, o := range cl.OwnerReferences {
		if o.UID == r.UID && o.Kind == gpudrav1.KindGpuReservation {
			return true
		}
	}
	return false
}

// queue returns the GpuQueue of a name, nil when there is none.
func (c *Controller) queue(name string) *gpudrav1.GpuQueue {
	obj, ok, err := c.queues.GetByKey(name)
	if err != nil || !ok {
		return nil
	}
	q, err := gpudrav1.FromUnstructured[gpudrav1.GpuQueue](obj.(*unstructured.Unstructured))
	if err != nil {
		return nil
	}
	return q
}

// setReservationStatus applies change to a copy of the status and writes
// it when it changed; an Event is recorded when phase or reason change.
func (c *Controller) setReservationStatus(ctx context.Context, r *gpudrav1.GpuReservation, change func(*gpudrav1.GpuReservationStatus)) error {
	st := *r.Status.DeepCopy()
	change(&st)
	st.ObservedGeneration = r.Generation
	if reflect.DeepEqual(st, r.Status) {
		return nil
	}
	if st.Phase != r.Status.Phase || st.Reason != r.Status.Reason {
		typ := corev1.EventTypeNormal
		if st.Phase == gpudrav1.ReservationFailed || st.Reason == gpudrav1.ReasonUnsatisfiable {
			typ = corev1.EventTypeWarning
		}
		c.record(r, typ, string(st.Phase), st.Reason+": "+st.Message)
	}
	if written, err := c.updateStatus(ctx, c.reservations, gpudrav1.GpuReservations, r.Namespace, r.Name, st); !written {
		return err
	}
	r.Status = st
	return nil
}

func (c *Controller) record(r *gpudrav1.GpuReservation, typ, reason, note string) {
	if c.opts.Recorder == nil {
		return
	}
	u := &unstructured.Unstructured{}
	u.SetAPIVersion(gpudrav1.APIVersion)
	u.SetKind(gpudrav1.KindGpuReservation)
	u.SetNamespace(r.Namespace)
	u.SetName(r.Name)
	u.SetUID(r.UID)
	u.SetResourceVersion(r.ResourceVersion)
	c.opts.Recorder.Eventf(u, nil, typ, reason, ActionPlan, "%s", truncate(note))
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

// reportWaiting writes why an item waits: a reservation's status, a gang's
// pod condition and Event.
func (c *Controller) reportWaiting(ctx context.Context, it *item, out outcome, now time.Time) error {
	if it.kind == KindReservation {
		return c.setReservationStatus(ctx, it.res, func(st *gpudrav1.GpuReservationStatus) {
			st.Phase, st.Reason, st.Message, st.QueuePosition = gpudrav1.ReservationQueued, out.reason, out.message, int32(out.position)
			if st.QueuedAt == nil {
				st.QueuedAt = metaTime(it.QueuedAt)
			}
		})
	}
	c.reportGang(ctx, it.gang, out.reason, fmt.Sprintf("position %d in queue %s: %s", out.position, it.queueName, out.message))
	return nil
}

// reportGang sets the gang pods' condition and records an Event on its
// first pod when the reason or message changes.
func (c *Controller) reportGang(ctx context.Context, g *Gang, reason, message string) {
	c.mu.Lock()
	last := c.reported[g.Key]
	c.reported[g.Key] = reason + ": " + message
	c.mu.Unlock()
	if last == reason+": "+message {
		return
	}
	typ := corev1.EventTypeNormal
	if reason == "Unsatisfiable" {
		typ = corev1.EventTypeWarning
	}
	c.recordGang(g, typ, reason, fmt.Sprintf("gang %s: %s", g.Name, message))
	patch := gangConditionPatch(corev1.ConditionFalse, reason, message)
	for _, p := range g.Waiting {
		if err := c.conditions.set(ctx, p, patch); err != nil {
			klog.FromContext(ctx).Error(err, "Set gang condition", "pod", klog.KObj(p))
		}
	}
}

// gangConditionPatch is the status patch that sets gpudra's pod condition:
// a strategic merge of one condition, by type, that leaves the others.
func gangConditionPatch(status corev1.ConditionStatus, reason, message string) []byte {
	cond := map[string]any{"type": PodConditionGang, "status": status, "reason": reason, "message": truncate(message),
		"lastTransitionTime": metav1.Now().UTC().Format(time.RFC3339)}
	patch, _ := json.Marshal(map[string]any{"status": map[string]any{"conditions": []any{cond}}})
	return patch
}

// setGangCondition applies a gangConditionPatch to a pod; a pod gone is no
// error.
func setGangCondition(ctx context.Context, client kubernetes.Interface, p *corev1.Pod, patch []byte) error {
	_, err := client.CoreV1().Pods(p.Namespace).Patch(ctx, p.Name, types.StrategicMergePatchType, patch, metav1.PatchOptions{}, "status")
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("set gang condition of pod %s/%s: %w", p.Namespace, p.Name, err)
	}
	return nil
}

func (c *Controller) recordGang(g *Gang, typ, reason, note string) {
	if c.opts.Recorder != nil && len(g.Pods) > 0 {
		c.opts.Recorder.Eventf(g.Pods[0], nil, typ, reason, ActionPlan, "%s", truncate(note))
	}
}

// admitGang hands over the waiting members of a gang that needs no planning
// (admitted before, or all its claims allocated): on the gate path their
// gates are lifted; on the Workload API path its PodGroup is made.
func (c *Controller) admitGang(ctx context.Context, g *Gang) error {
	if c.opts.Path == PathWorkload {
		if err := c.handOff(ctx, g, ""); err != nil {
			return err
		}
		return c.markHandedOff(ctx, g)
	}
	return c.release(ctx, g)
}

// release marks the gang allocated on its gated members and lifts their
// gates.
func (c *Controller) release(ctx context.Context, g *Gang) error {
	c.mu.Lock()
	delete(c.reported, g.Key)
	c.mu.Unlock()
	patch := gangConditionPatch(corev1.ConditionTrue, ReasonGangAllocated, "the gang's devices are allocated")
	var errs []error
	for _, p := range g.Waiting {
		if err := c.conditions.set(ctx, p, patch); err != nil {
			errs = append(errs, err)
		}
		if err := ungate(ctx, c.opts.Client, p); err != nil {
			errs = append(errs, err)
			continue
		}
		c.remember("pod/" + string(p.UID))
	}
	return errors.Join(errs...)
}

// setQueueStatus writes a GpuQueue's status, when the object exists.
func (c *Controller) setQueueStatus(ctx context.Context, name string, waiting int, devices int64, head string) error {
	q := c.queue(name)
	if q == nil {
		return nil
	}
	st := gpudrav1.GpuQueueStatus{Waiting: int32(waiting), WaitingDevices: devices, Head: head}
	if head != "" {
		st.HeadReason = gpudrav1.ReasonWaitingForDevices
	}
	if reflect.DeepEqual(st, q.Status) {
		return nil
	}
	_, err := c.updateStatus(ctx, c.queues, gpudrav1.GpuQueues, "", name, st)
	return err
}

// updateStatus replaces the status of one of gpudra's objects: an update
// of the whole status, not a merge patch, since fields that became empty
// must go. A conflict or a deleted object is no error, and nothing
// written: the informer has a newer object, and the next round redoes it.
func (c *Controller) updateStatus(ctx context.Context, store cache.Store, gvr schema.GroupVersionResource, namespace, name string, status any) (written bool, err error) {
	key := name
	if namespace != "" {
		key = namespace + "/" + name
	}
	obj, ok, err := store.GetByKey(key)
	if err != nil || !ok {
		return false, nil // deleted meanwhile
	}
	u := obj.(*unstructured.Unstructured).DeepCopy()
	if err := setStatus(u, status); err != nil {
		return false, err
	}
	if _, err := c.opts.Dynamic.Resource(gvr).Namespace(namespace).UpdateStatus(ctx, u, metav1.UpdateOptions{}); err != nil {
		if apierrors.IsConflict(err) || apierrors.IsNotFound(err) {
			c.kick()
			return false, nil
		}
		return false, fmt.Errorf("update status of %s %s: %w", gvr.Resource, key, err)
	}
	return true, nil
}

// truncate keeps Event notes under the API's 1 kB limit.
func truncate(s string) string {
	if len(s) > 1000 {
		return s[:997] + "..."
	}
	return s
}

// setStatus replaces an object's status.
func setStatus(u *unstructured.Unstructured, status any) error {
	raw, err := json.Marshal(status)
	if err != nil {
		return err
	}
	var m map[string]any
	if err := json.Unmarshal(raw, &m); err != nil {
		return err
	}
	u.Object["status"] = m
	return nil
}
