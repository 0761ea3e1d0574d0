package slicebuilder

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/uuid"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/utils/ptr"
)

// The DeviceClasses the chart installs.
var testClasses = classLister{
	deviceClass("gpu.gpudra.dev", `device.driver == "gpu.gpudra.dev" && device.attributes["gpu.gpudra.dev"].type == "gpu"`),
	deviceClass("mig.gpudra.dev", `device.driver == "gpu.gpudra.dev" && device.attributes["gpu.gpudra.dev"].type == "mig"`),
}

func deviceClass(name, expr string) *resourceapi.DeviceClass {
	return &resourceapi.DeviceClass{
		ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID(name), ResourceVersion: "1"},
		Spec:       resourceapi.DeviceClassSpec{Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: expr}}}},
	}
}

// classLister is a structured.DeviceClassLister over a fixed list.
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

// allocatorFeatures are the DRA features a 1.37 scheduler runs with by
// default: GA (admin access, device taints, prioritized list, binding
// conditions and device status) and beta (partitionable devices, consumable
// capacity).
var allocatorFeatures = structured.Features{
	AdminAccess:            true,
	ConsumableCapacity:     true,
	DeviceBindingAndStatus: true,
	DeviceTaints:           true,
	PartitionableDevices:   true,
	PrioritizedList:        true,
}

// cluster is one node's published slices plus what has been allocated on
// them so far, as the scheduler tracks it between pods.
type cluster struct {
	node   *v1.Node
	slices []*resourceapi.ResourceSlice
	// allocated is the scheduler's AllocatedState.AllocatedDevices. The
	// allocator derives the counters already consumed from it and the
	// slices (see checkAvailableCounters in structured/internal/incubating),
	// so feeding back the allocated devices is all it needs.
	allocated sets.Set[structured.DeviceID]
	cache     *cel.Cache
	claims    int
}

func newCluster(t *testing.T, machineName string, opts Options) *cluster {
	t.Helper()
	_, inv := machine(t, machineName, "node-a")
	c := &cluster{
		node:      &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a"}},
		allocated: sets.New[structured.DeviceID](),
		cache:     cel.NewCache(100, cel.Features{}),
	}
	for _, s := range build(t, inv, "node-a", opts) {
		s := s.DeepCopy()
		// An identity of its own, as the API server gives every slice:
		// what an allocator that keeps results across pods keys them by
		// (bench/upstream; hack/patched-bench-scale.sh runs these tests
		// against it).
		s.UID = uuid.NewUUID()
		s.Generation = 1
		c.slices = append(c.slices, s)
	}
	return c
}

// device returns a published device by name.
func (c *cluster) device(name string) (resourceapi.Device, bool) {
	for _, s := range c.slices {
		for _, d := range s.Spec.Devices {
			if d.Name == name {
				return d, true
			}
		}
	}
	return resourceapi.Device{}, false
}

// ask is one request of a claim.
type ask struct {
	class   string
	profile string // a CEL selector on migProfile when set
	product string // a CEL selector on productName when set
	count   int64  // 1 when zero
	// sameNVLink adds a matchAttribute constraint on nvlinkDomain.
	sameNVLink bool
}

func gpuAsk() ask               { return ask{class: "gpu.gpudra.dev"} }
func migAsk(profile string) ask { return ask{class: "mig.gpudra.dev", profile: profile} }

// claim turns an ask into a resource.k8s.io/v1 ResourceClaim.
func (c *cluster) claim(a ask) *resourceapi.ResourceClaim {
	c.claims++
	req := &resourceapi.ExactDeviceRequest{
		DeviceClassName: a.class,
		AllocationMode:  resourceapi.DeviceAllocationModeExactCount,
		Count:           max(a.count, 1),
	}
	if a.profile != "" {
		req.Selectors = append(req.Selectors, resourceapi.DeviceSelector{CEL: &resourceapi.CELDeviceSelector{
			Expression: fmt.Sprintf(`device.attributes["gpu.gpudra.dev"].migProfile == %q`, a.profile),
		}})
	}
	if a.product != "" {
		req.Selectors = append(req.Selectors, resourceapi.DeviceSelector{CEL: &resourceapi.CELDeviceSelector{
			Expression: fmt.Sprintf(`device.attributes["gpu.gpudra.dev"].productName == %q`, a.product),
		}})
	}
	claim := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{
			Name: fmt.Sprintf("claim-%d", c.claims), Namespace: "default", UID: types.UID(fmt.Sprintf("uid-%d", c.claims)),
		},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: req}},
		}},
	}
	if a.sameNVLink {
		claim.Spec.Devices.Constraints = []resourceapi.DeviceConstraint{{
			MatchAttribute: ptr.To(resourceapi.FullyQualifiedName("gpu.gpudra.dev/nvlinkDomain")),
		}}
	}
	return claim
}

// allocate runs the scheduler's allocator for one claim against what is
// allocated so far. It returns the allocated device names, or nil when the
// claim does not fit; what it allocates stays allocated for later claims.
func (c *cluster) allocate(t *testing.T, a ask) []string {
	t.Helper()
	ctx := context.Background()
	state := structured.AllocatedState{
		AllocatedDevices:         c.allocated.Clone(),
		AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](),
		AggregatedCapacity:       structured.NewConsumedCapacityCollection(),
	}
	alloc, err := structured.NewAllocator(ctx, allocatorFeatures, state, testClasses, c.slices, c.cache)
	require.NoError(t, err)
	results, err := alloc.Allocate(ctx, c.node, []*resourceapi.ResourceClaim{c.claim(a)})
	require.NoError(t, err)
	if results == nil {
		return nil
	}
	require.Len(t, results, 1)
	var names []string
	for _, r := range results[0].Devices.Results {
		require.Equal(t, DriverName, r.Driver)
		require.Equal(t, "node-a", r.Pool)
		id := structured.MakeDeviceID(r.Driver, r.Pool, r.Device)
		require.False(t, c.allocated.Has(id), "%s handed out twice", r.Device)
		c.allocated.Insert(id)
		names = append(names, r.Device)
	}
	return names
}

// step is one claim in a sequence and whether it must fit.
type step struct {
	ask  ask
	fits bool
}

func repeat(n int, s step) []step {
	out := make([]step, n)
	for i := range out {
		out[i] = s
	}
	return out
}

func seq(parts ...[]step) []step {
	var out []step
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

var allProfiles = []string{"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"}

// oneGPUSequence is a sequence of claims against one H100 in MIG mode.
type oneGPUSequence struct {
	name  string
	steps []step
}

// oneGPUSequences are the MIG rules the scheduler must enforce through the
// counters: overlapping placements, one OFA engine, a whole GPU excludes
// every MIG device and the other way round.
func oneGPUSequences() []oneGPUSequence {
	fit := func(a ask) []step { return []step{{a, true}} }
	nofit := func(a ask) []step { return []step{{a, false}} }
	tests := []oneGPUSequence{
		{"seven 1g.10gb fit, an eighth does not", seq(
			repeat(7, step{migAsk("1g.10gb"), true}),
			nofit(migAsk("1g.10gb")), nofit(migAsk("1g.10gb+me")), nofit(gpuAsk()))},
		{"seven 1g.10gb in one claim, then nothing", seq(
			fit(ask{class: "mig.gpudra.dev", profile: "1g.10gb", count: 7}), nofit(migAsk("1g.10gb")))},
		{"eight 1g.10gb in one claim do not fit", nofit(ask{class: "mig.gpudra.dev", profile: "1g.10gb", count: 8})},
		{"a full GPU excludes every MIG device", seq(fit(gpuAsk()),
			nofit(migAsk("1g.10gb")), nofit(migAsk("1g.10gb+me")), nofit(migAsk("1g.20gb")), nofit(migAsk("2g.20gb")),
			nofit(migAsk("3g.40gb")), nofit(migAsk("4g.40gb")), nofit(migAsk("7g.80gb")))},
		{"only one full GPU", seq(fit(gpuAsk()), nofit(gpuAsk()))},
		{"two 1g.10gb+me do not fit (one OFA engine)", seq(fit(migAsk("1g.10gb+me")), nofit(migAsk("1g.10gb+me")))},
		{"one 1g.10gb+me beside six 1g.10gb", seq(fit(migAsk("1g.10gb+me")),
			repeat(6, step{migAsk("1g.10gb"), true}), nofit(migAsk("1g.10gb")))},
		{"six 1g.10gb, then one 1g.10gb+me", seq(repeat(6, step{migAsk("1g.10gb"), true}),
			fit(migAsk("1g.10gb+me")), nofit(migAsk("1g.10gb+me")), nofit(migAsk("1g.10gb")))},
		{"4g.40gb and 3g.40gb fit together", seq(fit(migAsk("4g.40gb")), fit(migAsk("3g.40gb")))},
		{"4g.40gb and two 3g.40gb do not", seq(fit(migAsk("4g.40gb")), fit(migAsk("3g.40gb")), nofit(migAsk("3g.40gb")))},
		{"two 3g.40gb leave no room for a 4g.40gb", seq(fit(migAsk("3g.40gb")), fit(migAsk("3g.40gb")), nofit(migAsk("4g.40gb")), nofit(migAsk("1g.10gb")))},
		{"four 1g.20gb", seq(repeat(4, step{migAsk("1g.20gb"), true}), nofit(migAsk("1g.20gb")), nofit(migAsk("1g.10gb")))},
		{"three 2g.20gb and a 1g.10gb", seq(repeat(3, step{migAsk("2g.20gb"), true}), fit(migAsk("1g.10gb")), nofit(migAsk("1g.10gb")))},
		{"7g.80gb alone", seq(fit(migAsk("7g.80gb")), nofit(migAsk("1g.10gb")), nofit(gpuAsk()))},
	}
	// Any one MIG device keeps the full GPU from being allocated.
	for _, p := range allProfiles {
		tests = append(tests, oneGPUSequence{"a " + p + " excludes the full GPU", seq(fit(migAsk(p)), nofit(gpuAsk()))})
	}
	return tests
}

func TestAllocatorOneGPU(t *testing.T) {
	for _, tc := range oneGPUSequences() {
		t.Run(tc.name, func(t *testing.T) {
			runSequence(t, newCluster(t, oneGPUMig, Options{}), tc.steps)
		})
	}
}

// runSequence allocates the steps in order and checks which fit.
func runSequence(t *testing.T, c *cluster, steps []step) {
	t.Helper()
	for i, s := range steps {
		got := c.allocate(t, s.ask)
		what := fmt.Sprintf("claim %d (%s %s x%d)", i+1, s.ask.class, s.ask.profile, max(s.ask.count, 1))
		if !s.fits {
			assert.Nil(t, got, "%s must not fit", what)
			continue
		}
		if !assert.Len(t, got, int(max(s.ask.count, 1)), "%s must fit", what) {
			continue
		}
		for _, name := range got {
			d, ok := c.device(name)
			require.True(t, ok, name)
			if s.ask.profile != "" {
				assert.Equal(t, s.ask.profile, strAttr(d, "migProfile"), "%s got %s", what, name)
			} else {
				assert.Equal(t, TypeGPU, strAttr(d, "type"), "%s got %s", what, name)
			}
		}
	}
}

func TestAllocatorNVLink(t *testing.T) {
	tests := []struct {
		machine  string
		ask      ask
		wantFits bool
	}{
		{"dgx-h100-nomig", ask{class: "gpu.gpudra.dev", count: 2, sameNVLink: true}, true},
		{"dgx-h100-nomig", ask{class: "gpu.gpudra.dev", count: 8, sameNVLink: true}, true},
		{"dgx-h100-nomig", ask{class: "gpu.gpudra.dev", count: 9, sameNVLink: true}, false},
		// GPUs in MIG mode have no NVLink peer-to-peer: no domain to match.
		{"dgx-h100", ask{class: "gpu.gpudra.dev", count: 2, sameNVLink: true}, false},
		{"dgx-h100", ask{class: "gpu.gpudra.dev", count: 2}, true},
		{"h100-nvlink-fabric", ask{class: "gpu.gpudra.dev", count: 4, sameNVLink: true}, true},
		// PCIe GPUs have no NVLink domain to match.
		{"h100-pcie", ask{class: "gpu.gpudra.dev", count: 2, sameNVLink: true}, false},
		{"h100-pcie", ask{class: "gpu.gpudra.dev", count: 2}, true},
		// MIG devices have no NVLink either.
		{"dgx-h100", ask{class: "mig.gpudra.dev", profile: "1g.10gb", count: 2, sameNVLink: true}, false},
	}
	for _, tc := range tests {
		t.Run(fmt.Sprintf("%s %s x%d nvlink=%v", tc.machine, tc.ask.class, tc.ask.count, tc.ask.sameNVLink), func(t *testing.T) {
			c := newCluster(t, tc.machine, Options{})
			got := c.allocate(t, tc.ask)
			if !tc.wantFits {
				assert.Nil(t, got)
				return
			}
			require.Len(t, got, int(tc.ask.count))
			domains := sets.New[string]()
			for _, name := range got {
				d, ok := c.device(name)
				require.True(t, ok, name)
				assert.Equal(t, TypeGPU, strAttr(d, "type"), name)
				domains.Insert(strAttr(d, "nvlinkDomain"))
			}
			assert.Len(t, sets.New(got...), len(got), "distinct GPUs")
			if tc.ask.sameNVLink {
				assert.Equal(t, 1, domains.Len(), "one NVLink domain: %v", sets.List(domains))
				assert.NotContains(t, domains, "")
			}
		})
	}
}

func TestAllocatorPacksMigOntoLowGPUs(t *testing.T) {
	c := newCluster(t, "dgx-h100", Options{})
	for i := 0; i < 7; i++ {
		got := c.allocate(t, migAsk("1g.10gb"))
		require.Len(t, got, 1)
		assert.True(t, strings.HasPrefix(got[0], "gpu-0-"), "1g.10gb number %d: first-fit fills GPU 0 first, got %s", i+1, got[0])
	}
	got := c.allocate(t, migAsk("1g.10gb"))
	require.Len(t, got, 1)
	assert.True(t, strings.HasPrefix(got[0], "gpu-1-"), "the 8th goes to GPU 1, got %s", got[0])
	full := c.allocate(t, gpuAsk())
	require.Len(t, full, 1)
	assert.NotContains(t, []string{"gpu-0", "gpu-1"}, full[0], "GPUs 0 and 1 hold MIG devices")
}

func TestAllocatorHonoursTaints(t *testing.T) {
	noSchedule := resourceapi.DeviceTaint{Key: "gpu.gpudra.dev/unhealthy", Value: "xid-79", Effect: resourceapi.DeviceTaintEffectNoSchedule}
	tests := []struct {
		name    string
		tainted string
		ask     ask
		want    []string // nil: does not fit
	}{
		{"tainted full GPU", "gpu-0", gpuAsk(), nil},
		{"MIG devices of a tainted full GPU are still offered", "gpu-0", migAsk("7g.80gb"), []string{"gpu-0-mig-7g-80gb-0"}},
		{"tainted MIG device", "gpu-0-mig-7g-80gb-0", migAsk("7g.80gb"), nil},
		{"full GPU beside a tainted MIG device", "gpu-0-mig-7g-80gb-0", gpuAsk(), []string{"gpu-0"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, oneGPUMig, Options{Taints: map[string][]resourceapi.DeviceTaint{tc.tainted: {noSchedule}}})
			assert.Equal(t, tc.want, c.allocate(t, tc.ask))
		})
	}
}

// The allocator follows a slice that changed between two pods: a selector
// that matched a device before its slice changed is asked again. Against
// kube-scheduler's allocator as released this holds trivially (it keeps
// nothing between pods); against the patched one of bench/upstream, which
// keeps selector results across pods, it pins that the slice's generation
// is part of what they are kept by.
func TestAllocatorFollowsASliceChange(t *testing.T) {
	c := newCluster(t, "dgx-h100-nomig", Options{})
	h100 := ask{class: "gpu.gpudra.dev", product: "NVIDIA H100 80GB HBM3"}
	require.Len(t, c.allocate(t, h100), 1)
	c.allocated = sets.New[structured.DeviceID]()
	for _, s := range c.slices {
		for i := range s.Spec.Devices {
			if _, ok := s.Spec.Devices[i].Attributes["productName"]; ok {
				s.Spec.Devices[i].Attributes["productName"] = resourceapi.DeviceAttribute{StringValue: ptr.To("NVIDIA H200")}
			}
		}
		s.Generation++
	}
	assert.Nil(t, c.allocate(t, h100), "no device is an H100 any more")
	assert.Len(t, c.allocate(t, ask{class: "gpu.gpudra.dev", product: "NVIDIA H200"}), 1)
}
