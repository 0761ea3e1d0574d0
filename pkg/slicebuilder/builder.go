// Package slicebuilder turns the GPU model of a node into the ResourceSlices
// the kubelet plugin publishes (and `gpudra slices` prints): full GPUs and MIG
// placements as partitionable devices that consume one shared counter set per
// physical GPU, split to the API's limits.
package slicebuilder

import (
	"fmt"
	"sort"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/utils/ptr"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// API limits of resource.k8s.io/v1 ResourceSlices.
const (
	// MaxDevicesWithCounters is the device limit of a slice in which any
	// device consumes counters or has taints.
	MaxDevicesWithCounters = 64
	// MaxCounterSetsPerSlice is the limit on shared counter sets in a slice.
	MaxCounterSetsPerSlice = 8
	// MaxCountersPerSet is the limit on counters in one counter set.
	MaxCountersPerSet = 32
	// MaxAttributesAndCapacities is the limit on attributes plus capacities
	// of one device.
	MaxAttributesAndCapacities = 32
)

// Options shape what is published.
type Options struct {
	// ManagedMigDevices are the UUIDs of MIG devices the driver created for
	// claims. They do not hide the placements they overlap: the scheduler
	// already accounts for them through the counters. Each is published at
	// its placement whatever Mig says (a policy narrowed while its claim is
	// prepared), as when its claim was allocated: the allocation names it,
	// and its counters keep the whole GPU and the placements it overlaps
	// from being handed out until the claim is released. Any other existing
	// MIG device belongs to someone else and blocks the full GPU and every
	// placement it overlaps.
	ManagedMigDevices map[string]bool
	// Taints are added to the named devices (health).
	Taints map[string][]resourceapi.DeviceTaint
	// FractionalGPUs publishes every whole GPU whose MIG mode is off as a
	// device several claims may share (consumable capacity): each claim
	// asks for the memory and multiprocessors it wants, the scheduler keeps
	// the sum within the GPU, and the plugin caps each share with MPS.
	FractionalGPUs bool
	// ExistingMigOnly offers only the MIG devices that exist, none the
	// driver would create (feature gate DynamicMIG off): Mig.Existing,
	// whatever Mig says.
	ExistingMigOnly bool
	// Mig says which MIG placements are published (migpolicy.go).
	Mig MigPolicy
	// DCGMExporterAttributes adds to each MIG device the attribute
	// dcgm-exporter reads for its profile (profile, a copy of migProfile),
	// for the day dcgm-exporter attributes another driver's devices
	// (docs/metrics.md, "Running beside dcgm-exporter"). Off by default: it
	// is a MIG device's ninth attribute, past the eight a Go map holds in
	// one group, and the slices' heap grows by 61% in MIG mode at 1,000
	// nodes (docs/scale.md), for nothing dcgm-exporter reads today.
	DCGMExporterAttributes bool
}

// gpuDevices is what one physical GPU contributes: its devices, and the
// counter set they share (none for a GPU that publishes no partitions).
type gpuDevices struct {
	counters *resourceapi.CounterSet
	devices  []resourceapi.Device
}

// Build returns the node's one pool: counter slices first, then device
// slices in the order kube-scheduler's allocator does best with
// (allocatorOrder), at most MaxDevicesWithCounters per slice.
func Build(inv *nvdevice.Inventory, nodeName string, opts Options) (resourceslice.DriverResources, error) {
	gpus := append([]nvdevice.GPU(nil), inv.GPUs...)
	sort.Slice(gpus, func(i, j int) bool { return gpus[i].Index < gpus[j].Index })

	var perGPU []gpuDevices
	for i := range gpus {
		gd, err := buildGPU(&gpus[i], opts)
		if err != nil {
			return resourceslice.DriverResources{}, err
		}
		perGPU = append(perGPU, gd)
	}

	var slices []resourceslice.Slice
	var sets []resourceapi.CounterSet
	for _, gd := range perGPU {
		if gd.counters != nil {
			sets = append(sets, *gd.counters)
		}
	}
	for start := 0; start < len(sets); start += MaxCounterSetsPerSlice {
		slices = append(slices, resourceslice.Slice{SharedCounters: sets[start:min(start+MaxCounterSetsPerSlice, len(sets))]})
	}
	devices := allocatorOrder(perGPU)
	for start := 0; start < len(devices); start += MaxDevicesWithCounters {
		slices = append(slices, resourceslice.Slice{Devices: devices[start:min(start+MaxDevicesWithCounters, len(devices))]})
	}
	if len(devices) == 0 {
		// An empty pool still gets one slice: "no devices" differs from "no driver".
		slices = append(slices, resourceslice.Slice{})
	}
	return resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{nodeName: {Slices: slices}}}, nil
}

// allocatorOrder lists the node's devices in the order kube-scheduler's
// allocator should meet them. It walks a pool's devices in slice order,
// skips allocated ones cheaply, evaluates the class and request selectors
// (CEL) on the others, and stops at the first that fits. So:
//   - whole GPUs first, in index order: a GPU claim meets the 8 GPUs, not
//     the 200 MIG placements listed between them (issue 26: 3.6 s -> ms
//     per pod at 1,000 nodes with 7 of 8 GPUs held);
//   - then the MIG devices that exist without counters (the existing
//     policy, or another tool's instances), GPU by GPU in index order, each
//     GPU's in its profile order, smallest first: a GPU holds at most seven,
//     so a claim for any profile meets at most six others before one of its
//     own (grouped by profile across GPUs, a 3g.40gb claim met all 24
//     1g.10gb and 2g.20gb devices of an all-balanced node first: issue 50,
//     the prioritized list at 4.8 pods/s at 1,000 nodes);
//   - then MIG placements drawn from counters, grouped by profile across
//     GPUs (in the GPUs' profile order), each profile's GPUs in index order,
//     each GPU's placements highest start first (as buildGPU lists them): a
//     1g.10gb claim meets the 1g.10gb placements, not 24 others per GPU.
//
// First fit still packs MIG devices onto the lowest GPUs, the top of each
// GPU first, and keeps the others whole.
func allocatorOrder(perGPU []gpuDevices) []resourceapi.Device {
	var whole, existing []resourceapi.Device
	var profiles []string
	byProfile := map[string][]resourceapi.Device{}
	for _, gd := range perGPU {
		for _, d := range gd.devices {
			a := d.Attributes["migProfile"]
			switch {
			case a.StringValue == nil:
				whole = append(whole, d)
			case len(d.ConsumesCounters) == 0:
				existing = append(existing, d)
			default:
				p := *a.StringValue
				if _, seen := byProfile[p]; !seen {
					profiles = append(profiles, p)
				}
				byProfile[p] = append(byProfile[p], d)
			}
		}
	}
	out := append(whole, existing...)
	for _, p := range profiles {
		out = append(out, byProfile[p]...)
	}
	return out
}

func buildGPU(g *nvdevice.GPU, opts Options) (gpuDevices, error) {
	counters := gpuCounters(g)
	if len(counters) > MaxCountersPerSet {
		return gpuDevices{}, fmt.Errorf("GPU %d (%s): %d counters exceed the limit of %d", g.Index, g.UUID, len(counters), MaxCountersPerSet)
	}
	policy := opts.Mig
	if opts.ExistingMigOnly {
		policy = MigPolicy{Existing: true}
	}
	foreign := foreignMigDevices(g, opts.ManagedMigDevices)
	// Someone else's MIG devices hold their memory slices and engines whether
	// or not the scheduler hands them out: take them out of the counter set
	// (the devices themselves are published without counter consumption).
	for _, d := range foreign {
		for name, c := range migConsumption(d.MemoryMiB, d.Placement, d.Engines) {
			if have, ok := counters[name]; ok {
				have.Value.Sub(c.Value)
				counters[name] = have
			}
		}
	}
	gd := gpuDevices{}
	// Counters only where partitions are published: a GPU with MIG off
	// (or with only existing MIG devices) offers devices nothing else draws
	// on, and a counter set of its own only made every allocation on every
	// node check it (issue 26: MIG-off nodes cost kube-scheduler 3.4x a
	// plain driver's).
	partitioned := g.MIG.Capable && g.MIG.Enabled && !policy.Existing

	if len(foreign) == 0 && !(policy.Existing && g.MIG.Enabled) {
		gd.devices = append(gd.devices, fullGPUDevice(g, opts, partitioned))
	}
	if g.MIG.Capable && g.MIG.Enabled {
		for _, prof := range g.MIG.Profiles {
			// Highest start first: small instances fill the top of the GPU
			// and keep the low placements, where the big profiles sit, free.
			for i := len(prof.Placements) - 1; i >= 0; i-- {
				pl := prof.Placements[i]
				existing, blocked := placementState(foreign, prof.Name, pl)
				if blocked || (existing == nil && !policy.publishes(prof.Name) && !managedAt(g, opts.ManagedMigDevices, prof.Name, pl)) {
					continue
				}
				// Consumption where there are counters to consume: an
				// existing foreign device was taken out of the counter set.
				gd.devices = append(gd.devices, migDevice(g, &prof, pl, existing, existing == nil && partitioned, opts))
			}
		}
	}
	if partitioned {
		gd.counters = &resourceapi.CounterSet{Name: CounterSetName(g), Counters: counters}
	}
	for _, d := range gd.devices {
		if n := len(d.Attributes) + len(d.Capacity); n > MaxAttributesAndCapacities {
			return gpuDevices{}, fmt.Errorf("device %s: %d attributes and capacities exceed the limit of %d", d.Name, n, MaxAttributesAndCapacities)
		}
	}
	return gd, nil
}

// foreignMigDevices are the MIG devices on g that the driver did not create.
func foreignMigDevices(g *nvdevice.GPU, managed map[string]bool) []nvdevice.MigDevice {
	var out []nvdevice.MigDevice
	for _, d := range g.MIG.Devices {
		if !managed[d.UUID] {
			out = append(out, d)
		}
	}
	return out
}

// managedAt says whether a MIG device the driver created for a claim sits
// at this placement: published whatever the policy, until released.
func managedAt(g *nvdevice.GPU, managed map[string]bool, profile string, pl nvdevice.Placement) bool {
	for _, d := range g.MIG.Devices {
		if managed[d.UUID] && d.Profile == profile && d.Placement == pl {
			return true
		}
	}
	return false
}

// placementState says whether a foreign MIG device sits exactly at this
// placement (then it is offered as it is) or overlaps it (then the placement
// cannot be created and is not offered).
func placementState(foreign []nvdevice.MigDevice, profile string, pl nvdevice.Placement) (*nvdevice.MigDevice, bool) {
	for i, d := range foreign {
		if d.Profile == profile && d.Placement == pl {
			return &foreign[i], false
		}
		if d.Placement.Overlaps(pl) {
			return nil, true
		}
	}
	return nil, false
}

func gpuCounters(g *nvdevice.GPU) map[string]resourceapi.Counter {
	c := map[string]resourceapi.Counter{}
	if g.MIG.Capable && g.MIG.Enabled {
		for i := 0; i < nvdevice.MemorySlices; i++ {
			c[memorySliceCounter(i)] = resourceapi.Counter{Value: resource.MustParse("1")}
		}
	}
	c[counterMemory] = resourceapi.Counter{Value: mebibytes(g.MemoryMiB)}
	addEngineCounters(c, g.Engines)
	return c
}

// addEngineCounters sets (or, for consumption, records) the engine units.
// Engines a GPU does not have (H100: encoders) get no counter.
func addEngineCounters(c map[string]resourceapi.Counter, e nvdevice.Engines) {
	for name, v := range map[string]int{
		counterMultiprocessors: e.Multiprocessors,
		counterCopyEngines:     e.CopyEngines,
		counterDecoders:        e.Decoders,
		counterJPEGEngines:     e.JPEGEngines,
		counterOFAEngines:      e.OFAEngines,
	} {
		if v > 0 {
			c[name] = resourceapi.Counter{Value: *resource.NewQuantity(int64(v), resource.DecimalSI)}
		}
	}
}

func mebibytes(mib uint64) resource.Quantity {
	return *resource.NewQuantity(int64(mib)*1024*1024, resource.BinarySI)
}

func fullGPUDevice(g *nvdevice.GPU, opts Options, partitioned bool) resourceapi.Device {
	name := GPUDeviceName(g)
	attrs := gpuAttributes(g)
	attrs["type"] = str(TypeGPU)
	attrs["uuid"] = str(g.UUID)
	// In MIG mode the whole GPU is served as its largest MIG instance:
	// claims that need the GPU itself (time-slicing, NVLink) select on it.
	attrs["migEnabled"] = resourceapi.DeviceAttribute{BoolValue: ptr.To(g.MIG.Enabled)}
	// A GPU in MIG mode has no NVLink peer-to-peer (h100.md), so it is in
	// no NVLink domain: a claim for GPUs on one domain must not get it.
	if g.NVLink.Domain != "" && !g.MIG.Enabled {
		attrs["nvlinkDomain"] = str(g.NVLink.Domain)
	}
	if g.NVLink.FabricClique != "" && !g.MIG.Enabled {
		attrs["fabricClique"] = str(g.NVLink.FabricClique)
	}
	if opts.FractionalGPUs && !g.MIG.Enabled {
		return fractionalGPUDevice(name, attrs, g, opts)
	}
	d := resourceapi.Device{
		Name:       name,
		Attributes: attrs,
		Capacity:   capacities(g.MemoryMiB, g.Engines),
		Taints:     opts.Taints[name],
	}
	if partitioned {
		// A full GPU takes everything its counter set holds.
		d.ConsumesCounters = []resourceapi.DeviceCounterConsumption{{CounterSet: CounterSetName(g), Counters: gpuCounters(g)}}
	}
	return d
}

// fractionalGPUDevice is a whole GPU that several claims may share. Every
// capacity gets a request policy, because a capacity without one is taken
// whole by a claim that does not mention it:
//   - memory: a claim takes what it asks for (at least 1Gi); one that does
//     not ask takes all of it, so a plain GPU claim still gets a GPU to itself;
//   - multiprocessors: a claim takes what it asks for, none by default (it
//     then shares the SMs without a cap);
//   - engines: not divided (MPS cannot), so nothing is consumed.
//
// The device consumes no counters: with MIG off nothing else is carved out
// of the GPU.
func fractionalGPUDevice(name string, attrs map[resourceapi.QualifiedName]resourceapi.DeviceAttribute, g *nvdevice.GPU, opts Options) resourceapi.Device {
	caps := capacities(g.MemoryMiB, g.Engines)
	for key, c := range caps {
		zero := resource.MustParse("0")
		policy := &resourceapi.CapacityRequestPolicy{Default: &zero, ValidRange: &resourceapi.CapacityRequestPolicyRange{Min: &zero}}
		if key == CapacityMemory {
			full, min := c.Value.DeepCopy(), resource.MustParse("1Gi")
			policy = &resourceapi.CapacityRequestPolicy{Default: &full, ValidRange: &resourceapi.CapacityRequestPolicyRange{Min: &min}}
		}
		c.RequestPolicy = policy
		caps[key] = c
	}
	attrs["sharing"] = str("fractional")
	return resourceapi.Device{
		Name:                     name,
		Attributes:               attrs,
		Capacity:                 caps,
		AllowMultipleAllocations: ptr.To(true),
		Taints:                   opts.Taints[name],
	}
}

func migDevice(g *nvdevice.GPU, prof *nvdevice.MigProfile, pl nvdevice.Placement, existing *nvdevice.MigDevice, consumes bool, opts Options) resourceapi.Device {
	name := MigDeviceName(g, prof.Name, pl.Start)
	attrs := placeAttributes(g)
	attrs["type"] = str(TypeMIG)
	attrs["migProfile"] = str(prof.Name)
	if opts.DCGMExporterAttributes {
		// profile repeats migProfile under the name dcgm-exporter reads
		// (with type, uuid and parentUUID) to label a MIG device's pod
		// metrics. migProfile stays: users' CEL selectors name it.
		attrs["profile"] = str(prof.Name)
	}
	attrs["parentUUID"] = str(g.UUID)
	if existing != nil {
		attrs["uuid"] = str(existing.UUID)
	}
	d := resourceapi.Device{
		Name:       name,
		Attributes: attrs,
		Capacity:   capacities(prof.MemoryMiB, prof.Engines),
		Taints:     opts.Taints[name],
	}
	if consumes {
		d.ConsumesCounters = []resourceapi.DeviceCounterConsumption{{
			CounterSet: CounterSetName(g), Counters: migConsumption(prof.MemoryMiB, pl, prof.Engines),
		}}
	}
	return d
}

// migConsumption is what a MIG device takes from its GPU's counter set.
func migConsumption(memoryMiB uint64, pl nvdevice.Placement, e nvdevice.Engines) map[string]resourceapi.Counter {
	consumed := map[string]resourceapi.Counter{counterMemory: {Value: mebibytes(memoryMiB)}}
	for _, s := range pl.Slices() {
		consumed[memorySliceCounter(s)] = resourceapi.Counter{Value: resource.MustParse("1")}
	}
	addEngineCounters(consumed, e)
	return consumed
}
