package gang

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// Taking an allocation back: one function (takeBackClaim) and one rule for
// "in use" (useOf), for every caller: the double-allocation repair, a
// half-written reservation or gang, a plan rolled back. The rule is decided
// on the informers' copy (cheap, every round) and checked again on the API
// server's (before the write), since the informers lag: a pod bound a
// moment ago is in use even if the informer still shows it Pending.

// use says how far a claim's allocation is from being taken back.
type use int

const (
	// useNone: no consumer; taking it back costs nothing.
	useNone use = iota
	// useReserved: reserved for pods none of which is bound yet (the
	// scheduler wrote it at PreBind and binds next, or its pods stay
	// Pending on a device that is not theirs).
	useReserved
	// useInUse: reserved for a bound pod (the kubelet prepares it, or did),
	// for a consumer this controller cannot see, or a pod it could not
	// look up.
	useInUse
)

// reservedUnboundGrace: an allocation reserved for pods none of which is
// bound is taken back only this long after it was written, so that a
// binding in flight (PreBind wrote it, Bind comes next) is never cut.
const reservedUnboundGrace = 30 * time.Second

// podLookup finds a pod by namespace and name: nil and no error when it
// does not exist; an error when it could not tell.
type podLookup func(namespace, name string) (*corev1.Pod, error)

// useOf is the one rule: a claim reserved for anything but pods, for a pod
// that is bound, gone or replaced (its UID differs), or for a pod that could
// not be looked up, is in use; one reserved only for pods not bound yet is
// reserved; one reserved for nothing is free.
func useOf(cl *resourceapi.ResourceClaim, pod podLookup) use {
	if len(cl.Status.ReservedFor) == 0 {
		return useNone
	}
	for _, r := range cl.Status.ReservedFor {
		if r.APIGroup != "" || r.Resource != "pods" {
			return useInUse
		}
		p, err := pod(cl.Namespace, r.Name)
		if err != nil || p == nil || p.UID != r.UID || p.Spec.NodeName != "" {
			return useInUse
		}
	}
	return useReserved
}

// claimUse is useOf over the pod informer.
func (c *Controller) claimUse(cl *resourceapi.ResourceClaim) use {
	return useOf(cl, func(namespace, name string) (*corev1.Pod, error) {
		obj, ok, err := c.pods.GetByKey(namespace + "/" + name)
		if err != nil || !ok {
			return nil, err
		}
		return obj.(*corev1.Pod), nil
	})
}

// livePods looks pods up on the API server.
func livePods(ctx context.Context, client kubernetes.Interface) podLookup {
	return func(namespace, name string) (*corev1.Pod, error) {
		p, err := client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil, nil
		}
		return p, err
	}
}

// allocatedAt is when a claim's allocation was written: its
// allocationTimestamp, which upstream says may be unset; then the last write
// of its status that the API server recorded (managedFields, on the API
// server's copy only: the informers drop them), which is the allocation's or
// later. ok is false when neither says: the allocation counts as just
// written.
func allocatedAt(cl *resourceapi.ResourceClaim) (at time.Time, ok bool) {
	if a := cl.Status.Allocation; a != nil && a.AllocationTimestamp != nil {
		return a.AllocationTimestamp.Time, true
	}
	for _, m := range cl.ManagedFields {
		if m.Subresource == "status" && m.Time != nil && m.Time.After(at) {
			at, ok = m.Time.Time, true
		}
	}
	return at, ok
}

// errInGrace says that an allocation reserved for pods not bound yet was
// written less than reservedUnboundGrace ago: look again later.
var errInGrace = errors.New("reserved for pods not bound yet, and written less than the grace ago")

// errInUse says that a claim to take back is in use (useInUse).
var errInUse = errors.New("in use")

// takeBackClaim clears a claim's allocation, and its reservation for pods
// not bound yet, if the API server's copy still holds the allocation that
// seen shows (same claim, same devices) and useOf over the API server's
// pods allows it: free, or reserved past the grace. It reports whether it
// cleared anything; a claim gone or changed meanwhile is left, as nothing to
// do; one in use or in its grace is an error (errInUse, errInGrace).
func takeBackClaim(ctx context.Context, client kubernetes.Interface, seen *resourceapi.ResourceClaim, now time.Time) (bool, error) {
	claims := client.ResourceV1().ResourceClaims(seen.Namespace)
	cur, err := claims.Get(ctx, seen.Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if cur.UID != seen.UID || cur.Status.Allocation == nil || !slices.Equal(exclusiveDevices(cur), exclusiveDevices(seen)) {
		return false, nil // changed meanwhile: not the allocation meant
	}
	switch useOf(cur, livePods(ctx, client)) {
	case useInUse:
		return false, fmt.Errorf("claim %s/%s: %w", cur.Namespace, cur.Name, errInUse)
	case useReserved:
		if at, ok := allocatedAt(cur); !ok || now.Sub(at) < reservedUnboundGrace {
			return false, fmt.Errorf("claim %s/%s: %w", cur.Namespace, cur.Name, errInGrace)
		}
	}
	cur.Status.Allocation, cur.Status.ReservedFor = nil, nil
	if _, err := claims.UpdateStatus(ctx, cur, metav1.UpdateOptions{}); err != nil {
		return false, err
	}
	return true, nil
}
