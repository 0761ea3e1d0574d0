package nodehold

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// claim is claim namespace/name with one allocation result per
// "driver/pool/device" (nil: not allocated).
func claim(ns, name string, results ...[3]string) *resourceapi.ResourceClaim {
	cl := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
	if results == nil {
		return cl
	}
	cl.Status.Allocation = &resourceapi.AllocationResult{}
	for _, r := range results {
		cl.Status.Allocation.Devices.Results = append(cl.Status.Allocation.Devices.Results,
			resourceapi.DeviceRequestAllocationResult{Request: "gpu", Driver: r[0], Pool: r[1], Device: r[2]})
	}
	return cl
}

func gpu(node, device string) [3]string { return [3]string{"gpu.gpudra.dev", node, device} }

func TestNodesHeld(t *testing.T) {
	deleting := claim("a", "leaving", gpu("n1", "gpu-0"))
	deleting.DeletionTimestamp = &metav1.Time{Time: time.Unix(1, 0)}
	for name, tc := range map[string]struct {
		allocated, planned []*resourceapi.ResourceClaim
		want               map[string]*Hold
	}{
		"nothing": {want: map[string]*Hold{}},
		"a claim not allocated holds nothing": {
			allocated: []*resourceapi.ResourceClaim{claim("a", "pending")},
			want:      map[string]*Hold{},
		},
		"a prepared claim, or a held reservation's (allocated, no pod), holds its node": {
			allocated: []*resourceapi.ResourceClaim{claim("a", "job", gpu("n1", "gpu-0")), claim("a", "reservation-0", gpu("n2", "gpu-3"))},
			want:      map[string]*Hold{"n1": {Allocated: []string{"a/job"}}, "n2": {Allocated: []string{"a/reservation-0"}}},
		},
		"another driver's claim holds nothing": {
			allocated: []*resourceapi.ResourceClaim{claim("a", "nic", [3]string{"nic.example.com", "n1", "eth0"})},
			want:      map[string]*Hold{},
		},
		"only the gpudra results of a claim with several drivers count": {
			allocated: []*resourceapi.ResourceClaim{claim("a", "mixed", [3]string{"nic.example.com", "n9", "eth0"}, gpu("n1", "gpu-0"))},
			want:      map[string]*Hold{"n1": {Allocated: []string{"a/mixed"}}},
		},
		"a claim's devices on one node name it once": {
			allocated: []*resourceapi.ResourceClaim{claim("a", "eight", gpu("n1", "gpu-0"), gpu("n1", "gpu-1"))},
			want:      map[string]*Hold{"n1": {Allocated: []string{"a/eight"}}},
		},
		"a claim whose pod is being evicted (claim deleting, still allocated) holds its node": {
			allocated: []*resourceapi.ResourceClaim{deleting},
			want:      map[string]*Hold{"n1": {Allocated: []string{"a/leaving"}}},
		},
		"claims of one node, sorted": {
			allocated: []*resourceapi.ResourceClaim{claim("b", "y", gpu("n1", "gpu-1")), claim("a", "x", gpu("n1", "gpu-0"))},
			want:      map[string]*Hold{"n1": {Allocated: []string{"a/x", "b/y"}}},
		},
		"a gang being admitted holds its planned nodes": {
			planned: []*resourceapi.ResourceClaim{claim("g", "w-0", gpu("n3", "gpu-0")), claim("g", "w-1", gpu("n4", "gpu-0"))},
			want:    map[string]*Hold{"n3": {Planned: []string{"g/w-0"}}, "n4": {Planned: []string{"g/w-1"}}},
		},
		"a planned claim kube-scheduler allocated counts where it was allocated": {
			allocated: []*resourceapi.ResourceClaim{claim("g", "w-0", gpu("n1", "gpu-0"))},
			planned:   []*resourceapi.ResourceClaim{claim("g", "w-0", gpu("n3", "gpu-0"))},
			want:      map[string]*Hold{"n1": {Allocated: []string{"g/w-0"}}},
		},
	} {
		t.Run(name, func(t *testing.T) {
			assert.Equal(t, tc.want, NodesHeld(tc.allocated, tc.planned))
		})
	}
}

func TestHoldReason(t *testing.T) {
	for name, tc := range map[string]struct {
		hold Hold
		want string
	}{
		"one claim": {Hold{Allocated: []string{"a/x"}}, "1 gpu.gpudra.dev claim allocated: a/x"},
		"the first three named": {Hold{Allocated: []string{"a/1", "a/2", "a/3", "a/4", "a/5"}},
			"5 gpu.gpudra.dev claims allocated: a/1, a/2, a/3, and 2 more"},
		"allocated and planned": {Hold{Allocated: []string{"a/x"}, Planned: []string{"g/w-0", "g/w-1"}},
			"1 gpu.gpudra.dev claim allocated: a/x; 2 claims planned for a gang being admitted: g/w-0, g/w-1"},
	} {
		t.Run(name, func(t *testing.T) { assert.Equal(t, tc.want, tc.hold.Reason()) })
	}
}

func TestSlimClaim(t *testing.T) {
	cl := claim("a", "mixed", gpu("n1", "gpu-0"), gpu("n1", "gpu-1"), [3]string{"nic.example.com", "n9", "eth0"}, gpu("n2", "gpu-0"))
	cl.Spec.Devices.Requests = []resourceapi.DeviceRequest{{Name: "gpu"}}
	cl.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: "p"}}
	obj, err := slimClaim(cl)
	assert.NoError(t, err)
	slim := obj.(*resourceapi.ResourceClaim)
	assert.Equal(t, &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "a", Name: "mixed"},
		Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{
			Results: []resourceapi.DeviceRequestAllocationResult{{Driver: "gpu.gpudra.dev", Pool: "n1"}, {Driver: "gpu.gpudra.dev", Pool: "n2"}}}}}}, slim)
	assert.Equal(t, ClaimNodes(cl), ClaimNodes(slim), "the same nodes")
}
