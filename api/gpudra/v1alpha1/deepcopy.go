package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// Hand-written deep copies (the project does not run deepcopy-gen). Every
// pointer, slice and map is copied so that a copy can be defaulted or
// mutated without touching an object shared with an informer's cache;
// deepcopy_test.go checks each one by mutating a fully populated copy.

// DeepCopyInto copies r into out.
func (r *GpuReservation) DeepCopyInto(out *GpuReservation) {
	*out = *r
	r.ObjectMeta.DeepCopyInto(&out.ObjectMeta)
	r.Spec.DeepCopyInto(&out.Spec)
	r.Status.DeepCopyInto(&out.Status)
}

// DeepCopy returns a deep copy of r.
func (r *GpuReservation) DeepCopy() *GpuReservation {
	if r == nil {
		return nil
	}
	out := new(GpuReservation)
	r.DeepCopyInto(out)
	return out
}

// DeepCopyObject makes GpuReservation a runtime.Object, so that it can be
// given to an event recorder or a scheme.
func (r *GpuReservation) DeepCopyObject() runtime.Object {
	if c := r.DeepCopy(); c != nil {
		return c
	}
	return nil
}

// DeepCopyInto copies s into out.
func (s *GpuReservationSpec) DeepCopyInto(out *GpuReservationSpec) {
	*out = *s
	if s.Selectors != nil {
		out.Selectors = make([]string, len(s.Selectors))
		copy(out.Selectors, s.Selectors)
	}
	if s.Duration != nil {
		d := *s.Duration
		out.Duration = &d
	}
}

// DeepCopy returns a deep copy of s.
func (s *GpuReservationSpec) DeepCopy() *GpuReservationSpec {
	if s == nil {
		return nil
	}
	out := new(GpuReservationSpec)
	s.DeepCopyInto(out)
	return out
}

// DeepCopyInto copies s into out.
func (s *GpuReservationStatus) DeepCopyInto(out *GpuReservationStatus) {
	*out = *s
	if s.Claims != nil {
		out.Claims = make([]HeldClaim, len(s.Claims))
		for i := range s.Claims {
			s.Claims[i].DeepCopyInto(&out.Claims[i])
		}
	}
	out.Nodes = copyStrings(s.Nodes)
	out.NVLinkDomains = copyStrings(s.NVLinkDomains)
	out.QueuedAt = copyTime(s.QueuedAt)
	out.HeldAt = copyTime(s.HeldAt)
	out.ExpiresAt = copyTime(s.ExpiresAt)
}

// DeepCopy returns a deep copy of s.
func (s *GpuReservationStatus) DeepCopy() *GpuReservationStatus {
	if s == nil {
		return nil
	}
	out := new(GpuReservationStatus)
	s.DeepCopyInto(out)
	return out
}

// DeepCopyInto copies c into out.
func (c *HeldClaim) DeepCopyInto(out *HeldClaim) {
	*out = *c
	out.Devices = copyStrings(c.Devices)
}

// DeepCopy returns a deep copy of c.
func (c *HeldClaim) DeepCopy() *HeldClaim {
	if c == nil {
		return nil
	}
	out := new(HeldClaim)
	c.DeepCopyInto(out)
	return out
}

// DeepCopyInto copies l into out.
func (l *GpuReservationList) DeepCopyInto(out *GpuReservationList) {
	*out = *l
	l.ListMeta.DeepCopyInto(&out.ListMeta)
	if l.Items != nil {
		out.Items = make([]GpuReservation, len(l.Items))
		for i := range l.Items {
			l.Items[i].DeepCopyInto(&out.Items[i])
		}
	}
}

// DeepCopy returns a deep copy of l.
func (l *GpuReservationList) DeepCopy() *GpuReservationList {
	if l == nil {
		return nil
	}
	out := new(GpuReservationList)
	l.DeepCopyInto(out)
	return out
}

// DeepCopyObject makes GpuReservationList a runtime.Object.
func (l *GpuReservationList) DeepCopyObject() runtime.Object {
	if c := l.DeepCopy(); c != nil {
		return c
	}
	return nil
}

// DeepCopyInto copies q into out.
func (q *GpuQueue) DeepCopyInto(out *GpuQueue) {
	*out = *q
	q.ObjectMeta.DeepCopyInto(&out.ObjectMeta)
	q.Spec.DeepCopyInto(&out.Spec)
	out.Status = q.Status // only scalars
}

// DeepCopy returns a deep copy of q.
func (q *GpuQueue) DeepCopy() *GpuQueue {
	if q == nil {
		return nil
	}
	out := new(GpuQueue)
	q.DeepCopyInto(out)
	return out
}

// DeepCopyObject makes GpuQueue a runtime.Object.
func (q *GpuQueue) DeepCopyObject() runtime.Object {
	if c := q.DeepCopy(); c != nil {
		return c
	}
	return nil
}

// DeepCopyInto copies s into out.
func (s *GpuQueueSpec) DeepCopyInto(out *GpuQueueSpec) {
	*out = *s
	if s.AgingPerMinute != nil {
		v := *s.AgingPerMinute
		out.AgingPerMinute = &v
	}
	if s.Shares != nil {
		out.Shares = make(map[string]int32, len(s.Shares))
		for k, v := range s.Shares {
			out.Shares[k] = v
		}
	}
}

// DeepCopy returns a deep copy of s.
func (s *GpuQueueSpec) DeepCopy() *GpuQueueSpec {
	if s == nil {
		return nil
	}
	out := new(GpuQueueSpec)
	s.DeepCopyInto(out)
	return out
}

// DeepCopyInto copies l into out.
func (l *GpuQueueList) DeepCopyInto(out *GpuQueueList) {
	*out = *l
	l.ListMeta.DeepCopyInto(&out.ListMeta)
	if l.Items != nil {
		out.Items = make([]GpuQueue, len(l.Items))
		for i := range l.Items {
			l.Items[i].DeepCopyInto(&out.Items[i])
		}
	}
}

// DeepCopy returns a deep copy of l.
func (l *GpuQueueList) DeepCopy() *GpuQueueList {
	if l == nil {
		return nil
	}
	out := new(GpuQueueList)
	l.DeepCopyInto(out)
	return out
}

// DeepCopyObject makes GpuQueueList a runtime.Object.
func (l *GpuQueueList) DeepCopyObject() runtime.Object {
	if c := l.DeepCopy(); c != nil {
		return c
	}
	return nil
}

func copyStrings(in []string) []string {
	if in == nil {
		return nil
	}
	out := make([]string, len(in))
	copy(out, in)
	return out
}

func copyTime(in *metav1.Time) *metav1.Time {
	if in == nil {
		return nil
	}
	return in.DeepCopy()
}
