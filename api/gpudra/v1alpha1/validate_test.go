package v1alpha1

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/utils/ptr"
)

func validReservation() *GpuReservation {
	return &GpuReservation{
		ObjectMeta: metav1.ObjectMeta{Name: "train", Namespace: "ml"},
		Spec: GpuReservationSpec{
			DeviceClassName: "gpu.gpudra.dev",
			TTL:             metav1.Duration{Duration: time.Hour},
		},
	}
}

// errorFields renders each error as "<field>:<type>" so that a test names
// both where and what.
func errorFields(errs field.ErrorList) []string {
	var out []string
	for _, e := range errs {
		out = append(out, e.Field+":"+string(e.Type))
	}
	return out
}

func TestReservationDefault(t *testing.T) {
	r := validReservation()
	r.Default()
	assert.Equal(t, int32(1), r.Spec.Claims)
	assert.Equal(t, int64(1), r.Spec.Count)
	assert.Equal(t, DefaultQueue, r.Spec.Queue)

	// Set values are kept.
	r = validReservation()
	r.Spec.Claims, r.Spec.Count, r.Spec.Queue = 4, 8, "research"
	r.Default()
	assert.Equal(t, int32(4), r.Spec.Claims)
	assert.Equal(t, int64(8), r.Spec.Count)
	assert.Equal(t, "research", r.Spec.Queue)
}

func TestValidateReservation(t *testing.T) {
	long := "device.driver == \"gpu.gpudra.dev\"" + strings.Repeat(" ", 10*1024)
	tests := []struct {
		name   string
		mutate func(*GpuReservation)
		want   []string // "<field>:<type>", in order; nil: valid
	}{
		{name: "minimal valid", mutate: func(*GpuReservation) {}},
		{name: "full valid", mutate: func(r *GpuReservation) {
			r.Spec.Claims, r.Spec.Count = 8, 64
			r.Spec.Selectors = []string{
				`device.attributes["gpu.gpudra.dev"].productName == "NVIDIA H100 80GB HBM3"`,
				`device.capacity["gpu.gpudra.dev"].memory.compareTo(quantity("40Gi")) >= 0`,
			}
			r.Spec.SameNVLinkDomain = true
			r.Spec.TTL.Duration = 7 * 24 * time.Hour
			r.Spec.Priority = -5
			r.Spec.Queue = "research"
			r.Spec.Duration = &metav1.Duration{Duration: 30 * time.Minute}
		}},
		{name: "deviceClassName missing", mutate: func(r *GpuReservation) { r.Spec.DeviceClassName = "" },
			want: []string{"spec.deviceClassName:FieldValueRequired"}},
		{name: "deviceClassName not a DNS subdomain", mutate: func(r *GpuReservation) { r.Spec.DeviceClassName = "GPU_class" },
			want: []string{"spec.deviceClassName:FieldValueInvalid"}},
		{name: "claims negative", mutate: func(r *GpuReservation) { r.Spec.Claims = -1 },
			want: []string{"spec.claims:FieldValueInvalid"}},
		{name: "claims too many", mutate: func(r *GpuReservation) { r.Spec.Claims = 65 },
			want: []string{"spec.claims:FieldValueInvalid"}},
		{name: "count negative", mutate: func(r *GpuReservation) { r.Spec.Count = -3 },
			want: []string{"spec.count:FieldValueInvalid"}},
		{name: "count too many", mutate: func(r *GpuReservation) { r.Spec.Count = 65 },
			want: []string{"spec.count:FieldValueInvalid"}},
		{name: "claims*count at limit", mutate: func(r *GpuReservation) { r.Spec.Claims, r.Spec.Count = 8, 64 }},
		{name: "claims*count over limit", mutate: func(r *GpuReservation) { r.Spec.Claims, r.Spec.Count = 9, 64 },
			want: []string{"spec.count:FieldValueInvalid"}},
		{name: "empty selector", mutate: func(r *GpuReservation) { r.Spec.Selectors = []string{"true", ""} },
			want: []string{"spec.selectors[1]:FieldValueRequired"}},
		{name: "selector does not compile", mutate: func(r *GpuReservation) { r.Spec.Selectors = []string{"device.nope ==="} },
			want: []string{"spec.selectors[0]:FieldValueInvalid"}},
		{name: "selector not boolean", mutate: func(r *GpuReservation) { r.Spec.Selectors = []string{`device.driver`} },
			want: []string{"spec.selectors[0]:FieldValueInvalid"}},
		{name: "selector too long", mutate: func(r *GpuReservation) { r.Spec.Selectors = []string{long} },
			want: []string{"spec.selectors[0]:FieldValueTooLong"}},
		{name: "too many selectors", mutate: func(r *GpuReservation) {
			r.Spec.Selectors = make([]string, 33)
			for i := range r.Spec.Selectors {
				r.Spec.Selectors[i] = "true"
			}
		}, want: []string{"spec.selectors:FieldValueTooMany"}},
		{name: "ttl missing", mutate: func(r *GpuReservation) { r.Spec.TTL.Duration = 0 },
			want: []string{"spec.ttl:FieldValueRequired"}},
		{name: "ttl negative", mutate: func(r *GpuReservation) { r.Spec.TTL.Duration = -time.Minute },
			want: []string{"spec.ttl:FieldValueInvalid"}},
		{name: "ttl over 7 days", mutate: func(r *GpuReservation) { r.Spec.TTL.Duration = 7*24*time.Hour + time.Second },
			want: []string{"spec.ttl:FieldValueInvalid"}},
		{name: "queue not a DNS label", mutate: func(r *GpuReservation) { r.Spec.Queue = "Team.A" },
			want: []string{"spec.queue:FieldValueInvalid"}},
		{name: "duration zero", mutate: func(r *GpuReservation) { r.Spec.Duration = &metav1.Duration{} },
			want: []string{"spec.duration:FieldValueInvalid"}},
		{name: "duration negative", mutate: func(r *GpuReservation) { r.Spec.Duration = &metav1.Duration{Duration: -time.Second} },
			want: []string{"spec.duration:FieldValueInvalid"}},
		{name: "several errors at once", mutate: func(r *GpuReservation) {
			r.Spec.DeviceClassName = ""
			r.Spec.Claims = 100
			r.Spec.TTL.Duration = 0
		}, want: []string{"spec.deviceClassName:FieldValueRequired", "spec.claims:FieldValueInvalid", "spec.ttl:FieldValueRequired"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := validReservation()
			tt.mutate(r)
			before := r.DeepCopy()
			errs := ValidateReservation(r)
			assert.Equal(t, tt.want, errorFields(errs), "%v", errs)
			assert.Equal(t, before, r, "validation must not modify its input (not even defaulting)")
		})
	}
}

func TestValidateReservationUpdate(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(newR *GpuReservation)
		want   []string
	}{
		{name: "no change", mutate: func(*GpuReservation) {}},
		{name: "status and metadata may change", mutate: func(r *GpuReservation) {
			r.Status.Phase = ReservationHeld
			r.Labels = map[string]string{"a": "b"}
		}},
		{name: "writing back the defaults is not a change", mutate: func(r *GpuReservation) { r.Default() }},
		{name: "count changed", mutate: func(r *GpuReservation) { r.Spec.Count = 2 },
			want: []string{"spec:FieldValueForbidden"}},
		{name: "ttl changed", mutate: func(r *GpuReservation) { r.Spec.TTL.Duration = 2 * time.Hour },
			want: []string{"spec:FieldValueForbidden"}},
		{name: "selectors added", mutate: func(r *GpuReservation) { r.Spec.Selectors = []string{"true"} },
			want: []string{"spec:FieldValueForbidden"}},
		{name: "changed and invalid: both reported", mutate: func(r *GpuReservation) { r.Spec.Count = 100 },
			want: []string{"spec.count:FieldValueInvalid", "spec:FieldValueForbidden"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			oldR := validReservation()
			newR := oldR.DeepCopy()
			tt.mutate(newR)
			errs := ValidateReservationUpdate(newR, oldR)
			assert.Equal(t, tt.want, errorFields(errs), "%v", errs)
		})
	}
	errs := ValidateReservationUpdate(validReservation(), validReservation())
	assert.Empty(t, errs)
	forbidden := ValidateReservationUpdate(&GpuReservation{Spec: GpuReservationSpec{DeviceClassName: "x", TTL: metav1.Duration{Duration: time.Hour}, Count: 3}}, validReservation())
	require.Len(t, forbidden, 1)
	assert.Contains(t, forbidden[0].Error(), "spec is immutable; create a new GpuReservation")
}

func TestQueueDefault(t *testing.T) {
	q := &GpuQueue{}
	q.Default()
	assert.Equal(t, FCFS, q.Spec.Policy)
	assert.Equal(t, int32(1), q.Spec.DefaultShare)
	assert.Nil(t, q.Spec.AgingPerMinute, "nil aging means 1 and must stay distinguishable from 0")

	q = &GpuQueue{Spec: GpuQueueSpec{Policy: FairShare, DefaultShare: 3}}
	q.Default()
	assert.Equal(t, FairShare, q.Spec.Policy)
	assert.Equal(t, int32(3), q.Spec.DefaultShare)
}

func TestValidateQueue(t *testing.T) {
	tests := []struct {
		name string
		spec GpuQueueSpec
		want []string
	}{
		{name: "empty is valid (defaults)", spec: GpuQueueSpec{}},
		{name: "every policy", spec: GpuQueueSpec{Policy: ShortestJobFirst}},
		{name: "priority with aging off", spec: GpuQueueSpec{Policy: Priority, AgingPerMinute: ptr.To[int32](0)}},
		{name: "fair share", spec: GpuQueueSpec{Policy: FairShare, Shares: map[string]int32{"team-a": 3, "team-b": 1}, DefaultShare: 2}},
		{name: "unknown policy", spec: GpuQueueSpec{Policy: "LIFO"},
			want: []string{"spec.policy:FieldValueNotSupported"}},
		{name: "negative aging", spec: GpuQueueSpec{AgingPerMinute: ptr.To[int32](-1)},
			want: []string{"spec.agingPerMinute:FieldValueInvalid"}},
		{name: "bad namespace and share, sorted by key", spec: GpuQueueSpec{Shares: map[string]int32{"ok": 0, "Not_A_Namespace": 1}},
			want: []string{"spec.shares[Not_A_Namespace]:FieldValueInvalid", "spec.shares[ok]:FieldValueInvalid"}},
		{name: "negative default share", spec: GpuQueueSpec{DefaultShare: -1},
			want: []string{"spec.defaultShare:FieldValueInvalid"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			q := &GpuQueue{ObjectMeta: metav1.ObjectMeta{Name: "default"}, Spec: tt.spec}
			before := q.DeepCopy()
			errs := ValidateQueue(q)
			assert.Equal(t, tt.want, errorFields(errs), "%v", errs)
			assert.Equal(t, before, q, "validation must not modify its input")
		})
	}
	for _, p := range Policies {
		assert.Empty(t, ValidateQueue(&GpuQueue{Spec: GpuQueueSpec{Policy: p}}), p)
	}
}

func TestAgingPerMinute(t *testing.T) {
	assert.Equal(t, int32(1), AgingPerMinute(nil))
	assert.Equal(t, int32(1), AgingPerMinute(&GpuQueue{}))
	assert.Equal(t, int32(0), AgingPerMinute(&GpuQueue{Spec: GpuQueueSpec{AgingPerMinute: ptr.To[int32](0)}}))
	assert.Equal(t, int32(5), AgingPerMinute(&GpuQueue{Spec: GpuQueueSpec{AgingPerMinute: ptr.To[int32](5)}}))
}
