package v1alpha1

import (
	"fmt"
	"maps"
	"slices"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/dynamic-resource-allocation/cel"
)

// Limits of a reservation. They keep one reservation from asking the
// planner for more than a large cluster could give in one gang, and they
// are mirrored by the CRD schema (minimum/maximum) so that the API server
// and the webhook refuse the same objects.
const (
	MaxReservationClaims  = 64
	MaxReservationCount   = 64
	MaxReservationDevices = 512
	MaxReservationTTL     = 7 * 24 * time.Hour
)

// Default fills the fields a user may leave out. The controller and the
// webhook call it on a copy before planning or validating, so that an
// object as stored (where the CRD defaults may not have run, for example
// in unit tests or a client-side dry run) means the same thing.
func (r *GpuReservation) Default() {
	if r.Spec.Claims == 0 {
		r.Spec.Claims = 1
	}
	if r.Spec.Count == 0 {
		r.Spec.Count = 1
	}
	if r.Spec.Queue == "" {
		r.Spec.Queue = DefaultQueue
	}
}

// ValidateReservation checks a reservation's spec as the webhook and the
// controller see it: defaulted. It does not modify r.
func ValidateReservation(r *GpuReservation) field.ErrorList {
	if r == nil {
		return field.ErrorList{field.Required(field.NewPath(""), "no GpuReservation")}
	}
	d := r.DeepCopy()
	d.Default()
	return validateReservationSpec(&d.Spec, field.NewPath("spec"))
}

func validateReservationSpec(s *GpuReservationSpec, p *field.Path) field.ErrorList {
	var errs field.ErrorList

	if s.DeviceClassName == "" {
		errs = append(errs, field.Required(p.Child("deviceClassName"), "the class of the held devices"))
	} else {
		for _, msg := range validation.IsDNS1123Subdomain(s.DeviceClassName) {
			errs = append(errs, field.Invalid(p.Child("deviceClassName"), s.DeviceClassName, msg))
		}
	}

	claimsOK, countOK := true, true
	if s.Claims < 1 || s.Claims > MaxReservationClaims {
		claimsOK = false
		errs = append(errs, field.Invalid(p.Child("claims"), s.Claims,
			fmt.Sprintf("must be between 1 and %d", MaxReservationClaims)))
	}
	if s.Count < 1 || s.Count > MaxReservationCount {
		countOK = false
		errs = append(errs, field.Invalid(p.Child("count"), s.Count,
			fmt.Sprintf("must be between 1 and %d", MaxReservationCount)))
	}
	// The product is only meaningful when both factors are: an invalid
	// factor is already reported and would make this message misleading.
	if claimsOK && countOK {
		if total := int64(s.Claims) * s.Count; total > MaxReservationDevices {
			errs = append(errs, field.Invalid(p.Child("count"), s.Count,
				fmt.Sprintf("claims*count is %d devices; at most %d may be reserved at once", total, MaxReservationDevices)))
		}
	}

	errs = append(errs, validateSelectors(s.Selectors, p.Child("selectors"))...)

	switch ttl := s.TTL.Duration; {
	case ttl == 0:
		errs = append(errs, field.Required(p.Child("ttl"), "how long the devices stay held, for example 1h"))
	case ttl < 0:
		errs = append(errs, field.Invalid(p.Child("ttl"), s.TTL.Duration.String(), "must be positive"))
	case ttl > MaxReservationTTL:
		errs = append(errs, field.Invalid(p.Child("ttl"), s.TTL.Duration.String(),
			fmt.Sprintf("must be at most %s (7 days)", MaxReservationTTL)))
	}

	if s.Queue != "" {
		for _, msg := range validation.IsDNS1123Label(s.Queue) {
			errs = append(errs, field.Invalid(p.Child("queue"), s.Queue, msg))
		}
	}

	if s.Duration != nil && s.Duration.Duration <= 0 {
		errs = append(errs, field.Invalid(p.Child("duration"), s.Duration.Duration.String(), "must be positive when set"))
	}
	return errs
}

// validateSelectors compiles each selector with the same compiler and
// limits the scheduler uses for a ResourceClaim's device selectors, so a
// reservation is refused at admission rather than failing when planned.
func validateSelectors(selectors []string, p *field.Path) field.ErrorList {
	var errs field.ErrorList
	if len(selectors) == 0 {
		return nil
	}
	if len(selectors) > resourceapi.DeviceSelectorsMaxSize {
		// The planner turns them into a claim's device request, which
		// takes at most this many.
		return field.ErrorList{field.TooMany(p, len(selectors), resourceapi.DeviceSelectorsMaxSize)}
	}
	compiler := cel.GetCompiler(cel.Features{})
	for i, expr := range selectors {
		ip := p.Index(i)
		if expr == "" {
			errs = append(errs, field.Required(ip, "a CEL expression, for example device.driver == \"gpu.gpudra.dev\""))
			continue
		}
		if len(expr) > resourceapi.CELSelectorExpressionMaxLength {
			errs = append(errs, field.TooLong(ip, "", resourceapi.CELSelectorExpressionMaxLength))
			continue
		}
		res := compiler.CompileCELExpression(expr, cel.Options{})
		if res.Error != nil {
			errs = append(errs, field.Invalid(ip, expr, res.Error.Detail))
			continue
		}
		if res.MaxCost > resourceapi.CELSelectorExpressionMaxCost {
			errs = append(errs, field.Forbidden(ip,
				"too complex: its estimated cost exceeds the limit for a device selector; simplify it"))
		}
	}
	return errs
}

// ValidateReservationUpdate refuses any change to the spec: the held
// claims were planned from it, and changing it in place would leave them
// describing something else. Both sides are defaulted first so that a
// client writing back the defaults it read is not refused.
func ValidateReservationUpdate(newR, oldR *GpuReservation) field.ErrorList {
	errs := ValidateReservation(newR)
	if newR == nil || oldR == nil {
		return errs
	}
	n, o := newR.DeepCopy(), oldR.DeepCopy()
	n.Default()
	o.Default()
	if !equality.Semantic.DeepEqual(n.Spec, o.Spec) {
		errs = append(errs, field.Forbidden(field.NewPath("spec"), "spec is immutable; create a new GpuReservation"))
	}
	return errs
}

// Default fills a queue's optional fields. AgingPerMinute stays nil: nil
// and 0 mean different things (1 per minute, and no aging).
func (q *GpuQueue) Default() {
	if q.Spec.Policy == "" {
		q.Spec.Policy = FCFS
	}
	if q.Spec.DefaultShare == 0 {
		q.Spec.DefaultShare = 1
	}
}

// Policies lists the supported queue policies, in the order users read
// them in error messages.
var Policies = []QueuePolicy{FCFS, Priority, FairShare, ShortestJobFirst}

// ValidateQueue checks a queue's spec, defaulted. It does not modify q.
func ValidateQueue(q *GpuQueue) field.ErrorList {
	if q == nil {
		return field.ErrorList{field.Required(field.NewPath(""), "no GpuQueue")}
	}
	d := q.DeepCopy()
	d.Default()
	s, p := &d.Spec, field.NewPath("spec")
	var errs field.ErrorList

	known := false
	names := make([]string, 0, len(Policies))
	for _, pol := range Policies {
		names = append(names, string(pol))
		known = known || s.Policy == pol
	}
	if !known {
		errs = append(errs, field.NotSupported(p.Child("policy"), s.Policy, names))
	}

	if s.AgingPerMinute != nil && *s.AgingPerMinute < 0 {
		errs = append(errs, field.Invalid(p.Child("agingPerMinute"), *s.AgingPerMinute, "must not be negative"))
	}

	// Sorted so that the errors come out in the same order every time.
	for _, ns := range slices.Sorted(maps.Keys(s.Shares)) {
		share := s.Shares[ns]
		kp := p.Child("shares").Key(ns)
		for _, msg := range validation.IsDNS1123Label(ns) {
			errs = append(errs, field.Invalid(kp, ns, "not a namespace name: "+msg))
		}
		if share < 1 {
			errs = append(errs, field.Invalid(kp, share, "must be at least 1"))
		}
	}

	if s.DefaultShare < 1 {
		errs = append(errs, field.Invalid(p.Child("defaultShare"), s.DefaultShare, "must be at least 1"))
	}
	return errs
}

// AgingPerMinute is the queue's effective aging: absent means 1 point a
// minute, so that the Priority policy never starves by default.
func AgingPerMinute(q *GpuQueue) int32 {
	if q == nil || q.Spec.AgingPerMinute == nil {
		return 1
	}
	return *q.Spec.AgingPerMinute
}
