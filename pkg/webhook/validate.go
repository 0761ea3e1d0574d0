// Package webhook is gpudra's admission webhook. Validating: it refuses
// ResourceClaims, ResourceClaimTemplates, DeviceClasses and Grove
// PodCliqueSets whose opaque config for gpu.gpudra.dev the kubelet plugin
// would refuse at prepare, with the field named, at apply time instead of
// minutes later as a pod stuck in ContainerCreating; and GpuReservations and
// GpuQueues the controller could not act on. Mutating (mutate.go): it gates
// the pods of gangs so that the default scheduler places a gang only once
// all its devices are allocated.
package webhook

import (
	"fmt"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/validation/field"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// DriverName is the driver whose opaque config the webhook validates.
const DriverName = slicebuilder.DriverName

// validateOpaque checks one opaque config with the plugin's own decoder
// (pkg/plugin/plan.go configFor), so that what passes here passes there.
// Configs of other drivers are theirs to check.
func validateOpaque(o *resourceapi.OpaqueDeviceConfiguration, p *field.Path) field.ErrorList {
	if o == nil || o.Driver != DriverName {
		return nil
	}
	if _, err := gpuapi.Decode(o.Parameters.Raw); err != nil {
		// The value is the whole JSON document: printing it again would
		// bury the reason, so only the reason is said.
		return field.ErrorList{{Type: field.ErrorTypeInvalid, Field: p.Child("parameters").String(), BadValue: field.OmitValueType{}, Detail: err.Error()}}
	}
	return nil
}

// ValidateClaimSpec checks the opaque configs of a claim's spec, at p.
func ValidateClaimSpec(spec *resourceapi.ResourceClaimSpec, p *field.Path) field.ErrorList {
	var errs field.ErrorList
	cp := p.Child("devices", "config")
	for i := range spec.Devices.Config {
		errs = append(errs, validateOpaque(spec.Devices.Config[i].Opaque, cp.Index(i).Child("opaque"))...)
	}
	return errs
}

// ValidateClaim checks a ResourceClaim.
func ValidateClaim(c *resourceapi.ResourceClaim) field.ErrorList {
	return ValidateClaimSpec(&c.Spec, field.NewPath("spec"))
}

// ValidateClaimTemplate checks a ResourceClaimTemplate.
func ValidateClaimTemplate(t *resourceapi.ResourceClaimTemplate) field.ErrorList {
	return ValidateClaimSpec(&t.Spec.Spec, field.NewPath("spec", "spec"))
}

// ValidateDeviceClass checks a DeviceClass: its config applies to every
// claim of the class, so a wrong one would fail all of them.
func ValidateDeviceClass(c *resourceapi.DeviceClass) field.ErrorList {
	var errs field.ErrorList
	cp := field.NewPath("spec", "config")
	for i := range c.Spec.Config {
		errs = append(errs, validateOpaque(c.Spec.Config[i].Opaque, cp.Index(i).Child("opaque"))...)
	}
	return errs
}

// ValidatePodCliqueSet checks the claim templates a Grove PodCliqueSet
// embeds (spec.template.resourceClaimTemplates[].templateSpec, a
// ResourceClaimTemplateSpec), from the object as unstructured: the webhook
// needs no Grove Go types, and a Grove release that adds fields does not
// break it.
func ValidatePodCliqueSet(obj *unstructured.Unstructured) field.ErrorList {
	p := field.NewPath("spec", "template", "resourceClaimTemplates")
	items, found, err := unstructured.NestedSlice(obj.Object, "spec", "template", "resourceClaimTemplates")
	if err != nil {
		return field.ErrorList{field.Invalid(p, field.OmitValueType{}, err.Error())}
	}
	if !found {
		return nil
	}
	var errs field.ErrorList
	for i, item := range items {
		ip := p.Index(i).Child("templateSpec")
		m, ok := item.(map[string]any)
		if !ok {
			errs = append(errs, field.Invalid(p.Index(i), field.OmitValueType{}, "not an object"))
			continue
		}
		ts, ok := m["templateSpec"].(map[string]any)
		if !ok {
			continue
		}
		var spec resourceapi.ResourceClaimTemplateSpec
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(ts, &spec); err != nil {
			errs = append(errs, field.Invalid(ip, field.OmitValueType{}, fmt.Sprintf("not a ResourceClaimTemplateSpec: %v", err)))
			continue
		}
		errs = append(errs, ValidateClaimSpec(&spec.Spec, ip.Child("spec"))...)
	}
	return errs
}
