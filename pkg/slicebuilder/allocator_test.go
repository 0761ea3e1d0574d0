package slicebuilder

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/utils/ptr"
)

// The DeviceClasses the chart installs.
var testClasses = []*resourceapi.DeviceClass{
	deviceClass("gpu.gpudra.dev", `device.driver == "gpu.gpudra.dev" && device.attributes["gpu.gpudra.dev"].type == "gpu"`),
	deviceClass("mig.gpudra.dev", `device.driver == "gpu.gpudra.dev" && device.attributes["gpu.gpudra.dev"].type == "mig"`),
}

func deviceClass(name, expr string) *resourceapi.DeviceClass {
	return &resourceapi.DeviceClass{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       resourceapi.DeviceClassSpec{Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: expr}}}},
	}
}

type classLister []*resourceapi.DeviceClass

func (l classLister) List() ([]*resourceapi.DeviceClass, error) { return l, nil }
func (l classLister) Get(name string) (*resourceapi.DeviceClass, error) {
	for _, c := range l {
		if c.Name == name {
			return c, nil
		}
	}
	return nil, apierrors.NewNotFound(resourceapi.Resource("deviceclasses"), name)
}

// cluster allocates claims one after another with the scheduler's own
// allocator, feeding what it allocated back as the allocated state, as the
// scheduler does between pods.
type cluster struct {
	t         *testing.T
	node      *v1.Node
	slices    []*resourceapi.ResourceSlice
	allocated sets.Set[structured.DeviceID]
	cache     *cel.Cache
	n         int
}

func newCluster(t *testing.T, machineName string) *cluster {
	_, inv := machine(t, machineName, "node-a")
	c := &cluster{
		t:         t,
		node:      &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a"}},
		allocated: sets.New[structured.DeviceID](),
		cache:     cel.NewCache(100, cel.Features{}),
	}
	for _, s := range build(t, inv, "node-a", Options{}) {
		c.slices = append(c.slices, s.DeepCopy())
	}
	return c
}

type req struct {
	class    string
	profile  string // CEL on migProfile when set
	count    int64
	sameLink bool // matchAttribute on nvlinkDomain
}

// allocate tries one claim; it returns the devices, or nil if it cannot fit.
func (c *cluster) allocate(r req) []string {
	c.t.Helper()
	c.n++
	er := &resourceapi.ExactDeviceRequest{DeviceClassName: r.class, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: max(r.count, 1)}
	if r.profile != "" {
		er.Selectors = []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
			Expression: fmt.Sprintf(`device.attributes["gpu.gpudra.dev"].migProfile == %q`, r.profile)}}}
	}
	claim := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("claim-%d", c.n), Namespace: "default", UID: types.UID(fmt.Sprintf("uid-%d", c.n))},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: er}},
		}},
	}
	if r.sameLink {
		claim.Spec.Devices.Constraints = []resourceapi.DeviceConstraint{{MatchAttribute: ptr.To(resourceapi.FullyQualifiedName("gpu.gpudra.dev/nvlinkDomain"))}}
	}
	features := structured.Features{PartitionableDevices: true, PrioritizedList: true, DeviceTaints: true}
	alloc, err := structured.NewAllocator(context.Background(), features,
		structured.AllocatedState{AllocatedDevices: c.allocated, AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](), AggregatedCapacity: structured.NewConsumedCapacityCollection()},
		classLister(testClasses), c.slices, c.cache)
	require.NoError(c.t, err)
	results, err := alloc.Allocate(context.Background(), c.node, []*resourceapi.ResourceClaim{claim})
	require.NoError(c.t, err)
	if len(results) == 0 {
		return nil
	}
	var names []string
	for _, d := range results[0].Devices.Results {
		c.allocated.Insert(structured.MakeDeviceID(d.Driver, d.Pool, d.Device))
		names = append(names, d.Device)
	}
	return names
}

func TestAllocatorSevenMigSlicesFitAnEighthDoesNot(t *testing.T) {
	c := newCluster(t, oneGPUMig)
	seen := map[string]bool{}
	for i := 0; i < 7; i++ {
		got := c.allocate(req{class: "mig.gpudra.dev", profile: "1g.10gb"})
		require.Len(t, got, 1, "1g.10gb number %d must fit", i+1)
		assert.False(t, seen[got[0]])
		seen[got[0]] = true
	}
	assert.Nil(t, c.allocate(req{class: "mig.gpudra.dev", profile: "1g.10gb"}), "an 8th 1g.10gb does not fit")
	assert.Nil(t, c.allocate(req{class: "gpu.gpudra.dev"}), "nor does the full GPU")
}

func TestAllocatorFullGPUExcludesMig(t *testing.T) {
	c := newCluster(t, oneGPUMig)
	require.Equal(t, []string{"gpu-0"}, c.allocate(req{class: "gpu.gpudra.dev"}))
	for _, p := range []string{"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"} {
		assert.Nil(t, c.allocate(req{class: "mig.gpudra.dev", profile: p}), "%s beside an allocated full GPU", p)
	}

	c = newCluster(t, oneGPUMig)
	require.NotNil(t, c.allocate(req{class: "mig.gpudra.dev", profile: "1g.10gb"}))
	assert.Nil(t, c.allocate(req{class: "gpu.gpudra.dev"}), "the full GPU beside a MIG device")
}

func TestAllocatorHardwareRules(t *testing.T) {
	tests := []struct {
		name string
		reqs []string // profiles in order
		fits []bool
	}{
		{"one +me only", []string{"1g.10gb+me", "1g.10gb+me"}, []bool{true, false}},
		{"+me beside six 1g.10gb", []string{"1g.10gb+me", "1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb"}, []bool{true, true, true, true, true, true, true, false}},
		{"4g + 3g", []string{"4g.40gb", "3g.40gb", "3g.40gb"}, []bool{true, true, false}},
		{"two 3g", []string{"3g.40gb", "3g.40gb", "1g.10gb"}, []bool{true, true, false}},
		{"four 1g.20gb", []string{"1g.20gb", "1g.20gb", "1g.20gb", "1g.20gb", "1g.20gb"}, []bool{true, true, true, true, false}},
		{"7g alone", []string{"7g.80gb", "1g.10gb"}, []bool{true, false}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, oneGPUMig)
			for i, p := range tc.reqs {
				got := c.allocate(req{class: "mig.gpudra.dev", profile: p})
				assert.Equal(t, tc.fits[i], got != nil, "request %d (%s)", i+1, p)
			}
		})
	}
}

func TestAllocatorNVLinkDomain(t *testing.T) {
	c := newCluster(t, "dgx-h100")
	got := c.allocate(req{class: "gpu.gpudra.dev", count: 2, sameLink: true})
	assert.Len(t, got, 2, "two GPUs on one NVLink domain")

	pcie := newCluster(t, "h100-pcie")
	assert.Nil(t, pcie.allocate(req{class: "gpu.gpudra.dev", count: 2, sameLink: true}), "PCIe GPUs have no NVLink domain to match")
	assert.Len(t, pcie.allocate(req{class: "gpu.gpudra.dev", count: 2}), 2, "without the constraint they fit")
}

func TestAllocatorPacksMigOntoLowGPUs(t *testing.T) {
	c := newCluster(t, "dgx-h100")
	for i := 0; i < 7; i++ {
		got := c.allocate(req{class: "mig.gpudra.dev", profile: "1g.10gb"})
		require.Len(t, got, 1)
		assert.Regexp(t, `^gpu-0-`, got[0], "first-fit fills GPU 0 before touching GPU 1")
	}
	assert.Regexp(t, `^gpu-1-`, c.allocate(req{class: "mig.gpudra.dev", profile: "1g.10gb"})[0])
}
