package plugin

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
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
