package gang

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/gpudra/gpudra/pkg/allocator"
)

// partitionedGPU is pool n0 as the plugin publishes a MIG-capable H100 (cut
// down to one counter): the whole GPU consumes all 8 memory slices of
// counter set gpu-0, each of two 4g placements half of them.
func partitionedGPU() []*resourceapi.ResourceSlice {
	q := func(n int64) resourceapi.Counter {
		return resourceapi.Counter{Value: *resource.NewQuantity(n, resource.DecimalSI)}
	}
	uses := func(n int64) []resourceapi.DeviceCounterConsumption {
		return []resourceapi.DeviceCounterConsumption{{CounterSet: "gpu-0", Counters: map[string]resourceapi.Counter{"memorySlices": q(n)}}}
	}
	pool := resourceapi.ResourcePool{Name: "n0", ResourceSliceCount: 2}
	return []*resourceapi.ResourceSlice{
		{ObjectMeta: metav1.ObjectMeta{Name: "counters"}, Spec: resourceapi.ResourceSliceSpec{Driver: allocator.DriverName, Pool: pool,
			SharedCounters: []resourceapi.CounterSet{{Name: "gpu-0", Counters: map[string]resourceapi.Counter{"memorySlices": q(8)}}}}},
		{ObjectMeta: metav1.ObjectMeta{Name: "devices"}, Spec: resourceapi.ResourceSliceSpec{Driver: allocator.DriverName, Pool: pool,
			Devices: []resourceapi.Device{{Name: "gpu-0", ConsumesCounters: uses(8)}, {Name: "mig-0", ConsumesCounters: uses(4)},
				{Name: "mig-1", ConsumesCounters: uses(4)}, {Name: "gpu-1"}}}},
	}
}

func ref(device string) deviceRef { return deviceRef{allocator.DriverName, "n0", device} }

func TestCounterIndex(t *testing.T) {
	x := newCounterIndex(partitionedGPU())
	assert.Equal(t, []deviceRef{ref("gpu-0"), ref("mig-1")}, x.siblings([]deviceRef{ref("mig-0")}))
	assert.Equal(t, []deviceRef{ref("mig-0"), ref("mig-1")}, x.siblings([]deviceRef{ref("gpu-0")}))
	assert.Empty(t, x.siblings([]deviceRef{ref("gpu-1")}), "a device without counters shares nothing")
	assert.Empty(t, x.overdrawn([]deviceRef{ref("mig-0"), ref("mig-1")}), "two halves fit")
	assert.Equal(t, "counter memorySlices of n0/gpu-0 (12 used of 8)", x.overdrawn([]deviceRef{ref("gpu-0"), ref("mig-0")}))
}

// TestCommitCountsSharedCounters: the scheduler gave out a MIG placement of
// the GPU the controller planned whole. No device name collides; the
// counters do: the commit refuses (planned again) and writes nothing.
// Planning the other placement instead goes through, and its fence covers
// every device sharing the GPU's counters. Without the counters (nil) the
// first commit would have written a GPU that is half given away.
func TestCommitCountsSharedCounters(t *testing.T) {
	ctx := context.Background()
	client := fake.NewClientset(allocatedClaim("theirs", "mig-0"))
	cm := &committer{client: client}
	counters := newCounterIndex(partitionedGPU())
	newClaim := func() *resourceapi.ResourceClaim {
		return &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "r-0", Namespace: "ns"}}
	}
	err := cm.commit(ctx, planOf(newClaim(), "gpu-0"), sets.New("ns/r-0"), counters)
	assert.ErrorIs(t, err, ErrConflict)
	assert.ErrorContains(t, err, "overdraw counter memorySlices of n0/gpu-0 (12 used of 8)")
	_, gerr := client.ResourceV1().ResourceClaims("ns").Get(ctx, "r-0", metav1.GetOptions{})
	assert.Error(t, gerr, "nothing written")

	require.NoError(t, cm.commit(ctx, planOf(newClaim(), "mig-1"), sets.New("ns/r-0"), counters))
	rules, err := client.ResourceV1().DeviceTaintRules().List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	require.Len(t, rules.Items, 1, "three devices of one pool: one fence for the pool")
	assert.Nil(t, rules.Items[0].Spec.DeviceSelector.Device)
	assert.Equal(t, "n0", *rules.Items[0].Spec.DeviceSelector.Pool)
	fenced := sets.New[string]()
	for _, r := range fencesFor(append([]deviceRef{ref("mig-1")}, counters.siblings([]deviceRef{ref("mig-1")})...)) {
		fenced.Insert(fenceSubject(r))
	}
	assert.Equal(t, sets.New("pool n0"), fenced, "the planned placement and every device sharing its counters")
}

func TestFencesFor(t *testing.T) {
	names := func(rules []*resourceapi.DeviceTaintRule) []string {
		var out []string
		for _, r := range rules {
			out = append(out, fenceSubject(r))
		}
		return out
	}
	other := deviceRef{allocator.DriverName, "n1", "gpu-0"}
	assert.Equal(t, []string{"device n0/gpu-0", "device n0/gpu-1", "device n1/gpu-0"}, names(fencesFor([]deviceRef{ref("gpu-0"), ref("gpu-1"), other})))
	assert.Equal(t, []string{"pool n0", "device n1/gpu-0"}, names(fencesFor([]deviceRef{ref("gpu-0"), ref("gpu-1"), ref("gpu-2"), other})))
}

// TestFindDoubleAllocationsByCounters: a whole GPU and a MIG placement of
// it in two claims share no device name; the counters say they collide.
// Only collisions that involve a claim worth a look (this controller's) are
// listed.
func TestFindDoubleAllocationsByCounters(t *testing.T) {
	counters := newCounterIndex(partitionedGPU())
	theirs, ours := allocatedClaim("theirs", "mig-0"), allocatedClaim("ours", "gpu-0")
	isOurs := func(cl *resourceapi.ResourceClaim) bool { return cl.Name == "ours" }
	got := findDoubleAllocations([]*resourceapi.ResourceClaim{theirs, ours}, counters, isOurs)
	require.Len(t, got, 1)
	assert.Equal(t, "counter memorySlices of n0/gpu-0 (12 used of 8)", got[0].what)
	assert.Len(t, got[0].claims, 2)
	assert.Empty(t, findDoubleAllocations([]*resourceapi.ResourceClaim{theirs, ours}, counters, func(*resourceapi.ResourceClaim) bool { return false }),
		"the scheduler's own allocations are the scheduler's")
	assert.Empty(t, findDoubleAllocations([]*resourceapi.ResourceClaim{allocatedClaim("a", "mig-0"), allocatedClaim("b", "mig-1")}, counters, isOurs))
}
