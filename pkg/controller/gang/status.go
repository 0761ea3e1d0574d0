package gang

import (
	"context"
	"encoding/json"
	"fmt"
	"reflect"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// What the controller reports, on both paths: reservation and queue
// statuses, why a gang waits (its pods' condition, conditions.go), and
// Events.

// Reasons of the Events and the pod condition for gangs.
const (
	ReasonWaitingForPods = "WaitingForPods"
	ReasonGangAllocated  = "GangAllocated"
	// ActionPlan is the action of the controller's Events.
	ActionPlan = "Plan"
)

func metaTime(t time.Time) *metav1.Time {
	mt := metav1.NewTime(t.Truncate(time.Second))
	return &mt
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

// record records an Event on a reservation.
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
	if it.gang.KueueQueue != "" {
		c.reportGang(ctx, it.gang, out.reason, fmt.Sprintf("admitted by Kueue (LocalQueue %s), in no GpuQueue: %s", it.gang.KueueQueue, out.message))
		return nil
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

// recordGang records an Event on a gang's first pod.
func (c *Controller) recordGang(g *Gang, typ, reason, note string) {
	if c.opts.Recorder != nil && len(g.Pods) > 0 {
		c.opts.Recorder.Eventf(g.Pods[0], nil, typ, reason, ActionPlan, "%s", truncate(note))
	}
}

// recordClaim records an Event on a claim.
func (c *Controller) recordClaim(cl *resourceapi.ResourceClaim, typ, reason, msg string) {
	if c.opts.Recorder != nil {
		c.opts.Recorder.Eventf(cl, nil, typ, reason, ActionPlan, "%s", truncate(msg))
	}
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
