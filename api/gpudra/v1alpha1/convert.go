package v1alpha1

import (
	"fmt"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
)

// The controller reads and writes these resources through the dynamic
// client (the project has no generated typed client), so it converts
// between unstructured objects and the Go types here.

// FromUnstructured decodes u into a new T. Unknown fields are an error
// rather than silently dropped: a field the types lack means the CRD and
// the code disagree (or a user misspelled a field on an object that
// bypassed the schema), and acting on a partial object could release or
// hold the wrong devices. The error names the field and the object.
func FromUnstructured[T any](u *unstructured.Unstructured) (*T, error) {
	if u == nil {
		return nil, fmt.Errorf("decoding %T: no object", *new(T))
	}
	out := new(T)
	if err := runtime.DefaultUnstructuredConverter.FromUnstructuredWithValidation(u.Object, out, true); err != nil {
		return nil, fmt.Errorf("decoding %s %s: %w", kindOf(u), objectName(u), err)
	}
	return out, nil
}

// ToUnstructured encodes obj, which must be a non-nil pointer to a struct.
// For GpuReservation and GpuQueue an empty apiVersion and kind are filled
// in, because typed objects built in Go code usually leave TypeMeta empty
// and the dynamic client refuses objects without a kind.
func ToUnstructured(obj any) (*unstructured.Unstructured, error) {
	if obj == nil {
		return nil, fmt.Errorf("encoding: no object")
	}
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(obj)
	if err != nil {
		return nil, fmt.Errorf("encoding %T: %w", obj, err)
	}
	u := &unstructured.Unstructured{Object: m}
	var kind string
	switch obj.(type) {
	case *GpuReservation:
		kind = KindGpuReservation
	case *GpuQueue:
		kind = KindGpuQueue
	case *GpuReservationList:
		kind = KindGpuReservation + "List"
	case *GpuQueueList:
		kind = KindGpuQueue + "List"
	}
	if kind != "" {
		if u.GetAPIVersion() == "" {
			u.SetAPIVersion(APIVersion)
		}
		if u.GetKind() == "" {
			u.SetKind(kind)
		}
	}
	return u, nil
}

func kindOf(u *unstructured.Unstructured) string {
	if k := u.GetKind(); k != "" {
		return k
	}
	return "object"
}

func objectName(u *unstructured.Unstructured) string {
	if ns := u.GetNamespace(); ns != "" {
		return ns + "/" + u.GetName()
	}
	if n := u.GetName(); n != "" {
		return n
	}
	return "(unnamed)"
}
