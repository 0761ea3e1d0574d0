package provider

import (
	"github.com/awslabs/operatorpkg/status"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/gpudra/gpudra/devcluster/cloudapi"
)

// Group and Version of GPUNodeClass.
const (
	Group   = "karpenter.devcluster.gpudra.dev"
	Version = "v1alpha1"
)

// GroupVersion is GPUNodeClass's.
var GroupVersion = schema.GroupVersion{Group: Group, Version: Version}

// GPUNodeClass is devcluster's NodeClass: how the GPUs of the machines a
// NodePool buys are set up at boot (MIG mode, the plugin's MIG policy,
// fractional sharing). The instance types, and so the ResourceSlice
// templates Karpenter simulates with, depend on it: a NodePool of MIG
// machines is a NodePool whose NodeClass says so, as a cloud's node
// configuration (a GPU operator's MIG config label, a launch template)
// does.
type GPUNodeClass struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              cloudapi.Configuration `json:"spec,omitempty"`
	Status            GPUNodeClassStatus     `json:"status,omitempty"`
}

// GPUNodeClassStatus is always Ready: the CRD defaults it so.
type GPUNodeClassStatus struct {
	Conditions []status.Condition `json:"conditions,omitempty"`
}

// GPUNodeClassList is a list of GPUNodeClasses.
type GPUNodeClassList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []GPUNodeClass `json:"items"`
}

// StatusConditions, GetConditions and SetConditions make it a
// status.Object, as Karpenter's NodeClass readiness reads it.
func (in *GPUNodeClass) StatusConditions(opts ...status.ForOption) status.ConditionSet {
	return status.NewReadyConditions().For(in, opts...)
}

func (in *GPUNodeClass) GetConditions() []status.Condition { return in.Status.Conditions }

func (in *GPUNodeClass) SetConditions(conditions []status.Condition) {
	in.Status.Conditions = conditions
}

// DeepCopyInto, DeepCopy and DeepCopyObject make it a runtime.Object.
func (in *GPUNodeClass) DeepCopyInto(out *GPUNodeClass) {
	*out = *in
	out.TypeMeta = in.TypeMeta
	in.ObjectMeta.DeepCopyInto(&out.ObjectMeta)
	if in.Status.Conditions != nil {
		out.Status.Conditions = make([]status.Condition, len(in.Status.Conditions))
		for i := range in.Status.Conditions {
			in.Status.Conditions[i].DeepCopyInto(&out.Status.Conditions[i])
		}
	}
}

func (in *GPUNodeClass) DeepCopy() *GPUNodeClass {
	if in == nil {
		return nil
	}
	out := new(GPUNodeClass)
	in.DeepCopyInto(out)
	return out
}

func (in *GPUNodeClass) DeepCopyObject() runtime.Object { return in.DeepCopy() }

func (in *GPUNodeClassList) DeepCopyObject() runtime.Object {
	if in == nil {
		return nil
	}
	out := &GPUNodeClassList{TypeMeta: in.TypeMeta}
	in.ListMeta.DeepCopyInto(&out.ListMeta)
	for i := range in.Items {
		out.Items = append(out.Items, *in.Items[i].DeepCopy())
	}
	return out
}

// AddToScheme registers GPUNodeClass with a scheme.
func AddToScheme(s *runtime.Scheme) error {
	s.AddKnownTypes(GroupVersion, &GPUNodeClass{}, &GPUNodeClassList{})
	metav1.AddToGroupVersion(s, GroupVersion)
	return nil
}
