package scalebench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	runtimeapi "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/bench/prepbench"
	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/pkg/allocator"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// GangPlanResult is the planning time of one 64-GPU gang on a large, busy
// cluster.
type GangPlanResult struct {
	// Nodes DGX H100 nodes in MIG mode publishing every placement
	// (migmode-all), Devices in all, Allocated claims.
	Nodes, Devices, Allocated int
	// Pods x GPUs is the gang.
	Pods, GPUs int
	// Plans, per strategy (the controller's --gang-strategy; its default
	// FewestNVLinkDomains first).
	Plans []StrategyPlan
	// Heap is the Go heap the slices and claims take.
	Heap uint64
}

// StrategyPlan is the gang's plans with one strategy.
type StrategyPlan struct {
	Strategy allocator.Strategy
	// Times are the plans, one per run; Outcome is the last plan's (the
	// nodes chosen, or why the gang did not fit).
	Times   []time.Duration
	Outcome string
}

// GangPlan times what gpudra-controller does for each waiting gang
// (gang.Controller.plan): pkg/allocator.Plan of one gang of pods pods with
// gpus whole GPUs each, one group per pod, over nodes migmode-all nodes
// with claims claims allocated. The allocated claims fill nodes in order,
// each node 5 whole GPUs and six 1g.10gb devices of a sixth GPU (11 claims),
// so that the nodes left whole are few and last: the planner meets the
// busy ones first. classes are the chart's DeviceClasses.
func GangPlan(ctx context.Context, classes []*resourceapi.DeviceClass, nodes, claims, pods, gpus, runs int) (GangPlanResult, error) {
	res := GangPlanResult{Nodes: nodes, Pods: pods, GPUs: gpus}
	m, err := newMix(MixMigAll, "")
	if err != nil {
		return res, err
	}
	var before runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	var slices []*resourceapi.ResourceSlice
	var allocated []*resourceapi.ResourceClaim
	var nodeObjs []*v1.Node
	for n := range nodes {
		name := nodeName(n)
		nodeObjs = append(nodeObjs, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"kubernetes.io/hostname": name}}})
		built, err := m.slices(name)
		if err != nil {
			return res, err
		}
		var whole, small []string
		for i := range built {
			s := &built[i]
			s.UID, s.ResourceVersion = types.UID(fmt.Sprintf("%s-%d", name, i)), "1"
			slices = append(slices, s)
			for _, d := range s.Spec.Devices {
				res.Devices++
				if a := d.Attributes["migProfile"]; a.StringValue != nil {
					if *a.StringValue == "1g.10gb" && strings.HasPrefix(d.Name, "gpu-5-") && len(small) < 6 {
						small = append(small, d.Name)
					}
					continue
				}
				if d.Name < "gpu-5" && len(whole) < 5 {
					whole = append(whole, d.Name)
				}
			}
		}
		for _, dev := range append(whole, small...) {
			if len(allocated) == claims {
				break
			}
			allocated = append(allocated, allocatedClaim(fmt.Sprintf("c%05d", len(allocated)), name, dev))
		}
	}
	res.Allocated = len(allocated)
	var gang []allocator.Group
	for i := range pods {
		c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("gang-%d-gpus", i), Namespace: namespace, UID: types.UID(fmt.Sprintf("gang-%d", i))},
			Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{Name: "gpu",
				Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: classGPU, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: int64(gpus)}}}}}}
		gang = append(gang, allocator.Group{Name: fmt.Sprintf("pod g-%d", i), Claims: []*resourceapi.ResourceClaim{c}})
	}
	var after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&after)
	res.Heap = after.HeapAlloc - min(after.HeapAlloc, before.HeapAlloc)
	for _, strategy := range []allocator.Strategy{allocator.FewestNVLinkDomains, allocator.Binpack, allocator.Spread} {
		sp := StrategyPlan{Strategy: strategy}
		for range runs {
			start := time.Now()
			out, err := allocator.Plan(ctx, allocator.Input{Groups: gang, Slices: slices, Classes: classes, Nodes: nodeObjs,
				Allocated: allocated, Strategy: strategy})
			sp.Times = append(sp.Times, time.Since(start))
			var nf *allocator.NotFitError
			switch {
			case errors.As(err, &nf):
				// A finding, not a failure of the benchmark: the planner
				// may give up before the nodes that are left whole.
				sp.Outcome = "does not fit: " + err.Error()
			case err != nil:
				return res, fmt.Errorf("plan the gang (%s): %w", strategy, err)
			default:
				sp.Outcome = fmt.Sprintf("%d nodes (%s..%s)", len(out.Nodes), out.Nodes[0], out.Nodes[len(out.Nodes)-1])
			}
			klog.FromContext(ctx).Info("Gang planned", "strategy", strategy, "elapsed", sp.Times[len(sp.Times)-1].Round(time.Millisecond), "outcome", sp.Outcome)
		}
		res.Plans = append(res.Plans, sp)
	}
	return res, nil
}

// allocatedClaim is a claim with one device of node allocated and
// reserved, as the scheduler leaves it.
func allocatedClaim(name, node, device string) *resourceapi.ResourceClaim {
	class := classGPU
	if strings.Contains(device, "-mig-") {
		class = classMIG
	}
	return &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace, UID: types.UID(name)},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{Name: "gpu",
			Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: class}}}}},
		Status: resourceapi.ResourceClaimStatus{
			Allocation: &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{{
				Request: "gpu", Driver: slicebuilder.DriverName, Pool: node, Device: device}}},
				NodeSelector: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchFields: []v1.NodeSelectorRequirement{{
					Key: "metadata.name", Operator: v1.NodeSelectorOpIn, Values: []string{node}}}}}}},
			ReservedFor: []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: name, UID: types.UID("pod-" + name)}}}}
}

// chartClasses are the DeviceClasses the chart ships, as typed objects.
func chartClasses(ctx context.Context, opts chart.Options, dir string) ([]*resourceapi.DeviceClass, error) {
	rendered, err := chart.Render(ctx, opts, dir)
	if err != nil {
		return nil, err
	}
	f := filepath.Join(dir, "chart-classes.yaml")
	if err := os.WriteFile(f, []byte(rendered), 0o600); err != nil {
		return nil, err
	}
	objs, err := devcluster.Manifests(f)
	if err != nil {
		return nil, err
	}
	var out []*resourceapi.DeviceClass
	for _, o := range objs {
		if o.GetKind() != "DeviceClass" {
			continue
		}
		var c resourceapi.DeviceClass
		if err := runtimeapi.DefaultUnstructuredConverter.FromUnstructured(o.Object, &c); err != nil {
			return nil, fmt.Errorf("DeviceClass %s: %w", o.GetName(), err)
		}
		c.UID, c.ResourceVersion = types.UID(c.Name), "1"
		out = append(out, &c)
	}
	return out, nil
}

// printGangPlan writes the gang planning section.
func printGangPlan(w interface{ Write([]byte) (int, error) }, g *GangPlanResult) {
	if g == nil {
		return
	}
	fmt.Fprintf(w, "## Gang planning: one gang of %d pods x %d GPUs, %d migmode-all nodes (%d devices), %d claims allocated (slices and claims: %.0f MiB of heap)\n\n",
		g.Pods, g.GPUs, g.Nodes, g.Devices, g.Allocated, mib(g.Heap))
	fmt.Fprintln(w, "| strategy | plan ms (each run) | median ms | outcome |")
	fmt.Fprintln(w, "| --- | --- | --- | --- |")
	for _, sp := range g.Plans {
		var times []string
		for _, t := range sp.Times {
			times = append(times, ms(t))
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s |\n", sp.Strategy, strings.Join(times, ", "), ms(prepbench.Percentile(sp.Times, 0.5)), sp.Outcome)
	}
	fmt.Fprintln(w)
}
