package v1alpha1

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

// fullReservation sets every field, so that a deep copy that forgets a
// pointer, slice or map shows up in the mutation test.
func fullReservation() *GpuReservation {
	at := metav1.NewTime(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	return &GpuReservation{
		ObjectMeta: metav1.ObjectMeta{Name: "train", Namespace: "ml", Labels: map[string]string{"a": "b"}},
		Spec: GpuReservationSpec{
			DeviceClassName:  "gpu.gpudra.dev",
			Claims:           2,
			Count:            8,
			Selectors:        []string{"true"},
			SameNVLinkDomain: true,
			TTL:              metav1.Duration{Duration: time.Hour},
			Priority:         3,
			Queue:            "research",
			Duration:         &metav1.Duration{Duration: 30 * time.Minute},
		},
		Status: GpuReservationStatus{
			Phase:         ReservationHeld,
			Reason:        ReasonAllocated,
			Message:       "held",
			QueuePosition: 0,
			Claims: []HeldClaim{
				{Name: "train-0", Node: "n1", Devices: []string{"n1/gpu-0"}, InUse: true},
				{Name: "train-1", Node: "n2", Devices: []string{"n2/gpu-0"}},
			},
			Devices:            16,
			Nodes:              []string{"n1", "n2"},
			NVLinkDomains:      []string{"d1"},
			QueuedAt:           &at,
			HeldAt:             &at,
			ExpiresAt:          &at,
			ObservedGeneration: 4,
		},
	}
}

func fullQueue() *GpuQueue {
	return &GpuQueue{
		ObjectMeta: metav1.ObjectMeta{Name: "research", Annotations: map[string]string{"x": "y"}},
		Spec: GpuQueueSpec{
			Policy:         FairShare,
			AgingPerMinute: ptr.To[int32](2),
			Shares:         map[string]int32{"team-a": 2},
			DefaultShare:   1,
		},
		Status: GpuQueueStatus{Waiting: 2, WaitingDevices: 16, Head: "GpuReservation/ml/train", HeadReason: ReasonWaitingForDevices},
	}
}

func TestReservationDeepCopy(t *testing.T) {
	orig := fullReservation()
	want := fullReservation()
	c := orig.DeepCopy()
	assert.Equal(t, orig, c)

	c.Labels["a"] = "changed"
	c.Spec.Selectors[0] = "false"
	c.Spec.Duration.Duration = time.Second
	c.Status.Claims[0].Devices[0] = "changed"
	c.Status.Claims[1].Name = "changed"
	c.Status.Nodes[0] = "changed"
	c.Status.NVLinkDomains[0] = "changed"
	c.Status.QueuedAt.Time = time.Time{}
	c.Status.HeldAt.Time = time.Time{}
	c.Status.ExpiresAt.Time = time.Time{}
	assert.Equal(t, want, orig, "mutating the copy changed the original")

	var nilR *GpuReservation
	assert.Nil(t, nilR.DeepCopy())
	assert.Nil(t, nilR.DeepCopyObject())
	assert.Equal(t, orig, orig.DeepCopyObject())
}

func TestReservationPartsDeepCopy(t *testing.T) {
	orig := fullReservation()
	spec := orig.Spec.DeepCopy()
	spec.Selectors[0] = "x"
	spec.Duration.Duration = 0
	status := orig.Status.DeepCopy()
	status.Claims[0].Devices[0] = "x"
	status.ExpiresAt.Time = time.Time{}
	held := orig.Status.Claims[0].DeepCopy()
	held.Devices[0] = "y"
	assert.Equal(t, fullReservation(), orig)

	// Nil stays nil, empty stays empty: a copy must compare equal.
	empty := &GpuReservationSpec{Selectors: []string{}}
	assert.Equal(t, empty, empty.DeepCopy())
	assert.Nil(t, (&GpuReservationSpec{}).DeepCopy().Selectors)
	assert.Nil(t, (*GpuReservationSpec)(nil).DeepCopy())
	assert.Nil(t, (*GpuReservationStatus)(nil).DeepCopy())
	assert.Nil(t, (*HeldClaim)(nil).DeepCopy())
}

func TestQueueDeepCopy(t *testing.T) {
	orig := fullQueue()
	c := orig.DeepCopy()
	assert.Equal(t, orig, c)
	c.Annotations["x"] = "changed"
	*c.Spec.AgingPerMinute = 9
	c.Spec.Shares["team-a"] = 9
	c.Spec.Shares["team-b"] = 1
	c.Status.Head = "changed"
	assert.Equal(t, fullQueue(), orig, "mutating the copy changed the original")
	assert.Nil(t, (*GpuQueue)(nil).DeepCopy())
	assert.Nil(t, (*GpuQueue)(nil).DeepCopyObject())
}

func TestListDeepCopy(t *testing.T) {
	rl := &GpuReservationList{Items: []GpuReservation{*fullReservation()}}
	rc := rl.DeepCopyObject().(*GpuReservationList)
	rc.Items[0].Spec.Selectors[0] = "changed"
	assert.Equal(t, "true", rl.Items[0].Spec.Selectors[0])

	ql := &GpuQueueList{Items: []GpuQueue{*fullQueue()}}
	qc := ql.DeepCopyObject().(*GpuQueueList)
	qc.Items[0].Spec.Shares["team-a"] = 7
	assert.Equal(t, int32(2), ql.Items[0].Spec.Shares["team-a"])
}
