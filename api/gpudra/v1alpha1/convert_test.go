package v1alpha1

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/utils/ptr"
)

func TestToAndFromUnstructuredRoundTrip(t *testing.T) {
	r := fullReservation()
	u, err := ToUnstructured(r)
	require.NoError(t, err)
	assert.Equal(t, APIVersion, u.GetAPIVersion())
	assert.Equal(t, KindGpuReservation, u.GetKind())
	// Durations and times travel as the strings the CRD schema declares.
	ttl, _, _ := unstructured.NestedString(u.Object, "spec", "ttl")
	assert.Equal(t, "1h0m0s", ttl)
	exp, _, _ := unstructured.NestedString(u.Object, "status", "expiresAt")
	assert.Equal(t, "2030-01-02T03:04:05Z", exp)

	back, err := FromUnstructured[GpuReservation](u)
	require.NoError(t, err)
	want := r.DeepCopy()
	want.APIVersion, want.Kind = APIVersion, KindGpuReservation
	// metav1.Time decodes into the local zone: compare times as instants.
	assert.True(t, equality.Semantic.DeepEqual(want, back), "round trip changed the object:\nwant %+v\ngot  %+v", want, back)

	q := fullQueue()
	uq, err := ToUnstructured(q)
	require.NoError(t, err)
	assert.Equal(t, KindGpuQueue, uq.GetKind())
	qBack, err := FromUnstructured[GpuQueue](uq)
	require.NoError(t, err)
	assert.Equal(t, q.Spec, qBack.Spec)
	assert.Equal(t, q.Status, qBack.Status)
}

func TestToUnstructuredKeepsTypeMeta(t *testing.T) {
	r := &GpuReservation{TypeMeta: metav1.TypeMeta{APIVersion: "gpudra.dev/v1beta9", Kind: "Other"}}
	u, err := ToUnstructured(r)
	require.NoError(t, err)
	assert.Equal(t, "gpudra.dev/v1beta9", u.GetAPIVersion())
	assert.Equal(t, "Other", u.GetKind())
}

func TestToUnstructuredErrors(t *testing.T) {
	_, err := ToUnstructured(nil)
	assert.Error(t, err)
	_, err = ToUnstructured(GpuReservation{}) // not a pointer
	assert.Error(t, err)
	_, err = ToUnstructured((*GpuReservation)(nil))
	assert.Error(t, err)
}

func TestFromUnstructuredUnknownField(t *testing.T) {
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": APIVersion,
		"kind":       KindGpuReservation,
		"metadata":   map[string]any{"name": "train", "namespace": "ml"},
		"spec": map[string]any{
			"deviceClassName": "gpu.gpudra.dev",
			"ttl":             "1h",
			"cuont":           int64(4),
		},
	}}
	_, err := FromUnstructured[GpuReservation](u)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "spec.cuont")
	assert.Contains(t, err.Error(), "GpuReservation ml/train")

	uq := &unstructured.Unstructured{Object: map[string]any{
		"kind":     KindGpuQueue,
		"metadata": map[string]any{"name": "research"},
		"status":   map[string]any{"unknown": "x"},
	}}
	_, err = FromUnstructured[GpuQueue](uq)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "status.unknown")
	assert.Contains(t, err.Error(), "GpuQueue research")
}

func TestFromUnstructuredBadValues(t *testing.T) {
	u := &unstructured.Unstructured{Object: map[string]any{
		"kind":     KindGpuReservation,
		"metadata": map[string]any{"name": "r", "namespace": "ns"},
		"spec":     map[string]any{"deviceClassName": "c", "ttl": "forever"},
	}}
	_, err := FromUnstructured[GpuReservation](u)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "GpuReservation ns/r")

	_, err = FromUnstructured[GpuReservation](nil)
	assert.Error(t, err)
}

func TestFromUnstructuredParsesDurations(t *testing.T) {
	u := &unstructured.Unstructured{Object: map[string]any{
		"spec": map[string]any{"deviceClassName": "c", "ttl": "90m", "duration": "2h30m", "count": int64(2)},
	}}
	r, err := FromUnstructured[GpuReservation](u)
	require.NoError(t, err)
	assert.Equal(t, 90*time.Minute, r.Spec.TTL.Duration)
	assert.Equal(t, ptr.To(metav1.Duration{Duration: 150 * time.Minute}), r.Spec.Duration)
	assert.Equal(t, int64(2), r.Spec.Count)
}
