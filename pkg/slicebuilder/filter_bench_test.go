package slicebuilder

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/uuid"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/utils/ptr"
)

// filterNodes is the cluster size of BenchmarkSchedulerFilter.
const filterNodes = 1000

// fleet is filterNodes nodes of one machine, as the scheduler's allocator
// sees them: every node's slices, and the devices allocated on them.
type fleet struct {
	nodes     []*v1.Node
	slices    []*resourceapi.ResourceSlice
	allocated sets.Set[structured.DeviceID]
	heapBytes uint64
}

// newFleet publishes the machine's slices for every node. plain is the
// baseline a driver without partitions publishes: 8 GPUs with a type and
// a product attribute, no capacities, no counters.
func newFleet(b *testing.B, machineName string, plain bool, opts Options) *fleet {
	b.Helper()
	var before runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	var template []resourceapi.ResourceSlice
	if plain {
		var devs []resourceapi.Device
		for i := range 8 {
			devs = append(devs, resourceapi.Device{Name: fmt.Sprintf("gpu-%d", i),
				Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"type": {StringValue: ptr.To(TypeGPU)},
					"productName": {StringValue: ptr.To("NVIDIA H100 80GB HBM3")}}})
		}
		template = []resourceapi.ResourceSlice{{Spec: resourceapi.ResourceSliceSpec{Driver: DriverName,
			Pool: resourceapi.ResourcePool{ResourceSliceCount: 1}, Devices: devs}}}
	} else {
		_, inv := machine(b, machineName, "node-a")
		template = build(b, inv, "node-a", opts)
	}
	f := &fleet{allocated: sets.New[structured.DeviceID]()}
	for n := range filterNodes {
		name := fmt.Sprintf("node-%04d", n)
		f.nodes = append(f.nodes, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}})
		for i := range template {
			s := template[i].DeepCopy()
			s.Name = fmt.Sprintf("%s-%d", name, i)
			// An identity, as the API server gives every slice: what a
			// scheduler that keeps results across pods keys them by
			// (bench/upstream).
			s.UID = uuid.NewUUID()
			s.Generation = 1
			s.Spec.NodeName = ptr.To(name)
			s.Spec.Pool.Name = name
			f.slices = append(f.slices, s)
		}
	}
	var after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&after)
	f.heapBytes = after.HeapAlloc - min(after.HeapAlloc, before.HeapAlloc)
	return f
}

// hold marks the given GPUs of every node held: the whole GPU where it is
// published (in MIG mode its counters then block every placement), and
// every MIG device that exists on it.
func (f *fleet) hold(indexes ...int) {
	held := sets.New[string]()
	for _, s := range f.slices {
		if *s.Spec.NodeName != f.nodes[0].Name {
			continue
		}
		for _, d := range s.Spec.Devices {
			for _, i := range indexes {
				// Names carry the GPU's minor, its index on these machines.
				_, exists := d.Attributes["uuid"]
				if d.Name == fmt.Sprintf("gpu-%d", i) || (exists && strings.HasPrefix(d.Name, fmt.Sprintf("gpu-%d-mig-", i))) {
					held.Insert(d.Name)
				}
			}
		}
	}
	for _, n := range f.nodes {
		for name := range held {
			f.allocated.Insert(structured.MakeDeviceID(DriverName, n.Name, name))
		}
	}
}

// filter is what kube-scheduler's DynamicResources plugin does for one
// pending pod: one allocator over every slice (PreFilter), then Allocate on
// every node (Filter), without percentageOfNodesToScore or parallelism.
// It returns how many nodes fit.
func (f *fleet) filter(b *testing.B, claim *resourceapi.ResourceClaim) int {
	ctx := context.Background()
	state := structured.AllocatedState{AllocatedDevices: f.allocated, AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](),
		AggregatedCapacity: structured.NewConsumedCapacityCollection()}
	alloc, err := structured.NewAllocator(ctx, allocatorFeatures, state, testClasses, f.slices, cel.NewCache(100, cel.Features{}))
	if err != nil {
		b.Fatal(err)
	}
	fit := 0
	for _, n := range f.nodes {
		res, err := alloc.Allocate(ctx, n, []*resourceapi.ResourceClaim{claim})
		if err != nil {
			b.Fatal(err)
		}
		if res != nil {
			fit++
		}
	}
	return fit
}

func filterClaim(class, profile string, count int64) *resourceapi.ResourceClaim {
	req := &resourceapi.ExactDeviceRequest{DeviceClassName: class, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: count}
	if profile != "" {
		req.Selectors = []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
			Expression: fmt.Sprintf(`device.attributes["gpu.gpudra.dev"].migProfile == %q`, profile)}}}
	}
	return &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "c", Namespace: "default", UID: "uid-c"},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: req}}}}}
}

// prioritizedClaim asks for a whole GPU, else a 3g.40gb
// (examples/prioritized-list).
func prioritizedClaim() *resourceapi.ResourceClaim {
	return &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "c", Namespace: "default", UID: "uid-c"},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{Name: "gpu",
			FirstAvailable: []resourceapi.DeviceSubRequest{
				{Name: "whole", DeviceClassName: "gpu.gpudra.dev", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1},
				{Name: "mig-3g", DeviceClassName: "mig.gpudra.dev", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1, Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
					Expression: `device.attributes["gpu.gpudra.dev"].migProfile == "3g.40gb"`}}}}}}}}}}
}

// BenchmarkSchedulerFilter runs the scheduler's allocator over 1,000 nodes
// of each mix, for one pending pod of each case, and reports the time per
// pod, the slices' heap, and the ratios the scale targets are written in
// (issue 26): MIG mode against MIG off, MIG off against the plain baseline.
// -benchtime 1x: each case is one pod (seconds in MIG mode).
func BenchmarkSchedulerFilter(b *testing.B) {
	type mix struct {
		name    string
		machine string
		plain   bool
		opts    Options
		// unit is the one device a pod asks for: a whole GPU, or where the
		// mix publishes none, a 1g.10gb instance.
		unit *resourceapi.ResourceClaim
	}
	gpu := filterClaim("gpu.gpudra.dev", "", 1)
	small := filterClaim("mig.gpudra.dev", "1g.10gb", 1)
	// DGX H100s in MIG mode with instances made by the admin (nvidia-smi,
	// a MIG manager), for the existing policy: seven 1g.10gb per GPU (the
	// most a GPU holds), and a mixed layout of four per GPU.
	layout := func(name string, perGPU ...string) string {
		m := "name: " + name + "\ngpuCount: 8\nnvlink: nvswitch\nmigEnabled: all\nmigDevices:\n"
		for g := range 8 {
			for _, d := range perGPU {
				m += fmt.Sprintf("- {gpu: %d, %s}\n", g, d)
			}
		}
		return m
	}
	var seven []string
	for start := range 7 {
		seven = append(seven, fmt.Sprintf("profile: 1g.10gb, start: %d", start))
	}
	sevenSmall := layout("dgx-seven-small", seven...)
	mixed := layout("dgx-mixed", "profile: 1g.10gb, start: 0", "profile: 1g.10gb, start: 1", "profile: 2g.20gb, start: 2", "profile: 3g.40gb, start: 4")
	mixes := []mix{
		{name: "plain", plain: true, unit: gpu},
		{name: "migoff", machine: "dgx-h100-nomig", unit: gpu},
		{name: "migmode-all", machine: "dgx-h100", unit: gpu},
		{name: "migmode-profiles", machine: "dgx-h100", opts: Options{Mig: MigPolicy{Profiles: []string{"1g.10gb", "3g.40gb"}}}, unit: gpu},
		{name: "migmode-existing-7x1g", machine: sevenSmall, opts: Options{Mig: MigPolicy{Existing: true}}, unit: small},
		{name: "migmode-existing-mixed", machine: mixed, opts: Options{Mig: MigPolicy{Existing: true}}, unit: small},
		// The default with dcgm-exporter's profile attribute: a MIG
		// device's ninth (docs/scale.md).
		{name: "migmode-existing-7x1g-dcgm", machine: sevenSmall, opts: Options{Mig: MigPolicy{Existing: true}, DCGMExporterAttributes: true}, unit: small},
	}
	migMixes := []string{"migmode-all", "migmode-profiles", "migmode-existing-7x1g", "migmode-existing-mixed", "migmode-existing-7x1g-dcgm"}
	type kase struct {
		name  string
		hold  []int
		claim *resourceapi.ResourceClaim // nil: the mix's unit
		mig   bool                       // only where MIG devices are published
	}
	sevenHeld := []int{0, 1, 2, 3, 4, 5, 6}
	cases := []kase{
		{name: "1dev-free"},
		{name: "1dev-7held", hold: sevenHeld},
		{name: "1g.10gb-7held", hold: sevenHeld, claim: small, mig: true},
		{name: "fits-nowhere", claim: filterClaim("gpu.gpudra.dev", "", 9)},
		{name: "1dev-nomatch"},
		{name: "gpu-or-3g.40gb", claim: prioritizedClaim(), mig: true},
		{name: "1g.10gb-free", claim: small, mig: true},
	}
	times := map[string]map[string]time.Duration{}
	heaps := map[string]uint64{}
	for _, m := range mixes {
		f := newFleet(b, m.machine, m.plain, m.opts)
		heaps[m.name] = f.heapBytes
		times[m.name] = map[string]time.Duration{}
		for _, c := range cases {
			if c.mig && !strings.HasPrefix(m.name, "migmode") {
				continue
			}
			f.allocated = sets.New[structured.DeviceID]()
			f.hold(c.hold...)
			claim := c.claim
			if claim == nil {
				claim = m.unit
			}
			if c.name == "1dev-nomatch" {
				// The mix's unit on a product no node has: every device
				// evaluated, no backtracking (an unschedulable pod's retry).
				claim = claim.DeepCopy()
				claim.Spec.Devices.Requests[0].Exactly.Selectors = append(claim.Spec.Devices.Requests[0].Exactly.Selectors,
					resourceapi.DeviceSelector{CEL: &resourceapi.CELDeviceSelector{Expression: `device.attributes["gpu.gpudra.dev"].productName == "NVIDIA H200"`}})
			}
			b.Run(m.name+"/"+c.name, func(b *testing.B) {
				var total time.Duration
				for b.Loop() {
					start := time.Now()
					f.filter(b, claim)
					total += time.Since(start)
				}
				times[m.name][c.name] = total / time.Duration(b.N)
				b.ReportMetric(float64(times[m.name][c.name].Microseconds())/1000, "ms/pod")
				b.ReportMetric(float64(f.heapBytes)/(1<<20), "slice-heap-MiB")
			})
		}
	}
	var ratios []string
	for _, c := range []string{"1dev-free", "1dev-7held", "1dev-nomatch", "fits-nowhere"} {
		if p, off := times["plain"][c], times["migoff"][c]; p > 0 && off > 0 {
			r := fmt.Sprintf("%s: migoff/plain %.1fx", c, float64(off)/float64(p))
			for _, m := range migMixes {
				if mig := times[m][c]; mig > 0 {
					r += fmt.Sprintf(", %s/migoff %.1fx", m, float64(mig)/float64(off))
				}
			}
			ratios = append(ratios, r)
		}
	}
	if heaps["plain"] > 0 && heaps["migoff"] > 0 {
		r := fmt.Sprintf("slice heap: migoff/plain %.1fx", float64(heaps["migoff"])/float64(heaps["plain"]))
		for _, m := range migMixes {
			r += fmt.Sprintf(", %s/migoff %.1fx", m, float64(heaps[m])/float64(heaps["migoff"]))
		}
		ratios = append(ratios, r)
	}
	// Printed, not logged: the ratios are the benchmark's result.
	fmt.Printf("ratios at %d nodes: %s\n", filterNodes, strings.Join(ratios, "; "))
}
