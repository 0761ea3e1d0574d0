package webhook

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/klog/v2"

	gpudraapi "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// The resources the webhook validates.
var (
	ResourceClaims         = resourceapi.SchemeGroupVersion.WithResource("resourceclaims")
	ResourceClaimTemplates = resourceapi.SchemeGroupVersion.WithResource("resourceclaimtemplates")
	DeviceClasses          = resourceapi.SchemeGroupVersion.WithResource("deviceclasses")
	PodCliqueSets          = schema.GroupVersionResource{Group: "grove.io", Version: "v1alpha1", Resource: "podcliquesets"}
	GpuReservations        = gpudraapi.GpuReservations
	GpuQueues              = gpudraapi.GpuQueues
)

// Path is where the validating webhook is served (MutatePath the mutating
// one).
const Path = "/validate"

// maxBody bounds a review: the API server's own limit on an object is 3 MiB.
const maxBody = 4 << 20

// Handler serves admission/v1 AdmissionReviews: at MutatePath those of the
// mutating webhook (Mutate), at any other path those of the validating one
// (Review). One handler for both keeps one metric and one caller
// (pkg/controller) for the two.
type Handler struct {
	requests *prometheus.CounterVec
	// GangPath is the gang path now: GangPathGates or GangPathWorkload
	// (see Mutate); "" while undecided (a new gang pod is refused with the
	// reason: refuseUndecided). nil, or any other answer: every pod passes
	// unchanged, so that no pod is gated or grouped that nothing would hand
	// over.
	GangPath func() string
	// GangMembers lists a gang's existing pods, so that a gang pod whose
	// priority differs from theirs is refused (MutateGang); nil: no check.
	GangMembers GangMembers
	// PodGroupGang says whose PodGroup a pod names, so that on the Workload
	// API path a pod that is not a gang's may not join that gang's
	// PodGroup (refuseForeignSchedulingGroup); nil: only GangMembers'
	// gangs are known.
	PodGroupGang PodGroupGang
}

// NewHandler returns the webhook's handler; reg (nil: none) receives
// gpudra_webhook_admission_requests_total.
func NewHandler(reg prometheus.Registerer) *Handler {
	h := &Handler{requests: prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "gpudra", Subsystem: "webhook", Name: "admission_requests_total",
		Help: "Admission reviews answered, by resource and whether the object was allowed.",
	}, []string{"resource", "allowed"})}
	if reg != nil {
		reg.MustRegister(h.requests)
	}
	return h
}

func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	logger := klog.FromContext(r.Context())
	if r.Method != http.MethodPost {
		http.Error(w, "POST an AdmissionReview", http.StatusMethodNotAllowed)
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBody))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var review admissionv1.AdmissionReview
	if err := json.Unmarshal(body, &review); err != nil || review.Request == nil {
		http.Error(w, fmt.Sprintf("not an AdmissionReview: %v", err), http.StatusBadRequest)
		return
	}
	answer := Review
	if r.URL.Path == MutatePath {
		path := ""
		if h.GangPath != nil {
			path = h.GangPath()
		}
		answer = allow
		if h.GangPath != nil && path == "" {
			answer = refuseUndecided
		}
		if path == GangPathGates || path == GangPathWorkload {
			answer = func(req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
				if path == GangPathWorkload {
					if resp := refuseForeignSchedulingGroup(r.Context(), req, h.GangMembers, h.PodGroupGang); resp != nil {
						return resp
					}
				}
				return MutateGang(req, path, h.GangMembers)
			}
		}
	}
	resp := answer(review.Request)
	h.requests.WithLabelValues(review.Request.Resource.Resource, fmt.Sprint(resp.Allowed)).Inc()
	if !resp.Allowed {
		logger.V(2).Info("Refused", "resource", review.Request.Resource.Resource, "namespace", review.Request.Namespace,
			"name", review.Request.Name, "reason", resp.Result.Message)
	}
	review.Response, review.Request = resp, nil
	w.Header().Set("Content-Type", "application/json")
	if err := json.NewEncoder(w).Encode(&review); err != nil {
		logger.Error(err, "Write admission response")
	}
}

// refuseUndecided answers for a replica whose gang path is not decided yet
// (API discovery has not answered it since it started): a new gang pod is
// refused with the reason, since admitted unchanged it would schedule
// outside its gang; "could not tell" is never "absent" (issue 35, item 1).
// Its creator (a Job, Grove, a person) creates it again. Other pods pass.
func refuseUndecided(req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
	resp := &admissionv1.AdmissionResponse{UID: req.UID, Allowed: true}
	if req.Operation != admissionv1.Create || req.Resource.Resource != "pods" {
		return resp
	}
	var pod corev1.Pod
	if err := json.Unmarshal(req.Object.Raw, &pod); err != nil || !IsGangPod(&pod) {
		return resp
	}
	resp.Allowed = false
	resp.Result = &metav1.Status{Status: metav1.StatusFailure, Code: http.StatusServiceUnavailable, Reason: metav1.StatusReasonServiceUnavailable,
		Message: fmt.Sprintf("gang pod %s: gpudra's controller cannot tell yet whether its gang path is served (API discovery has not answered it); "+
			"refused rather than admitted outside its gang: create it again", PodGroupName(&pod))}
	return resp
}

// Review answers one admission request. Objects of resources it does not
// know, and deletions, are allowed: the configuration sends it none, and a
// mistake there must not block anyone.
func Review(req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
	resp := &admissionv1.AdmissionResponse{UID: req.UID, Allowed: true}
	if req.Operation != admissionv1.Create && req.Operation != admissionv1.Update {
		return resp
	}
	errs, err := validate(req)
	switch {
	case err != nil:
		resp.Allowed = false
		resp.Result = &metav1.Status{Status: metav1.StatusFailure, Code: http.StatusBadRequest, Reason: metav1.StatusReasonBadRequest, Message: err.Error()}
	case len(errs) > 0:
		resp.Allowed = false
		resp.Result = &metav1.Status{Status: metav1.StatusFailure, Code: http.StatusUnprocessableEntity, Reason: metav1.StatusReasonInvalid,
			Message: errs.ToAggregate().Error()}
	}
	return resp
}

func validate(req *admissionv1.AdmissionRequest) (field.ErrorList, error) {
	raw := req.Object.Raw
	gvr := schema.GroupVersionResource{Group: req.Resource.Group, Version: req.Resource.Version, Resource: req.Resource.Resource}
	switch gvr {
	case ResourceClaims:
		var o resourceapi.ResourceClaim
		if err := json.Unmarshal(raw, &o); err != nil {
			return nil, fmt.Errorf("decode ResourceClaim: %w", err)
		}
		return ValidateClaim(&o), nil
	case ResourceClaimTemplates:
		var o resourceapi.ResourceClaimTemplate
		if err := json.Unmarshal(raw, &o); err != nil {
			return nil, fmt.Errorf("decode ResourceClaimTemplate: %w", err)
		}
		return ValidateClaimTemplate(&o), nil
	case DeviceClasses:
		var o resourceapi.DeviceClass
		if err := json.Unmarshal(raw, &o); err != nil {
			return nil, fmt.Errorf("decode DeviceClass: %w", err)
		}
		return ValidateDeviceClass(&o), nil
	case PodCliqueSets:
		var o unstructured.Unstructured
		if err := o.UnmarshalJSON(raw); err != nil {
			return nil, fmt.Errorf("decode PodCliqueSet: %w", err)
		}
		return ValidatePodCliqueSet(&o), nil
	case GpuReservations:
		o, err := decode[gpudraapi.GpuReservation](raw)
		if err != nil {
			return nil, err
		}
		if req.Operation != admissionv1.Update {
			return gpudraapi.ValidateReservation(o), nil
		}
		old, err := decode[gpudraapi.GpuReservation](req.OldObject.Raw)
		if err != nil {
			return nil, fmt.Errorf("old object: %w", err)
		}
		return gpudraapi.ValidateReservationUpdate(o, old), nil
	case GpuQueues:
		o, err := decode[gpudraapi.GpuQueue](raw)
		if err != nil {
			return nil, err
		}
		return gpudraapi.ValidateQueue(o), nil
	}
	return nil, nil
}

// decode reads one of gpudra's own objects strictly: a field the Go types
// lack means the CRD and the code disagree, and the controller, which
// decodes the same way, could not act on the object; better refused now,
// naming the field, than stuck later.
func decode[T any](raw []byte) (*T, error) {
	var u unstructured.Unstructured
	if err := u.UnmarshalJSON(raw); err != nil {
		return nil, fmt.Errorf("decode %T: %w", *new(T), err)
	}
	return gpudraapi.FromUnstructured[T](&u)
}

// allow admits the request unchanged.
func allow(req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
	return &admissionv1.AdmissionResponse{UID: req.UID, Allowed: true}
}
