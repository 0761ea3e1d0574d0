package webhook

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"

	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation/field"

	gpudraapi "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// PodGroupGang says whose PodGroup name is in namespace: the gang that
// gpudra-controller made it for (its label gpudra.dev/gang), "" when it
// did not make it or there is none.
type PodGroupGang func(ctx context.Context, namespace, name string) (string, error)

// refuseForeignSchedulingGroup answers, on the Workload API path, a pod
// that names in spec.schedulingGroup the PodGroup of a gang it is not one
// of; nil for any other request. kube-scheduler finds a PodGroup by name
// and places its pods together: a pod of somebody else that joined a
// gang's PodGroup would be counted as one of the gang's and placed with it,
// past the queue, on devices planned for the gang. The gang is the
// PodGroup's (gpudra-controller made it) or, before it is made, the one
// whose pods GangMembers lists under that name.
func refuseForeignSchedulingGroup(ctx context.Context, req *admissionv1.AdmissionRequest, members GangMembers, podGroups PodGroupGang) *admissionv1.AdmissionResponse {
	gvr := metav1.GroupVersionResource{Group: req.Resource.Group, Version: req.Resource.Version, Resource: req.Resource.Resource}
	if req.Operation != admissionv1.Create || gvr != metav1.GroupVersionResource(Pods) {
		return nil
	}
	var pod corev1.Pod
	if err := json.Unmarshal(req.Object.Raw, &pod); err != nil {
		return nil // MutateGang refuses it, saying why.
	}
	ferr, err := checkSchedulingGroup(ctx, &pod, req.Namespace, members, podGroups)
	switch {
	case err != nil:
		return &admissionv1.AdmissionResponse{UID: req.UID, Result: &metav1.Status{Status: metav1.StatusFailure,
			Code: http.StatusInternalServerError, Reason: metav1.StatusReasonInternalError, Message: err.Error()}}
	case ferr != nil:
		return &admissionv1.AdmissionResponse{UID: req.UID, Result: &metav1.Status{Status: metav1.StatusFailure,
			Code: http.StatusForbidden, Reason: metav1.StatusReasonForbidden, Message: ferr.Error()}}
	}
	return nil
}

// checkSchedulingGroup refuses pod when the PodGroup it names is a gang's
// and pod is not one of that gang's pods (its gang, PodGroupName, is
// another or none). A pod may name its own gang's PodGroup, and any
// PodGroup that is no gang's (its user's own, a Job's).
func checkSchedulingGroup(ctx context.Context, pod *corev1.Pod, namespace string, members GangMembers, podGroups PodGroupGang) (*field.Error, error) {
	sg := pod.Spec.SchedulingGroup
	if sg == nil || sg.PodGroupName == nil || *sg.PodGroupName == "" {
		return nil, nil
	}
	name, own := *sg.PodGroupName, PodGroupName(pod)
	if name == own {
		return nil, nil
	}
	path := field.NewPath("spec", "schedulingGroup", "podGroupName")
	refuse := func(gang, why string) *field.Error {
		this := "a pod of no gang"
		if own != "" {
			this = fmt.Sprintf("a pod of gang %q", own)
		}
		return field.Forbidden(path, fmt.Sprintf("PodGroup %q is gang %q's (%s): kube-scheduler places its pods together, and %s "+
			"may not join it; only the gang's pods (label %s=%s) name it (docs/gangs.md)", name, gang, why, this, gpudraapi.LabelGang, gang))
	}
	if podGroups != nil {
		gang, err := podGroups(ctx, namespace, name)
		if err != nil {
			return nil, fmt.Errorf("PodGroup %s/%s that the pod names in spec.schedulingGroup: %w", namespace, name, err)
		}
		if gang != "" {
			return refuse(gang, "gpudra-controller made it for that gang"), nil
		}
	}
	if members == nil {
		return nil, nil
	}
	live := slices.DeleteFunc(slices.Clone(members(namespace, name)), func(o *corev1.Pod) bool {
		return o.Name == pod.Name || o.DeletionTimestamp != nil || o.Status.Phase == corev1.PodSucceeded || o.Status.Phase == corev1.PodFailed
	})
	if len(live) > 0 {
		slices.SortFunc(live, func(a, b *corev1.Pod) int { return a.CreationTimestamp.Compare(b.CreationTimestamp.Time) })
		return refuse(name, fmt.Sprintf("gpudra-controller makes it for that gang's pods, such as %s, once its queue lets the gang go", live[0].Name)), nil
	}
	return nil, nil
}
