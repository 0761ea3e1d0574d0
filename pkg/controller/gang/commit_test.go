package gang

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/dynamic-resource-allocation/cel"

	"github.com/gpudra/gpudra/pkg/allocator"
)

func planOf(claim *resourceapi.ResourceClaim, devices ...string) allocator.Result {
	res := resourceapi.AllocationResult{}
	for _, d := range devices {
		res.Devices.Results = append(res.Devices.Results, resourceapi.DeviceRequestAllocationResult{
			Request: "gpu", Driver: allocator.DriverName, Pool: "n0", Device: d})
	}
	return allocator.Result{Allocations: []allocator.ClaimAllocation{{Claim: claim, Node: "n0", Result: res}}}
}

func allocatedClaim(name string, devices ...string) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", UID: types.UID("uid-" + name)}}
	c.Status.Allocation = &planOf(c, devices...).Allocations[0].Result
	return c
}

func TestCommit(t *testing.T) {
	ctx := context.Background()
	newClaim := func() *resourceapi.ResourceClaim {
		return &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "r-0", Namespace: "ns"}}
	}
	tests := []struct {
		name     string
		existing []*resourceapi.ResourceClaim
		devices  []string
		conflict bool
	}{
		{name: "free devices are written", devices: []string{"gpu-0", "gpu-1"}},
		{name: "a device someone took meanwhile is not", existing: []*resourceapi.ResourceClaim{allocatedClaim("other", "gpu-1")},
			devices: []string{"gpu-0", "gpu-1"}, conflict: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			client := fake.NewClientset()
			for _, c := range tt.existing {
				_, err := client.ResourceV1().ResourceClaims(c.Namespace).Create(ctx, c, metav1.CreateOptions{})
				require.NoError(t, err)
			}
			cm := &committer{client: client}
			err := cm.commit(ctx, planOf(newClaim(), tt.devices...), sets.New("ns/r-0"), nil)
			rules, lerr := client.ResourceV1().DeviceTaintRules().List(ctx, metav1.ListOptions{})
			require.NoError(t, lerr)
			if tt.conflict {
				assert.Empty(t, rules.Items, "the fence is lifted at once when nothing was written")
			} else {
				assert.Len(t, rules.Items, len(tt.devices), "kept until the informer shows the writes")
				cm.liftKept(ctx, func(string) bool { return false })
				rules, _ = client.ResourceV1().DeviceTaintRules().List(ctx, metav1.ListOptions{})
				assert.Len(t, rules.Items, len(tt.devices), "the informer has not shown the claim yet")
				cm.liftKept(ctx, func(key string) bool { return key == "ns/r-0" })
				rules, _ = client.ResourceV1().DeviceTaintRules().List(ctx, metav1.ListOptions{})
				assert.Empty(t, rules.Items, "lifted once the informer shows the claim allocated")
			}
			got, gerr := client.ResourceV1().ResourceClaims("ns").Get(ctx, "r-0", metav1.GetOptions{})
			if tt.conflict {
				assert.ErrorIs(t, err, ErrConflict)
				assert.ErrorContains(t, err, "gpu-1 is now in claim ns/other")
				assert.Error(t, gerr, "nothing written")
				return
			}
			require.NoError(t, err)
			require.NoError(t, gerr)
			require.NotNil(t, got.Status.Allocation)
			assert.Len(t, got.Status.Allocation.Devices.Results, 2)
			assert.Contains(t, got.Finalizers, resourceapi.Finalizer, "the claim controller deallocates it when its last user goes")
		})
	}
}

func TestCommitFenceCollision(t *testing.T) {
	ctx := context.Background()
	client := fake.NewClientset()
	d := deviceRef{allocator.DriverName, "n0", "gpu-0"}
	_, err := client.ResourceV1().DeviceTaintRules().Create(ctx, &resourceapi.DeviceTaintRule{ObjectMeta: metav1.ObjectMeta{Name: fenceName(d)}}, metav1.CreateOptions{})
	require.NoError(t, err)
	cm := &committer{client: client}
	err = cm.commit(ctx, planOf(&resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "r-0", Namespace: "ns"}}, "gpu-0"), sets.New("ns/r-0"), nil)
	assert.ErrorIs(t, err, ErrConflict, "a device fenced by another round is not taken")
	rules, _ := client.ResourceV1().DeviceTaintRules().List(ctx, metav1.ListOptions{})
	assert.Len(t, rules.Items, 1, "the other round's fence stays")
}

func TestCountByClass(t *testing.T) {
	gpu := func(name string) resourceapi.Device {
		return resourceapi.Device{Name: name, Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			"type": {StringValue: ptrTo("gpu")}}}
	}
	slice := &resourceapi.ResourceSlice{Spec: resourceapi.ResourceSliceSpec{Driver: allocator.DriverName, Pool: resourceapi.ResourcePool{Name: "n0"},
		Devices: []resourceapi.Device{gpu("gpu-0"), gpu("gpu-1"), gpu("gpu-2"), {Name: "nic-0"}}}}
	class := &resourceapi.DeviceClass{ObjectMeta: metav1.ObjectMeta{Name: "gpu.gpudra.dev"}, Spec: resourceapi.DeviceClassSpec{
		Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: `device.attributes["gpu.gpudra.dev"].type == "gpu"`}}}}}
	held := allocatedClaim("held", "gpu-0")
	used := allocatedClaim("used", "gpu-1")
	got := countByClass(context.Background(), cel.NewCache(10, cel.Features{}), []*resourceapi.DeviceClass{class},
		[]*resourceapi.ResourceSlice{slice}, []*resourceapi.ResourceClaim{held, used}, sets.New("ns/held"), nil)
	assert.Equal(t, classCount{free: 1, held: 1, allocated: 1}, got["gpu.gpudra.dev"])
}

func ptrTo[T any](v T) *T { return &v }

// TestCountByClassRemembersMatches: a second count over unchanged slices
// and classes evaluates no CEL and gives the same counts; a slice at a new
// version is evaluated again, and its old entries are forgotten.
func TestCountByClassRemembersMatches(t *testing.T) {
	gpu := func(name string) resourceapi.Device {
		return resourceapi.Device{Name: name, Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"type": {StringValue: ptrTo("gpu")}}}
	}
	slice := &resourceapi.ResourceSlice{ObjectMeta: metav1.ObjectMeta{UID: "s", ResourceVersion: "1"},
		Spec: resourceapi.ResourceSliceSpec{Driver: allocator.DriverName, Pool: resourceapi.ResourcePool{Name: "n0"}, Devices: []resourceapi.Device{gpu("gpu-0"), gpu("gpu-1")}}}
	class := &resourceapi.DeviceClass{ObjectMeta: metav1.ObjectMeta{Name: "gpu.gpudra.dev", UID: "c", ResourceVersion: "1"}, Spec: resourceapi.DeviceClassSpec{
		Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: `device.attributes["gpu.gpudra.dev"].type == "gpu"`}}}}}
	known := newClassMatches()
	evals := 0
	known.eval = func(ctx context.Context, cache *cel.Cache, class *resourceapi.DeviceClass, driver string, d resourceapi.Device) bool {
		evals++
		return matches(ctx, cache, class, driver, d)
	}
	count := func() classCount {
		return countByClass(context.Background(), cel.NewCache(10, cel.Features{}), []*resourceapi.DeviceClass{class},
			[]*resourceapi.ResourceSlice{slice}, []*resourceapi.ResourceClaim{allocatedClaim("used", "gpu-1")}, sets.New[string](), known)["gpu.gpudra.dev"]
	}
	want := classCount{free: 1, allocated: 1}
	assert.Equal(t, want, count())
	assert.Equal(t, 2, evals)
	assert.Equal(t, want, count())
	assert.Equal(t, 2, evals, "nothing changed: no CEL evaluated")
	slice.ResourceVersion = "2"
	assert.Equal(t, want, count())
	assert.Equal(t, 4, evals, "the slice changed: evaluated again")
	assert.Len(t, known.m, 2, "the old version's entries are forgotten")
}
