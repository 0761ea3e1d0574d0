package webhook

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/utils/ptr"

	gpudraapi "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// MutatePath is where the mutating webhook (the gang scheduling gate) is
// served, next to Path.
const MutatePath = "/mutate"

// Pods is the resource the mutating webhook admits.
var Pods = corev1.SchemeGroupVersion.WithResource("pods")

// LabelGrovePodGang is the label Grove puts on every member of a PodGang
// (grove.io common.LabelPodGang): such pods form a gang as well.
const LabelGrovePodGang = "grove.io/podgang"

// The gang paths the mutating webhook acts on (pkg/controller decides which
// one a cluster takes; any other value, "off" included, changes nothing).
const (
	// GangPathGates: gang pods get the scheduling gate gpudra.dev/gang.
	GangPathGates = "gates"
	// GangPathWorkload: gang pods get spec.schedulingGroup naming their
	// gang's PodGroup (kube-scheduler's Workload API).
	GangPathWorkload = "workload"
)

// MaxGangSize bounds gpudra.dev/gang-size: the controller plans a gang's
// devices at once, and a typo of a few zeros must not make it wait forever
// for pods that never come.
const MaxGangSize = 10000

// PatchOperation is one operation of an RFC 6902 JSON patch.
type PatchOperation struct {
	Op    string `json:"op"`
	Path  string `json:"path"`
	Value any    `json:"value"`
}

// Mutate answers one request of the mutating webhook on a gang path. A pod
// of a gang that the default scheduler would place is created so that it
// cannot be placed alone; without that the scheduler would place the pods
// one by one, and a gang could end up half placed, holding GPUs while it
// waits:
//   - on the gate path, with the scheduling gate gpudra.dev/gang, which the
//     controller lifts once the whole gang's devices are allocated;
//   - on the Workload API path, with spec.schedulingGroup naming the gang's
//     PodGroup, which the controller creates when the gang's queue hands it
//     over; kube-scheduler then places all of its pods or none.
//
// Every other request is allowed unchanged: pods for another scheduler (KAI,
// Volcano) get their gangs from it, and a pod bound to a node skips
// scheduling (the API server refuses gates on it).
func Mutate(req *admissionv1.AdmissionRequest, path string) *admissionv1.AdmissionResponse {
	return MutateGang(req, path, nil)
}

// MutateGang is Mutate that also refuses, on either path, a gang pod whose
// priority differs from that of its gang's existing pods, which members
// lists (nil: no such check).
func MutateGang(req *admissionv1.AdmissionRequest, path string, members GangMembers) *admissionv1.AdmissionResponse {
	resp := &admissionv1.AdmissionResponse{UID: req.UID, Allowed: true}
	gvr := metav1.GroupVersionResource{Group: req.Resource.Group, Version: req.Resource.Version, Resource: req.Resource.Resource}
	if req.Operation != admissionv1.Create || gvr != metav1.GroupVersionResource(Pods) {
		return resp
	}
	var pod corev1.Pod
	if err := json.Unmarshal(req.Object.Raw, &pod); err != nil {
		resp.Allowed = false
		resp.Result = &metav1.Status{Status: metav1.StatusFailure, Code: http.StatusBadRequest, Reason: metav1.StatusReasonBadRequest,
			Message: fmt.Sprintf("decode Pod: %v", err)}
		return resp
	}
	var patch []PatchOperation
	var errs field.ErrorList
	switch path {
	case GangPathGates:
		patch, errs = GatePod(&pod)
	case GangPathWorkload:
		patch, errs = GroupPod(&pod)
	}
	if len(errs) == 0 && members != nil && (path == GangPathGates || path == GangPathWorkload) && IsGangPod(&pod) {
		if err := checkGangPriority(&pod, req.Namespace, members); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		resp.Allowed = false
		resp.Result = &metav1.Status{Status: metav1.StatusFailure, Code: http.StatusUnprocessableEntity, Reason: metav1.StatusReasonInvalid,
			Message: errs.ToAggregate().Error()}
		return resp
	}
	if len(patch) == 0 {
		return resp
	}
	raw, err := json.Marshal(patch)
	if err != nil {
		// Cannot happen for these values; refusing is what failurePolicy
		// Fail would do anyway.
		resp.Allowed = false
		resp.Result = &metav1.Status{Status: metav1.StatusFailure, Code: http.StatusInternalServerError, Reason: metav1.StatusReasonInternalError,
			Message: fmt.Sprintf("encode patch: %v", err)}
		return resp
	}
	resp.Patch, resp.PatchType = raw, ptr.To(admissionv1.PatchTypeJSONPatch)
	return resp
}

// PodGroupName is the PodGroup of a gang pod on the Workload API path: the
// gang's name (label gpudra.dev/gang, or Grove's grove.io/podgang), in the
// pod's namespace; "" for a pod of no gang.
func PodGroupName(pod *corev1.Pod) string {
	if n := pod.Labels[gpudraapi.LabelGang]; n != "" {
		return n
	}
	return pod.Labels[LabelGrovePodGang]
}

// GroupPod checks the gang annotations of a gang pod and returns the JSON
// patch that sets spec.schedulingGroup to its gang's PodGroup (none when
// the pod is no gang pod, or names a scheduling group already: the user's
// own PodGroup is left to them, and a reinvocation changes nothing).
func GroupPod(pod *corev1.Pod) ([]PatchOperation, field.ErrorList) {
	if !IsGangPod(pod) {
		return nil, nil
	}
	if errs := validateGangPod(pod); len(errs) > 0 {
		return nil, errs
	}
	if pod.Spec.SchedulingGroup != nil {
		return nil, nil
	}
	return []PatchOperation{{Op: "add", Path: "/spec/schedulingGroup", Value: corev1.PodSchedulingGroup{PodGroupName: ptr.To(PodGroupName(pod))}}}, nil
}

// IsGangPod says whether the webhook gates pod: a member of a gang (a
// plain pod with gpudra.dev/gang or a Grove PodGang member) that the
// default scheduler places. The configuration's matchConditions say the
// same in CEL, so that other pods never reach the webhook.
func IsGangPod(pod *corev1.Pod) bool {
	_, plain := pod.Labels[gpudraapi.LabelGang]
	_, grove := pod.Labels[LabelGrovePodGang]
	if !plain && !grove {
		return false
	}
	if s := pod.Spec.SchedulerName; s != "" && s != corev1.DefaultSchedulerName {
		return false
	}
	return pod.Spec.NodeName == ""
}

// GatePod checks the gang annotations of a gang pod and returns the JSON
// patch that adds the scheduling gate (none when the pod is no gang pod or
// has the gate already: the API server may call the webhook again after
// another webhook's change).
func GatePod(pod *corev1.Pod) ([]PatchOperation, field.ErrorList) {
	if !IsGangPod(pod) {
		return nil, nil
	}
	if errs := validateGangPod(pod); len(errs) > 0 {
		return nil, errs
	}
	for _, g := range pod.Spec.SchedulingGates {
		if g.Name == gpudraapi.SchedulingGate {
			return nil, nil
		}
	}
	gate := corev1.PodSchedulingGate{Name: gpudraapi.SchedulingGate}
	if len(pod.Spec.SchedulingGates) == 0 {
		// "add" of a member that is there (an empty list) replaces it.
		return []PatchOperation{{Op: "add", Path: "/spec/schedulingGates", Value: []corev1.PodSchedulingGate{gate}}}, nil
	}
	return []PatchOperation{{Op: "add", Path: "/spec/schedulingGates/-", Value: gate}}, nil
}

// validateGangPod refuses what would leave a gang waiting forever or
// ordered wrongly: a plain gang without a usable size, and a duration the
// ShortestJobFirst policy cannot read.
func validateGangPod(pod *corev1.Pod) field.ErrorList {
	var errs field.ErrorList
	annotations := field.NewPath("metadata", "annotations")
	if gang, ok := pod.Labels[gpudraapi.LabelGang]; ok {
		if gang == "" {
			errs = append(errs, field.Invalid(field.NewPath("metadata", "labels").Key(gpudraapi.LabelGang), gang, "must name the gang"))
		}
		p := annotations.Key(gpudraapi.AnnotationGangSize)
		switch v, ok := pod.Annotations[gpudraapi.AnnotationGangSize]; {
		case !ok:
			errs = append(errs, field.Required(p, fmt.Sprintf("a pod of a gang (label %s) must say how many pods the gang has", gpudraapi.LabelGang)))
		default:
			if n, err := strconv.Atoi(v); err != nil || n < 1 || n > MaxGangSize {
				errs = append(errs, field.Invalid(p, v, fmt.Sprintf("must be a whole number from 1 to %d", MaxGangSize)))
			}
		}
	}
	if v, ok := pod.Annotations[gpudraapi.AnnotationDuration]; ok {
		if d, err := time.ParseDuration(v); err != nil || d <= 0 {
			errs = append(errs, field.Invalid(annotations.Key(gpudraapi.AnnotationDuration), v, `must be a positive Go duration such as "30m" or "2h"`))
		}
	}
	// One job, one queue (docs/queues.md): Kueue admits a pod of its
	// LocalQueue, and gpudra then places it in no GpuQueue; naming a
	// GpuQueue too would ask to be queued twice.
	if gq, ok := pod.Annotations[gpudraapi.AnnotationQueue]; ok {
		if kq := pod.Labels[gpudraapi.LabelKueueQueue]; kq != "" {
			errs = append(errs, field.Forbidden(annotations.Key(gpudraapi.AnnotationQueue),
				fmt.Sprintf("the pod is queued by Kueue (label %s=%s), so it waits in no GpuQueue: remove the GpuQueue %q or the Kueue label, not both (docs/queues.md)",
					gpudraapi.LabelKueueQueue, kq, gq)))
		}
	}
	return errs
}
