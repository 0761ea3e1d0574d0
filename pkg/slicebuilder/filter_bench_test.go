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
// baseline a driver without partitions publishes: 8 GPUs with a type
// attribute, no counters.
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
				Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"type": {StringValue: ptr.To(TypeGPU)}}})
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

// hold marks the whole GPUs with the given indexes allocated on every node.
func (f *fleet) hold(indexes ...int) {
	for _, n := range f.nodes {
		for _, i := range indexes {
			f.allocated.Insert(structured.MakeDeviceID(DriverName, n.Name, fmt.Sprintf("gpu-%d", i)))
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
	}
	// A DGX H100 in MIG mode with seven 1g.10gb instances made on every
	// GPU (nvidia-smi), for the existing policy.
	sevenSmall := "name: dgx-small\ngpuCount: 8\nnvlink: nvswitch\nmigEnabled: all\nmigDevices:\n"
	for g := range 8 {
		for start := range 7 {
			sevenSmall += fmt.Sprintf("- {gpu: %d, profile: 1g.10gb, start: %d}\n", g, start)
		}
	}
	mixes := []mix{
		{name: "plain", plain: true},
		{name: "migoff", machine: "dgx-h100-nomig"},
		{name: "migmode", machine: "dgx-h100"},
		{name: "migmode-profiles", machine: "dgx-h100", opts: Options{Mig: MigPolicy{Profiles: []string{"1g.10gb", "3g.40gb"}}}},
		{name: "migmode-existing", machine: sevenSmall, opts: Options{Mig: MigPolicy{Existing: true}}},
	}
	type kase struct {
		name  string
		hold  []int
		claim *resourceapi.ResourceClaim
		mig   bool // only where MIG devices are published
	}
	cases := []kase{
		{name: "1gpu-free", claim: filterClaim("gpu.gpudra.dev", "", 1)},
		{name: "1gpu-7held", hold: []int{0, 1, 2, 3, 4, 5, 6}, claim: filterClaim("gpu.gpudra.dev", "", 1)},
		{name: "1g.10gb-7held", hold: []int{0, 1, 2, 3, 4, 5, 6}, claim: filterClaim("mig.gpudra.dev", "1g.10gb", 1), mig: true},
		{name: "fits-nowhere", claim: filterClaim("gpu.gpudra.dev", "", 9)},
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
			b.Run(m.name+"/"+c.name, func(b *testing.B) {
				var total time.Duration
				for b.Loop() {
					start := time.Now()
					f.filter(b, c.claim)
					total += time.Since(start)
				}
				times[m.name][c.name] = total / time.Duration(b.N)
				b.ReportMetric(float64(times[m.name][c.name].Microseconds())/1000, "ms/pod")
				b.ReportMetric(float64(f.heapBytes)/(1<<20), "slice-heap-MiB")
			})
		}
	}
	var ratios []string
	for _, c := range []string{"1gpu-free", "1gpu-7held", "fits-nowhere"} {
		if p, off := times["plain"][c], times["migoff"][c]; p > 0 && off > 0 {
			r := fmt.Sprintf("%s: migoff/plain %.1fx", c, float64(off)/float64(p))
			for _, m := range []string{"migmode", "migmode-profiles", "migmode-existing"} {
				if mig := times[m][c]; mig > 0 {
					r += fmt.Sprintf(", %s/migoff %.1fx", m, float64(mig)/float64(off))
				}
			}
			ratios = append(ratios, r)
		}
	}
	if heaps["plain"] > 0 && heaps["migoff"] > 0 {
		r := fmt.Sprintf("slice heap: migoff/plain %.1fx", float64(heaps["migoff"])/float64(heaps["plain"]))
		for _, m := range []string{"migmode", "migmode-profiles", "migmode-existing"} {
			r += fmt.Sprintf(", %s/migoff %.1fx", m, float64(heaps[m])/float64(heaps["migoff"]))
		}
		ratios = append(ratios, r)
	}
	// Printed, not logged: the ratios are the benchmark's result.
	fmt.Printf("ratios at %d nodes: %s\n", filterNodes, strings.Join(ratios, "; "))
}
