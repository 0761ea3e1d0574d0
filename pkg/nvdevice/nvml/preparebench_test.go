//go:build cgo && linux

package nvml

import (
	"context"
	"fmt"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/plugin"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// withCallLatency makes every call through the function fields of go-nvml
// mocks (mock.Interface, mock.Device, ...) spend d on the calling thread
// first, as a real NVML call does: the H200's per-call cost on the
// simulator's timing model (sim.H200NVMLTiming, charged as CPU).
func withCallLatency(d time.Duration, mocks ...any) {
	for _, m := range mocks {
		v := reflect.ValueOf(m).Elem()
		for i := range v.NumField() {
			f := v.Field(i)
			if !strings.HasSuffix(v.Type().Field(i).Name, "Func") || f.Kind() != reflect.Func || f.IsNil() || !f.CanSet() {
				continue
			}
			orig := reflect.ValueOf(f.Interface())
			f.Set(reflect.MakeFunc(f.Type(), func(args []reflect.Value) []reflect.Value {
				spin(d)
				if orig.Type().IsVariadic() {
					return orig.CallSlice(args)
				}
				return orig.Call(args)
			}))
		}
	}
}

// spin uses the CPU for d.
func spin(d time.Duration) {
	for start := time.Now(); time.Since(start) < d; {
	}
}

// withoutSnapshot is the NVML backend as it was before it kept an
// inventory snapshot: every prepare reads the GPUs through NVML (the
// embedded interface hides InventorySnapshot).
type withoutSnapshot struct{ nvdevice.Interface }

// prepareNode is one node of the benchmark: a NodeState over a backend,
// with the steps of its prepares collected.
type prepareNode struct {
	name     string
	state    *plugin.NodeState
	device   string
	prepares []time.Duration
	steps    map[string]time.Duration
	calls    func() int // NVML calls so far (nil: not NVML)
	// prepareCalls counts the NVML calls the timed prepares made.
	prepareCalls int
	// tick, if set, is run before claim i's prepare, untimed: the node's
	// clock and the plugin's inventory poll.
	tick func(i int)
}

func newPrepareNode(b *testing.B, name string, backend nvdevice.Interface, device string, calls func() int) *prepareNode {
	b.Helper()
	dir := b.TempDir()
	writer, err := cdi.NewWriter(filepath.Join(dir, "cdi"))
	if err != nil {
		b.Fatal(err)
	}
	n := &prepareNode{name: name, device: device, steps: map[string]time.Duration{}, calls: calls}
	n.state, err = plugin.NewNodeState(context.Background(), plugin.StateOptions{
		Pool: "node-a", Backend: backend, CDI: writer,
		Majors:         nvdevice.DeviceMajors{NVIDIA: 195, UVM: 400, Caps: 401},
		CheckpointPath: filepath.Join(dir, "plugin", "checkpoint.json"), BootID: "boot-1",
		OnPrepareStep: func(step string, d time.Duration) { n.steps[step] += d },
	})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = n.state.Close() })
	return n
}

func (n *prepareNode) round(b *testing.B, i int) {
	if n.tick != nil {
		n.tick(i)
	}
	uid := fmt.Sprintf("%s-%06d", n.name, i)
	c := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "claim-" + uid, Namespace: "ns", UID: types.UID(uid)},
		Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{
			Results: []resourceapi.DeviceRequestAllocationResult{{Request: "gpu", Driver: slicebuilder.DriverName, Pool: "node-a", Device: n.device}},
		}}},
	}
	ctx := context.Background()
	calls := 0
	if n.calls != nil {
		calls = n.calls()
	}
	start := time.Now()
	if _, err := n.state.Prepare(ctx, c); err != nil {
		b.Fatalf("%s: prepare: %v", n.name, err)
	}
	n.prepares = append(n.prepares, time.Since(start))
	if n.calls != nil {
		n.prepareCalls += n.calls() - calls
	}
	if _, err := n.state.Unprepare(ctx, uid); err != nil {
		b.Fatalf("%s: unprepare: %v", n.name, err)
	}
}

func (n *prepareNode) p(q float64) time.Duration {
	s := slices.Clone(n.prepares)
	slices.Sort(s)
	return s[int(q*float64(len(s)-1))]
}

// BenchmarkPrepareH200Shaped is a whole-GPU prepare and unprepare on the
// NVML backend, over go-nvml's mocks shaped as the H200 of
// testdata/real-gpus (one GPU, MIG capable and off) with the H200's cost
// of a call, and a driver root laid out as that host's
// (layOutH200DriverRoot), beside the same prepare on a simulated HGX H200
// node, interleaved claim by claim in one run:
//   - sim: the simulated node;
//   - nvml-before: the NVML backend reading every GPU through NVML for each
//     claim, as before it kept an inventory snapshot;
//   - nvml-ttl5: with the snapshot as it was first made: read again by the
//     first prepare 5 s after it was made;
//   - nvml: the NVML backend as it is (the plugin's poll confirms the
//     snapshot).
//
// The NVML nodes' clocks advance 100 ms a claim (10 claims a second), and
// the plugin's inventory poll runs every 15 s of that clock, untimed.
// It reports each node's prepare p50 and p99, its NVML calls per prepare,
// the mean time of each step of a prepare (the plugin's
// gpudra_plugin_prepare_step_duration_seconds), and the driver root's
// discovery, which the plugin makes at start and on a driver change, not
// per claim.
func BenchmarkPrepareH200Shaped(b *testing.B) {
	root := b.TempDir()
	layOutH200DriverRoot(b, root)
	perCall := sim.H200NVMLTiming().DefaultCPU

	newNVML := func(ttl time.Duration) (*Backend, func() int, func(int)) {
		gpus := board(1, nvml.DEVICE_MIG_DISABLE)
		lib := fakeLib(gpus)
		mocks := []any{lib, gpus[0].Device}
		withCallLatency(perCall, mocks...)
		be := testBackend(b, lib)
		be.opts.DriverRoot = root
		be.snapTTL = ttl
		clock := time.Unix(1_800_000_000, 0)
		be.now = func() time.Time { return clock }
		tick := func(i int) {
			clock = clock.Add(100 * time.Millisecond)
			if i%150 == 0 {
				if _, err := be.Inventory(context.Background()); err != nil {
					b.Fatal(err)
				}
			}
		}
		return be, func() int {
			got := map[string]int{}
			countCalls(got, mocks...)
			total := 0
			for _, v := range got {
				total += v
			}
			return total
		}, tick
	}
	before, beforeCalls, _ := newNVML(0)
	ttl5, ttl5Calls, ttl5Tick := newNVML(5 * time.Second)
	after, afterCalls, afterTick := newNVML(0)
	machine, err := sim.NewBuiltin("hgx-h200-nomig", "node-a")
	if err != nil {
		b.Fatal(err)
	}

	start := time.Now()
	files, err := after.DriverFiles(context.Background())
	if err != nil {
		b.Fatal(err)
	}
	discovery := time.Since(start)

	nodes := []*prepareNode{
		newPrepareNode(b, "sim", machine, "gpu-0", nil),
		newPrepareNode(b, "nvml-before", withoutSnapshot{before}, "gpu-0", beforeCalls),
		newPrepareNode(b, "nvml-ttl5", ttl5, "gpu-0", ttl5Calls),
		newPrepareNode(b, "nvml", after, "gpu-0", afterCalls),
	}
	nodes[2].tick, nodes[3].tick = ttl5Tick, afterTick
	// One round first: the NodeStates' and the snapshot's first reads are
	// start-up, not a claim's.
	for _, n := range nodes {
		n.round(b, -1)
		n.prepares, n.prepareCalls = nil, 0
		clear(n.steps)
	}
	i := 0
	b.ResetTimer()
	for b.Loop() {
		for _, n := range nodes {
			n.round(b, i)
		}
		i++
	}
	b.StopTimer()
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	steps := []string{plugin.PrepareStepLock, plugin.PrepareStepInventory, plugin.PrepareStepPlan, plugin.PrepareStepCDI, plugin.PrepareStepCheckpoint}
	for _, n := range nodes {
		b.ReportMetric(ms(n.p(0.50)), n.name+"-p50-ms")
		b.ReportMetric(ms(n.p(0.99)), n.name+"-p99-ms")
		line := []string{}
		for _, s := range steps {
			mean := n.steps[s] / time.Duration(len(n.prepares))
			line = append(line, fmt.Sprintf("%s %.3f", s, ms(mean)))
		}
		calls := float64(n.prepareCalls) / float64(len(n.prepares))
		b.Logf("%-12s prepare p50 %.3f ms, p99 %.3f ms; NVML calls/prepare %.1f; mean per step (ms): %s",
			n.name, ms(n.p(0.50)), ms(n.p(0.99)), calls, strings.Join(line, ", "))
	}
	b.ReportMetric(float64(nodes[3].p(0.50))/float64(nodes[0].p(0.50)), "nvml/sim-p50")
	b.ReportMetric(float64(nodes[3].p(0.99))/float64(nodes[0].p(0.99)), "nvml/sim-p99")
	b.ReportMetric(float64(nodes[1].p(0.50))/float64(nodes[0].p(0.50)), "before/sim-p50")
	b.Logf("driver root %s: discovery %.2f ms, %d files (at start and on a driver change; per claim: none); NVML call cost %v",
		root, ms(discovery), len(files.Mounts), perCall)
}
