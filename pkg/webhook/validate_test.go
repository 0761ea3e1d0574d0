package webhook

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionv1 "k8s.io/api/admission/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
)

const (
	good     = `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"activeThreadPercentage":50}}}`
	badStrat = `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"Fast"}}`
	unknown  = `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","color":"red"}}`
	badKind  = `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"CpuConfig"}`
)

func opaque(driver, params string) resourceapi.DeviceClaimConfiguration {
	return resourceapi.DeviceClaimConfiguration{DeviceConfiguration: resourceapi.DeviceConfiguration{
		Opaque: &resourceapi.OpaqueDeviceConfiguration{Driver: driver, Parameters: runtime.RawExtension{Raw: []byte(params)}}}}
}

func claim(configs ...resourceapi.DeviceClaimConfiguration) *resourceapi.ResourceClaim {
	return &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "c", Namespace: "ns"},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Config: configs}}}
}

func TestValidateClaim(t *testing.T) {
	for name, tc := range map[string]struct {
		claim *resourceapi.ResourceClaim
		want  []string // substrings of the one error each, in order
	}{
		"no config":           {claim: claim()},
		"good":                {claim: claim(opaque(DriverName, good))},
		"other driver's junk": {claim: claim(opaque("other.example.com", `{"not":"ours"}`))},
		"bad strategy": {claim: claim(opaque(DriverName, badStrat)),
			want: []string{`spec.devices.config[0].opaque.parameters: Invalid value: invalid GpuConfig: sharing.strategy: Unsupported value: "Fast"`}},
		"unknown field, second config": {claim: claim(opaque(DriverName, good), opaque(DriverName, unknown)),
			want: []string{`spec.devices.config[1].opaque.parameters: Invalid value: decode GpuConfig: unknown field "sharing.color"`}},
		"two bad": {claim: claim(opaque(DriverName, badKind), opaque("x", "{}"), opaque(DriverName, "not json")),
			want: []string{`spec.devices.config[0].opaque.parameters`, `spec.devices.config[2].opaque.parameters: Invalid value: decode GpuConfig`}},
	} {
		t.Run(name, func(t *testing.T) {
			errs := ValidateClaim(tc.claim)
			require.Len(t, errs, len(tc.want), "%v", errs)
			for i, w := range tc.want {
				assert.Contains(t, errs[i].Error(), w)
			}
		})
	}
}

func TestValidateOtherKinds(t *testing.T) {
	tmpl := &resourceapi.ResourceClaimTemplate{Spec: resourceapi.ResourceClaimTemplateSpec{Spec: claim(opaque(DriverName, badStrat)).Spec}}
	errs := ValidateClaimTemplate(tmpl)
	require.Len(t, errs, 1)
	assert.Contains(t, errs[0].Error(), "spec.spec.devices.config[0].opaque.parameters: ")

	class := &resourceapi.DeviceClass{Spec: resourceapi.DeviceClassSpec{Config: []resourceapi.DeviceClassConfiguration{
		{DeviceConfiguration: opaque(DriverName, good).DeviceConfiguration},
		{DeviceConfiguration: opaque(DriverName, badKind).DeviceConfiguration},
	}}}
	errs = ValidateDeviceClass(class)
	require.Len(t, errs, 1)
	assert.Contains(t, errs[0].Error(), "spec.config[1].opaque.parameters: Invalid value: invalid GpuConfig: kind")
}

func TestReview(t *testing.T) {
	pcs := func(params string) any {
		return map[string]any{"apiVersion": "grove.io/v1alpha1", "kind": "PodCliqueSet", "metadata": map[string]any{"name": "p"},
			"spec": map[string]any{"template": map[string]any{"resourceClaimTemplates": []any{
				map[string]any{"name": "no-spec"},
				map[string]any{"name": "gpu", "templateSpec": map[string]any{"spec": map[string]any{"devices": map[string]any{
					"config": []any{map[string]any{"opaque": map[string]any{"driver": DriverName, "parameters": json.RawMessage(params)}}},
				}}}},
			}}}}
	}
	for name, tc := range map[string]struct {
		resource metav1.GroupVersionResource
		op       admissionv1.Operation
		object   any
		allowed  bool
		message  string
	}{
		"claim good": {resource: metav1.GroupVersionResource(ResourceClaims), object: claim(opaque(DriverName, good)), allowed: true},
		"claim bad": {resource: metav1.GroupVersionResource(ResourceClaims), object: claim(opaque(DriverName, badStrat)),
			message: `spec.devices.config[0].opaque.parameters: Invalid value: invalid GpuConfig: sharing.strategy`},
		"claim bad, delete": {resource: metav1.GroupVersionResource(ResourceClaims), op: admissionv1.Delete, allowed: true},
		"podcliqueset good": {resource: metav1.GroupVersionResource(PodCliqueSets), object: pcs(good), allowed: true},
		"podcliqueset bad": {resource: metav1.GroupVersionResource(PodCliqueSets), object: pcs(badStrat),
			message: `spec.template.resourceClaimTemplates[1].templateSpec.spec.devices.config[0].opaque.parameters: Invalid value: invalid GpuConfig`},
		"unknown resource":  {resource: metav1.GroupVersionResource{Group: "", Version: "v1", Resource: "pods"}, object: map[string]any{}, allowed: true},
		"undecodable claim": {resource: metav1.GroupVersionResource(ResourceClaims), object: "a string", message: "decode ResourceClaim"},
	} {
		t.Run(name, func(t *testing.T) {
			op := tc.op
			if op == "" {
				op = admissionv1.Create
			}
			req := &admissionv1.AdmissionRequest{UID: types.UID("u1"), Resource: tc.resource, Operation: op}
			if tc.object != nil {
				raw, err := json.Marshal(tc.object)
				require.NoError(t, err)
				req.Object.Raw = raw
			}
			resp := Review(req)
			assert.Equal(t, types.UID("u1"), resp.UID)
			assert.Equal(t, tc.allowed, resp.Allowed)
			if !tc.allowed {
				assert.Contains(t, resp.Result.Message, tc.message)
			}
		})
	}
}

// TestReviewGpudraResources: GpuReservations and GpuQueues are decoded
// strictly and checked by the API package's validation; an update of a
// reservation is checked against the old object.
func TestReviewGpudraResources(t *testing.T) {
	res := func(spec map[string]any) map[string]any {
		return map[string]any{"apiVersion": "gpudra.dev/v1alpha1", "kind": "GpuReservation",
			"metadata": map[string]any{"name": "r", "namespace": "ns"}, "spec": spec}
	}
	goodSpec := map[string]any{"deviceClassName": "gpu.gpudra.dev", "claims": 2, "count": 8, "ttl": "1h"}
	queue := func(spec map[string]any) map[string]any {
		return map[string]any{"apiVersion": "gpudra.dev/v1alpha1", "kind": "GpuQueue", "metadata": map[string]any{"name": "q"}, "spec": spec}
	}
	reservations := metav1.GroupVersionResource(GpuReservations)
	queues := metav1.GroupVersionResource(GpuQueues)
	for name, tc := range map[string]struct {
		resource    metav1.GroupVersionResource
		op          admissionv1.Operation
		object, old any
		message     string // "" when allowed
	}{
		"reservation good": {resource: reservations, object: res(goodSpec)},
		"reservation without ttl": {resource: reservations, object: res(map[string]any{"deviceClassName": "gpu.gpudra.dev"}),
			message: "spec.ttl: Required value"},
		"reservation too many claims": {resource: reservations, object: res(map[string]any{"deviceClassName": "gpu.gpudra.dev", "claims": 65, "ttl": "1h"}),
			message: "spec.claims: Invalid value: 65"},
		"reservation with an unknown field": {resource: reservations, object: res(map[string]any{"deviceClassName": "gpu.gpudra.dev", "ttl": "1h", "gpus": 4}),
			message: `unknown field "spec.gpus"`},
		"reservation metadata changed": {resource: reservations, op: admissionv1.Update, object: res(goodSpec),
			old: func() any {
				o := res(goodSpec)
				o["metadata"] = map[string]any{"name": "r", "namespace": "ns", "labels": map[string]any{"a": "b"}}
				return o
			}()},
		"reservation defaults written back": {resource: reservations, op: admissionv1.Update,
			object: res(map[string]any{"deviceClassName": "gpu.gpudra.dev", "claims": 1, "count": 1, "queue": "default", "ttl": "1h"}),
			old:    res(map[string]any{"deviceClassName": "gpu.gpudra.dev", "ttl": "1h"})},
		"reservation spec changed": {resource: reservations, op: admissionv1.Update, object: res(goodSpec),
			old:     res(map[string]any{"deviceClassName": "gpu.gpudra.dev", "claims": 1, "count": 8, "ttl": "1h"}),
			message: "spec: Forbidden: spec is immutable"},
		"reservation update, old undecodable": {resource: reservations, op: admissionv1.Update, object: res(goodSpec), old: "junk",
			message: "old object"},
		"reservation delete": {resource: reservations, op: admissionv1.Delete},
		"queue good":         {resource: queues, object: queue(map[string]any{"policy": "Priority", "agingPerMinute": 2})},
		"queue empty":        {resource: queues, object: queue(map[string]any{})},
		"queue unknown policy": {resource: queues, object: queue(map[string]any{"policy": "Lottery"}),
			message: `spec.policy: Unsupported value: "Lottery"`},
		"queue update, bad": {resource: queues, op: admissionv1.Update, object: queue(map[string]any{"agingPerMinute": -1}),
			old: queue(map[string]any{}), message: "spec.agingPerMinute"},
		"queue with an unknown field": {resource: queues, object: queue(map[string]any{"policy": "FCFS", "weight": 3}),
			message: `unknown field "spec.weight"`},
	} {
		t.Run(name, func(t *testing.T) {
			op := tc.op
			if op == "" {
				op = admissionv1.Create
			}
			req := &admissionv1.AdmissionRequest{UID: types.UID("u1"), Resource: tc.resource, Operation: op}
			for _, o := range []struct {
				obj any
				raw *runtime.RawExtension
			}{{tc.object, &req.Object}, {tc.old, &req.OldObject}} {
				if o.obj != nil {
					raw, err := json.Marshal(o.obj)
					require.NoError(t, err)
					o.raw.Raw = raw
				}
			}
			resp := Review(req)
			if tc.message == "" {
				assert.True(t, resp.Allowed, "%v", resp.Result)
				return
			}
			require.False(t, resp.Allowed)
			assert.Contains(t, resp.Result.Message, tc.message)
		})
	}
}
