package gang

import (
	"strings"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// What the controller must know of its own past writes lives in the API,
// not in its memory: a new leader, or this one after ten minutes, reads it
// back. Every claim allocation the controller writes carries the item it
// was planned for and its timestamp (AnnotationAllocatedFor,
// AnnotationAllocatedAt), written with the claim's metadata before the
// allocation. Two rules read them:
//
//   - the repair never takes back a gang's claim once the gang is released
//     (its allocation is the gang's NVLink plan), and prefers to take back
//     the controller's own unused writes, whose items plan again;
//   - a gang or reservation left half written (a leader that stopped
//     between two writes, a hand-off that failed after them) is taken back
//     and planned whole.

// writtenAllocation is what the annotations say of a claim's allocation.
type writtenAllocation struct {
	// item is the key of the reservation or gang it was written for.
	item string
}

// allocationStamp is an allocation's timestamp as the API keeps it: to the
// second (metav1.Time).
func allocationStamp(now time.Time) metav1.Time {
	return metav1.NewTime(now).Rfc3339Copy()
}

// markWritten sets the annotations on a claim about to get an allocation
// stamped at.
func markWritten(cl *resourceapi.ResourceClaim, item string, at metav1.Time) {
	if cl.Annotations == nil {
		cl.Annotations = map[string]string{}
	}
	cl.Annotations[gpudrav1.AnnotationAllocatedFor] = item
	cl.Annotations[gpudrav1.AnnotationAllocatedAt] = at.UTC().Format(time.RFC3339)
}

// writtenBy says whether the claim's current allocation is one this
// controller (any leader) wrote, and for which item: the annotations are
// there and their timestamp is the allocation's. Annotations left by an
// allocation that was cleared since, or set on a claim whose allocation
// was never written (a leader that stopped in between), say nothing.
func writtenBy(cl *resourceapi.ResourceClaim) (writtenAllocation, bool) {
	a := cl.Status.Allocation
	item := cl.Annotations[gpudrav1.AnnotationAllocatedFor]
	if a == nil || a.AllocationTimestamp == nil || item == "" {
		return writtenAllocation{}, false
	}
	at, err := time.Parse(time.RFC3339, cl.Annotations[gpudrav1.AnnotationAllocatedAt])
	if err != nil || !at.Equal(a.AllocationTimestamp.Rfc3339Copy().Time) {
		return writtenAllocation{}, false
	}
	return writtenAllocation{item: item}, true
}

// forGang says whether a written allocation was a gang's: a gang is
// released as soon as all its claims are written (its gates lifted, or its
// PodGroup made), so a gang's written allocation is part of a released
// plan unless the gang is still to be planned (halfWrittenGang).
func (w writtenAllocation) forGang() bool { return strings.HasPrefix(w.item, KindGang+"/") }
