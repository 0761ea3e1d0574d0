package plugin

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	metav1validation "k8s.io/apimachinery/pkg/apis/meta/v1/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/client-go/kubernetes/fake"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
	"github.com/gpudra/gpudra/pkg/prepared"
)

// timeSlicedClaim is a claim in a fake API server with no status yet, and
// its prepared record: a time-sliced GPU, which has a device status.
func timeSlicedClaim() (*resourceapi.ResourceClaim, *fake.Clientset, prepared.Claim) {
	claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "ts", Namespace: "ns", UID: "uid-ts", Generation: 1}}
	rec := prepared.Claim{UID: "uid-ts", Namespace: "ns", Name: "ts",
		Devices: []prepared.Device{{Pool: "node", Device: "gpu-0", UUID: "GPU-0", MemoryBytes: 80 << 30}},
		Sharing: &gpuapi.Sharing{Strategy: gpuapi.TimeSlicing}}
	return claim, fake.NewClientset(claim), rec
}

// A repeat prepare (a kubelet retry, a plugin restart) writes no device
// status when the claim already has it, and a condition's transition time
// stays put while its status does.
func TestDeviceStatusWrittenOnlyWhenItChanges(t *testing.T) {
	ctx := context.Background()
	claim, client, rec := timeSlicedClaim()
	patches := func() int {
		n := 0
		for _, a := range client.Actions() {
			if a.GetVerb() == "patch" && a.GetSubresource() == "status" {
				n++
			}
		}
		return n
	}

	require.NoError(t, writeDeviceStatus(ctx, client, "gpu.gpudra.dev/node", claim, rec))
	require.Equal(t, 1, patches())
	written, err := client.ResourceV1().ResourceClaims("ns").Get(ctx, "ts", metav1.GetOptions{})
	require.NoError(t, err)
	require.Len(t, written.Status.Devices, 1)
	first := written.Status.Devices[0].Conditions[0].LastTransitionTime

	// The same prepare again, with the claim as the API now has it.
	require.NoError(t, writeDeviceStatus(ctx, client, "gpu.gpudra.dev/node", written, rec))
	assert.Equal(t, 1, patches(), "nothing to write: the status says the same")

	// IPC added to the config: the data changes, the condition's status
	// (not all enforced) does not, nor does its transition time.
	rec.Sharing = &gpuapi.Sharing{Strategy: gpuapi.TimeSlicing, IPC: true}
	require.NoError(t, writeDeviceStatus(ctx, client, "gpu.gpudra.dev/node", written, rec))
	assert.Equal(t, 2, patches())
	again, err := client.ResourceV1().ResourceClaims("ns").Get(ctx, "ts", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, first, again.Status.Devices[0].Conditions[0].LastTransitionTime)
	assert.Contains(t, string(again.Status.Devices[0].Data.Raw), `"ipc"`)
}

// The SharingLimitsEnforced condition is True only when every limit the
// claim asked for is enforced, and a False one names the limits that are
// not.
func TestSharingLimitsEnforcedCondition(t *testing.T) {
	ctx := context.Background()
	pct := int32(50)
	limit := resource.MustParse("40Gi")
	gpu := prepared.Device{Pool: "node", Device: "gpu-0", UUID: "GPU-0", GPUUUID: "GPU-0", MemoryBytes: 80 << 30, Multiprocessors: 132}
	share := gpu
	share.MemoryBytes = 20 << 30
	share.Share = &prepared.Share{ID: "s1", MemoryBytes: 20 << 30, GPUMultiprocessors: 132}
	admin := gpu
	admin.Device, admin.AdminAccess = "gpu-1", true
	tests := []struct {
		name        string
		sharing     *gpuapi.Sharing
		devices     []prepared.Device
		wantStatus  metav1.ConditionStatus
		wantReason  string
		wantMessage string
		wantEntries int
	}{
		{name: "time slicing: the slice is enforced by the driver", sharing: &gpuapi.Sharing{Strategy: gpuapi.TimeSlicing,
			TimeSlicing: &gpuapi.TimeSlicingConfig{Interval: gpuapi.LongTimeSlice}}, devices: []prepared.Device{gpu},
			wantStatus: metav1.ConditionTrue, wantReason: "Enforced", wantMessage: "enforced: timeSlice", wantEntries: 1},
		{name: "ipc only: no limit asked for", sharing: &gpuapi.Sharing{Strategy: gpuapi.Exclusive, IPC: true}, devices: []prepared.Device{gpu},
			wantStatus: metav1.ConditionTrue, wantReason: "NoLimitsRequested", wantEntries: 1},
		{name: "mps without limits", sharing: &gpuapi.Sharing{Strategy: gpuapi.MPS, MPS: &gpuapi.MPSConfig{}}, devices: []prepared.Device{gpu},
			wantStatus: metav1.ConditionTrue, wantReason: "NoLimitsRequested", wantEntries: 1},
		{name: "mps with both limits", sharing: &gpuapi.Sharing{Strategy: gpuapi.MPS, MPS: &gpuapi.MPSConfig{ActiveThreadPercentage: &pct, PinnedMemoryLimit: &limit}},
			devices: []prepared.Device{gpu}, wantStatus: metav1.ConditionFalse, wantReason: "NotEnforced:pinnedMemoryLimit,activeThreadPercentage",
			wantMessage: "not enforced against the client: pinnedMemoryLimit, activeThreadPercentage", wantEntries: 1},
		{name: "mps thread percentage only", sharing: &gpuapi.Sharing{Strategy: gpuapi.MPS, MPS: &gpuapi.MPSConfig{ActiveThreadPercentage: &pct}},
			devices: []prepared.Device{gpu}, wantStatus: metav1.ConditionFalse, wantReason: "NotEnforced:activeThreadPercentage", wantEntries: 1},
		{name: "a share is capped at its memory, not enforced", sharing: &gpuapi.Sharing{Strategy: gpuapi.MPS}, devices: []prepared.Device{share},
			wantStatus: metav1.ConditionFalse, wantReason: "NotEnforced:pinnedMemoryLimit", wantEntries: 1},
		{name: "admin access gets no entry", sharing: &gpuapi.Sharing{Strategy: gpuapi.Exclusive, IPC: true}, devices: []prepared.Device{gpu, admin},
			wantStatus: metav1.ConditionTrue, wantReason: "NoLimitsRequested", wantEntries: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "c", Namespace: "ns", UID: "uid-c", Generation: 1}}
			client := fake.NewClientset(claim)
			rec := prepared.Claim{UID: "uid-c", Namespace: "ns", Name: "c", Devices: tt.devices, Sharing: tt.sharing}
			require.NoError(t, writeDeviceStatus(ctx, client, "gpu.gpudra.dev/node", claim, rec))
			got, err := client.ResourceV1().ResourceClaims("ns").Get(ctx, "c", metav1.GetOptions{})
			require.NoError(t, err)
			require.Len(t, got.Status.Devices, tt.wantEntries)
			cond := meta.FindStatusCondition(got.Status.Devices[0].Conditions, conditionSharingEnforced)
			require.NotNil(t, cond)
			assert.Equal(t, tt.wantStatus, cond.Status)
			assert.Equal(t, tt.wantReason, cond.Reason)
			assert.Contains(t, cond.Message, tt.wantMessage)
			// What the API server requires of a condition.
			assert.Empty(t, metav1validation.ValidateConditions([]metav1.Condition{*cond}, field.NewPath("conditions")))
		})
	}
}

// BenchmarkDeviceStatusUpToDate is the device-status step of a repeat
// prepare of a shared claim whose status is already written: decoded and
// compared, no API call.
func BenchmarkDeviceStatusUpToDate(b *testing.B) {
	ctx := context.Background()
	claim, client, rec := timeSlicedClaim()
	if err := writeDeviceStatus(ctx, client, "gpu.gpudra.dev/node", claim, rec); err != nil {
		b.Fatal(err)
	}
	written, err := client.ResourceV1().ResourceClaims("ns").Get(ctx, "ts", metav1.GetOptions{})
	if err != nil {
		b.Fatal(err)
	}
	before := len(client.Actions())
	b.ReportAllocs()
	for b.Loop() {
		if err := writeDeviceStatus(ctx, client, "gpu.gpudra.dev/node", written, rec); err != nil {
			b.Fatal(err)
		}
	}
	if n := len(client.Actions()) - before; n != 0 {
		b.Fatalf("%d API calls for an up-to-date status", n)
	}
}
