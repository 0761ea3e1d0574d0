package dashboard

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/local"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
	"github.com/gpudra/gpudra/pkg/top"
)

var testNow = time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)

// twoGPUs is two H100s without NVLink, the second in MIG mode.
const twoGPUs = "name: dash-test\ngpuCount: 2\nnvlink: none\nmigEnabled: [1]\n"

// nvswitch8 is an HGX H100: 8 GPUs in one NVLink domain.
const nvswitch8 = "name: dash-nvswitch\ngpuCount: 8\nnvlink: nvswitch\n"

// nodeSlices are the slices the kubelet plugin publishes for a simulated
// machine: the real slicebuilder over the simulator's inventory.
func nodeSlices(t testing.TB, node, spec string, opts slicebuilder.Options) []*resourceapi.ResourceSlice {
	t.Helper()
	s, err := sim.ParseSpec([]byte(spec))
	require.NoError(t, err)
	m, err := sim.New(s, node)
	require.NoError(t, err)
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	res, err := slicebuilder.Build(inv, node, opts)
	require.NoError(t, err)
	var out []*resourceapi.ResourceSlice
	for _, sl := range slicebuilder.ResourceSlices(res, node) {
		out = append(out, &sl)
	}
	return out
}

// allocated is a claim allocated on devices of one pool, reserved for pods.
func allocatedClaim(ns, name, pool string, devices []string, pods ...string) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
	c.Spec.Devices.Requests = []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.gpudra.dev", Count: int64(len(devices))}}}
	c.Status.Allocation = &resourceapi.AllocationResult{}
	for _, d := range devices {
		c.Status.Allocation.Devices.Results = append(c.Status.Allocation.Devices.Results,
			resourceapi.DeviceRequestAllocationResult{Request: "gpu", Driver: slicebuilder.DriverName, Pool: pool, Device: d})
	}
	for _, p := range pods {
		c.Status.ReservedFor = append(c.Status.ReservedFor, resourceapi.ResourceClaimConsumerReference{Resource: "pods", Name: p, UID: types.UID(p)})
	}
	return c
}

// pendingClaim is an unallocated claim for count GPUs.
func pendingClaim(ns, name string, count int64) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
	c.Spec.Devices.Requests = []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.gpudra.dev", Count: count}}}
	return c
}

func testPod(ns, name string, edit func(p *corev1.Pod)) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, CreationTimestamp: metav1.NewTime(testNow.Add(-time.Hour))}}
	p.Status.Phase = corev1.PodPending
	if edit != nil {
		edit(p)
	}
	return p
}

// withClaim gives a pod a claim by name.
func withClaim(claim string) func(p *corev1.Pod) {
	return func(p *corev1.Pod) {
		p.Spec.ResourceClaims = append(p.Spec.ResourceClaims, corev1.PodResourceClaim{Name: "gpu", ResourceClaimName: ptr.To(claim)})
	}
}

// gangPod is a gated member of a gang, with the controller's condition.
func gangPod(ns, name, gang, queue, duration, reason, message string, claim string) *corev1.Pod {
	return testPod(ns, name, func(p *corev1.Pod) {
		p.Labels = map[string]string{gpudrav1.LabelGang: gang}
		p.Annotations = map[string]string{}
		if queue != "" {
			p.Annotations[gpudrav1.AnnotationQueue] = queue
		}
		if duration != "" {
			p.Annotations[gpudrav1.AnnotationDuration] = duration
		}
		p.Spec.SchedulingGates = []corev1.PodSchedulingGate{{Name: gpudrav1.SchedulingGate}}
		if reason != "" {
			p.Status.Conditions = []corev1.PodCondition{{Type: gpudrav1.GroupName + "/GangAllocated", Status: corev1.ConditionFalse, Reason: reason, Message: message}}
		}
		withClaim(claim)(p)
	})
}

func testReservation(ns, name, queue string, position int32, duration time.Duration) *gpudrav1.GpuReservation {
	r := &gpudrav1.GpuReservation{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, CreationTimestamp: metav1.NewTime(testNow.Add(-2 * time.Hour))},
		Spec: gpudrav1.GpuReservationSpec{DeviceClassName: "gpu.gpudra.dev", Claims: 2, Count: 4, Queue: queue}}
	r.Status = gpudrav1.GpuReservationStatus{Phase: gpudrav1.ReservationQueued, Reason: gpudrav1.ReasonWaitingForDevices,
		Message: "needs 8 GPUs in one NVLink domain", QueuePosition: position, QueuedAt: &metav1.Time{Time: testNow.Add(-90 * time.Minute)}}
	if duration > 0 {
		r.Spec.Duration = &metav1.Duration{Duration: duration}
	}
	return r
}

// find returns the named node's named GPU.
func findGPU(t *testing.T, v *View, node, gpu string) GPU {
	t.Helper()
	for _, d := range v.Domains {
		for _, n := range d.Nodes {
			if n.Name != node {
				continue
			}
			for _, g := range n.GPUs {
				if g.Name == gpu {
					return g
				}
			}
		}
	}
	t.Fatalf("no GPU %s on node %s in the view", gpu, node)
	return GPU{}
}

func findPlacement(t *testing.T, g GPU, name string) Placement {
	t.Helper()
	for _, p := range g.Placements {
		if p.Name == name {
			return p
		}
	}
	t.Fatalf("no placement %s on %s", name, g.Name)
	return Placement{}
}

func queueNamed(t *testing.T, v *View, name string) Queue {
	t.Helper()
	for _, q := range v.Queues {
		if q.Name == name {
			return q
		}
	}
	t.Fatalf("no queue %q in the view", name)
	return Queue{}
}

func fp(v float64) *float64 { return &v }

func TestBuild(t *testing.T) {
	unhealthy := slicebuilder.Options{Taints: map[string][]resourceapi.DeviceTaint{
		"gpu-0": {{Key: "gpu.gpudra.dev/unhealthy", Value: "xid-79", Effect: resourceapi.DeviceTaintEffectNoSchedule}},
	}}
	for _, tc := range []struct {
		name  string
		in    func(t *testing.T) ClusterInputs
		check func(t *testing.T, v *View)
	}{{
		name: "exclusive GPU: its holder, its pods and gang, the other GPU free",
		in: func(t *testing.T) ClusterInputs {
			return ClusterInputs{Slices: nodeSlices(t, "node-a", twoGPUs, slicebuilder.Options{}),
				Claims: []*resourceapi.ResourceClaim{allocatedClaim("team-a", "train-gpu", "node-a", []string{"gpu-0"}, "train-0")},
				Pods:   []*corev1.Pod{testPod("team-a", "train-0", func(p *corev1.Pod) { p.Labels = map[string]string{gpudrav1.LabelGang: "train"} })}}
		},
		check: func(t *testing.T, v *View) {
			g := findGPU(t, v, "node-a", "gpu-0")
			assert.Equal(t, StateAllocated, g.State)
			require.Len(t, g.Holders, 1)
			assert.Equal(t, Holder{Namespace: "team-a", Claim: "train-gpu", Pods: []string{"train-0"}, Gang: "train",
				Kubectl: "kubectl get resourceclaim -n team-a train-gpu -o yaml"}, g.Holders[0])
			assert.NotEmpty(t, g.UUID)
			assert.Equal(t, "NVIDIA H100 80GB HBM3", g.Model)
			assert.Greater(t, g.MemoryBytes, int64(80e9))
			assert.Equal(t, StateFree, findGPU(t, v, "node-a", "gpu-1").State)
			assert.Equal(t, Summary{Nodes: 1, GPUs: 2, Allocated: 1, Free: 1}, v.Summary)
			assert.Equal(t, "dra", v.Domains[0].Nodes[0].Mode)
			assert.Equal(t, "kubectl get resourceslices --field-selector spec.nodeName=node-a", v.Domains[0].Nodes[0].Kubectl)
		},
	}, {
		name: "claims read in one namespace only: what no visible claim holds is unknown, never free",
		in: func(t *testing.T) ClusterInputs {
			return ClusterInputs{Slices: nodeSlices(t, "node-a", twoGPUs, slicebuilder.Options{}), ClaimsPartial: true,
				Claims: []*resourceapi.ResourceClaim{allocatedClaim("team-a", "train-gpu", "node-a", []string{"gpu-0"}, "train-0")}}
		},
		check: func(t *testing.T, v *View) {
			assert.Equal(t, StateAllocated, findGPU(t, v, "node-a", "gpu-0").State)
			g := findGPU(t, v, "node-a", "gpu-1")
			assert.Equal(t, StateUnknown, g.State)
			for _, p := range g.Placements {
				assert.Equal(t, StateUnknown, p.State, p.Name)
			}
			assert.Equal(t, Summary{Nodes: 1, GPUs: 2, Allocated: 1, Unknown: 1}, v.Summary)
			assert.Contains(t, v.Filters.States, StateUnknown)
		},
	}, {
		name: "device-plugin node: GPUs from its usage read, one with a container's processes held, the other unknown, not free",
		in: func(t *testing.T) ClusterInputs {
			node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "dp-a"}}
			node.Status.Allocatable = corev1.ResourceList{DevicePluginResource: resource.MustParse("2")}
			return ClusterInputs{Nodes: []*corev1.Node{node}, UsageSource: "plugin", Usage: map[string]*top.Snapshot{"dp-a": {Node: "dp-a", Devices: []top.Device{
				{Name: "gpu-0", UUID: "GPU-0", Model: "NVIDIA H100 80GB HBM3", ProcessesRead: true, Holders: []top.Holder{{Pods: []string{"team-a/train/main"}}}},
				{Name: "gpu-1", UUID: "GPU-1", Model: "NVIDIA H100 80GB HBM3", ProcessesRead: true},
			}}}}
		},
		check: func(t *testing.T, v *View) {
			g := findGPU(t, v, "dp-a", "gpu-0")
			assert.Equal(t, StateAllocated, g.State)
			assert.Equal(t, []Holder{{Namespace: "team-a", Pods: []string{"train"}}}, g.Holders)
			assert.Equal(t, StateUnknown, findGPU(t, v, "dp-a", "gpu-1").State)
			assert.Equal(t, "device-plugin", v.Domains[0].Nodes[0].Mode)
			assert.Contains(t, v.Filters.States, StateUnknown)
		},
	}, {
		name: "MIG placements: the held one allocated, those on its slices blocked, the others free",
		in: func(t *testing.T) ClusterInputs {
			return ClusterInputs{Slices: nodeSlices(t, "node-a", twoGPUs, slicebuilder.Options{}),
				Claims: []*resourceapi.ResourceClaim{allocatedClaim("team-b", "small", "node-a", []string{"gpu-1-mig-3g-40gb-4"})}}
		},
		check: func(t *testing.T, v *View) {
			g := findGPU(t, v, "node-a", "gpu-1")
			assert.True(t, g.MIG)
			assert.Equal(t, 8, g.MemorySlices)
			assert.Equal(t, StatePartial, g.State)
			held := findPlacement(t, g, "gpu-1-mig-3g-40gb-4")
			assert.Equal(t, Placement{Name: "gpu-1-mig-3g-40gb-4", Profile: "3g.40gb", Start: 4, Size: 4, State: StateAllocated,
				Holders: []Holder{{Namespace: "team-b", Claim: "small", Kubectl: kubectlClaim("team-b", "small")}}}, held)
			assert.Equal(t, StateBlocked, findPlacement(t, g, "gpu-1-mig-1g-10gb-5").State, "on the held slices")
			assert.Equal(t, StateBlocked, findPlacement(t, g, "gpu-1-mig-7g-80gb-0").State, "the whole GPU's profile overlaps")
			assert.Equal(t, StateFree, findPlacement(t, g, "gpu-1-mig-4g-40gb-0").State, "slices 0-3 are free")
			assert.Equal(t, StateFree, findPlacement(t, g, "gpu-1-mig-1g-10gb-0").State)
			assert.Equal(t, 1, v.Summary.Allocated)
			assert.Equal(t, 1, v.Summary.Free, "gpu-0; gpu-1 is partial")
			for i := 1; i < len(g.Placements); i++ {
				assert.LessOrEqual(t, g.Placements[i-1].Start, g.Placements[i].Start, "placements in slice order")
			}
		},
	}, {
		name: "a whole GPU in MIG mode held: every placement blocked",
		in: func(t *testing.T) ClusterInputs {
			return ClusterInputs{Slices: nodeSlices(t, "node-a", twoGPUs, slicebuilder.Options{}),
				Claims: []*resourceapi.ResourceClaim{allocatedClaim("team-b", "whole", "node-a", []string{"gpu-1"})}}
		},
		check: func(t *testing.T, v *View) {
			g := findGPU(t, v, "node-a", "gpu-1")
			assert.Equal(t, StateAllocated, g.State)
			require.NotEmpty(t, g.Placements)
			for _, p := range g.Placements {
				assert.Equal(t, StateBlocked, p.State, p.Name)
			}
		},
	}, {
		name: "shared: two claims on one GPU, and a claim with a share ID",
		in: func(t *testing.T) ClusterInputs {
			share := allocatedClaim("team-c", "frac", "node-a", []string{"gpu-1-mig-1g-10gb-0"})
			share.Status.Allocation.Devices.Results[0].ShareID = ptr.To(types.UID("s-1"))
			return ClusterInputs{Slices: nodeSlices(t, "node-a", twoGPUs, slicebuilder.Options{}),
				Claims: []*resourceapi.ResourceClaim{allocatedClaim("team-a", "ts-1", "node-a", []string{"gpu-0"}), allocatedClaim("team-b", "ts-2", "node-a", []string{"gpu-0"}), share}}
		},
		check: func(t *testing.T, v *View) {
			g := findGPU(t, v, "node-a", "gpu-0")
			require.Len(t, g.Holders, 2)
			assert.Equal(t, "ts-1", g.Holders[0].Claim)
			assert.True(t, g.Holders[0].Shared)
			assert.True(t, g.Holders[1].Shared)
			p := findPlacement(t, findGPU(t, v, "node-a", "gpu-1"), "gpu-1-mig-1g-10gb-0")
			require.Len(t, p.Holders, 1)
			assert.True(t, p.Holders[0].Shared)
		},
	}, {
		name: "an exclusive claim is not shared",
		in: func(t *testing.T) ClusterInputs {
			return ClusterInputs{Slices: nodeSlices(t, "node-a", twoGPUs, slicebuilder.Options{}),
				Claims: []*resourceapi.ResourceClaim{allocatedClaim("team-a", "only", "node-a", []string{"gpu-0"})}}
		},
		check: func(t *testing.T, v *View) {
			assert.False(t, findGPU(t, v, "node-a", "gpu-0").Holders[0].Shared)
		},
	}, {
		name: "unhealthy taint: state, health, summary; the holder still shows",
		in: func(t *testing.T) ClusterInputs {
			return ClusterInputs{Slices: nodeSlices(t, "node-a", twoGPUs, unhealthy),
				Claims: []*resourceapi.ResourceClaim{allocatedClaim("team-a", "hit", "node-a", []string{"gpu-0"})}}
		},
		check: func(t *testing.T, v *View) {
			g := findGPU(t, v, "node-a", "gpu-0")
			assert.Equal(t, StateUnhealthy, g.State)
			assert.Equal(t, "gpu.gpudra.dev/unhealthy=xid-79", g.Health)
			assert.Len(t, g.Holders, 1)
			assert.Equal(t, Summary{Nodes: 1, GPUs: 2, Allocated: 1, Free: 1, Unhealthy: 1}, v.Summary)
		},
	}, {
		name: "slices forbidden: the devices of the claims, under their pools' nodes",
		in: func(t *testing.T) ClusterInputs {
			return ClusterInputs{Notes: []string{"ResourceSlices: forbidden"},
				Claims: []*resourceapi.ResourceClaim{allocatedClaim("team-a", "one", "node-b", []string{"gpu-3"}), allocatedClaim("team-a", "mig", "node-b", []string{"gpu-2-mig-3g-40gb-4"})}}
		},
		check: func(t *testing.T, v *View) {
			assert.Equal(t, StateAllocated, findGPU(t, v, "node-b", "gpu-3").State)
			g := findGPU(t, v, "node-b", "gpu-2")
			assert.Equal(t, StatePartial, g.State)
			assert.True(t, g.MIG)
			p := findPlacement(t, g, "gpu-2-mig-3g-40gb-4")
			assert.Equal(t, "3g.40gb", p.Profile)
			assert.Equal(t, [2]int{4, 4}, [2]int{p.Start, p.Size})
			assert.Equal(t, []string{"ResourceSlices: forbidden"}, v.Notes)
			assert.Equal(t, 2, v.Summary.GPUs)
		},
	}, {
		name: "NVLink domains: nodes grouped, the nodes in none last",
		in: func(t *testing.T) ClusterInputs {
			var sl []*resourceapi.ResourceSlice
			sl = append(sl, nodeSlices(t, "node-z", nvswitch8, slicebuilder.Options{})...)
			sl = append(sl, nodeSlices(t, "node-a", twoGPUs, slicebuilder.Options{})...)
			return ClusterInputs{Slices: sl}
		},
		check: func(t *testing.T, v *View) {
			require.Len(t, v.Domains, 2)
			assert.NotEmpty(t, v.Domains[0].Name)
			assert.Equal(t, "node-z", v.Domains[0].Nodes[0].Name)
			assert.Equal(t, "", v.Domains[1].Name)
			assert.Equal(t, "node-a", v.Domains[1].Nodes[0].Name)
			var names []string
			for _, g := range v.Domains[0].Nodes[0].GPUs {
				names = append(names, g.Name)
			}
			assert.Equal(t, []string{"gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5", "gpu-6", "gpu-7"}, names)
			assert.Equal(t, []string{"node-a", "node-z"}, v.Filters.Nodes)
		},
	}, {
		name: "classes by the classes' own CEL",
		in: func(t *testing.T) ClusterInputs {
			return ClusterInputs{Slices: nodeSlices(t, "node-a", twoGPUs, slicebuilder.Options{}), DeviceClasses: local.Classes()}
		},
		check: func(t *testing.T, v *View) {
			assert.Equal(t, []string{"gpu-mps.gpudra.dev", "gpu-timesliced.gpudra.dev", "gpu.gpudra.dev"}, findGPU(t, v, "node-a", "gpu-0").Classes)
			assert.Contains(t, findGPU(t, v, "node-a", "gpu-1").Classes, "mig.gpudra.dev")
			assert.Equal(t, []string{"gpu-mps.gpudra.dev", "gpu-timesliced.gpudra.dev", "gpu.gpudra.dev", "mig.gpudra.dev"}, v.Filters.Classes)
		},
	}, {
		name: "usage: read figures, the sparkline, claimed-but-idle; nothing read is no usage",
		in: func(t *testing.T) ClusterInputs {
			sl := append(nodeSlices(t, "node-a", twoGPUs, slicebuilder.Options{}), nodeSlices(t, "node-b", twoGPUs, slicebuilder.Options{})...)
			return ClusterInputs{Slices: sl, UsageSource: "plugin",
				Claims: []*resourceapi.ResourceClaim{allocatedClaim("team-a", "idle", "node-a", []string{"gpu-0"}), allocatedClaim("team-a", "busy", "node-a", []string{"gpu-1-mig-3g-40gb-4"})},
				Usage: map[string]*top.Snapshot{"node-a": {Node: "node-a", Devices: []top.Device{
					{Name: "gpu-0", Utilization: fp(0), MemoryUsedBytes: fp(1 << 30), MemoryTotalBytes: fp(80 << 30)},
					{Name: "gpu-1-mig-3g-40gb-4", SMActive: fp(0.4)},
				}, Notes: []string{"the plugin exports no process attribution: no processes shown"}}},
				Spark: map[string][]*float64{SparkKey("node-a", "gpu-0"): {nil, fp(0), fp(0)}}}
		},
		check: func(t *testing.T, v *View) {
			g := findGPU(t, v, "node-a", "gpu-0")
			require.NotNil(t, g.Usage)
			assert.Equal(t, 0.0, *g.Usage.Utilization)
			assert.Equal(t, float64(1<<30), *g.Usage.MemoryUsedBytes)
			assert.Nil(t, g.Usage.PowerWatts, "not read is absent, not 0")
			assert.Len(t, g.Usage.Spark, 3)
			assert.True(t, g.IdleClaimed)
			mig := findGPU(t, v, "node-a", "gpu-1")
			assert.False(t, mig.IdleClaimed, "its MIG device is busy")
			assert.Equal(t, 0.4, *findPlacement(t, mig, "gpu-1-mig-3g-40gb-4").Usage.SMActive)
			assert.Nil(t, findGPU(t, v, "node-b", "gpu-0").Usage, "node-b was not read")
			assert.Equal(t, 1, v.Summary.IdleClaimed)
			assert.Equal(t, "plugin", v.Domains[0].Nodes[0].UsageSource)
			assert.Equal(t, "", v.Domains[0].Nodes[1].UsageSource)
			assert.Equal(t, []string{"node-a: the plugin exports no process attribution: no processes shown"}, v.Notes)
		},
	}, {
		name: "a GPU busy once in its sparkline is not idle",
		in: func(t *testing.T) ClusterInputs {
			return ClusterInputs{Slices: nodeSlices(t, "node-a", twoGPUs, slicebuilder.Options{}),
				Claims: []*resourceapi.ResourceClaim{allocatedClaim("team-a", "idle", "node-a", []string{"gpu-0"})},
				Usage:  map[string]*top.Snapshot{"node-a": {Devices: []top.Device{{Name: "gpu-0", Utilization: fp(0)}}}},
				Spark:  map[string][]*float64{SparkKey("node-a", "gpu-0"): {fp(0.9), fp(0)}}}
		},
		check: func(t *testing.T, v *View) {
			assert.False(t, findGPU(t, v, "node-a", "gpu-0").IdleClaimed)
		},
	}, {
		name: "gang in its queue with the controller's position and reason; reservation queued ahead; estimates from durations",
		in: func(t *testing.T) ClusterInputs {
			msg := "position 2 in queue training: 8 GPUs in one NVLink domain are not free"
			return ClusterInputs{Now: testNow,
				Queues:       []*gpudrav1.GpuQueue{{ObjectMeta: metav1.ObjectMeta{Name: "training"}, Spec: gpudrav1.GpuQueueSpec{Policy: gpudrav1.Priority}}},
				Reservations: []*gpudrav1.GpuReservation{testReservation("team-r", "hold", "training", 1, 30*time.Minute)},
				Claims:       []*resourceapi.ResourceClaim{pendingClaim("team-g", "w-0", 4), pendingClaim("team-g", "w-1", 4)},
				Pods: []*corev1.Pod{
					gangPod("team-g", "w-1", "llm", "training", "2h", gpudrav1.ReasonBehindInQueue, msg, "w-1"),
					gangPod("team-g", "w-0", "llm", "training", "2h", gpudrav1.ReasonBehindInQueue, msg, "w-0"),
				}}
		},
		check: func(t *testing.T, v *View) {
			q := queueNamed(t, v, "training")
			assert.True(t, q.Exists)
			assert.Equal(t, "Priority", q.Policy)
			assert.Equal(t, "kubectl get gpuqueue training -o yaml", q.Kubectl)
			require.Len(t, q.Items, 2)
			res, gang := q.Items[0], q.Items[1]
			assert.Equal(t, "GpuReservation", res.Kind)
			assert.Equal(t, 1, res.Position)
			assert.Equal(t, int64(8), res.Devices)
			assert.Equal(t, gpudrav1.ReasonWaitingForDevices, res.Reason)
			assert.Equal(t, "30m0s", res.Duration)
			assert.Equal(t, testNow, *res.EstimatedStart)
			assert.Equal(t, testNow.Add(-90*time.Minute), *res.Since)
			assert.Equal(t, "kubectl get gpureservation -n team-r hold -o yaml", res.Kubectl)
			assert.Equal(t, QueueItem{Kind: "Gang", Namespace: "team-g", Name: "llm", Position: 2, Reason: gpudrav1.ReasonBehindInQueue,
				Message: "8 GPUs in one NVLink domain are not free", Devices: 8, Since: ptr.To(testNow.Add(-time.Hour)), Duration: "2h0m0s",
				EstimatedStart: ptr.To(testNow.Add(30 * time.Minute)), Kubectl: "kubectl get pods -n team-g -l gpudra.dev/gang=llm"}, gang)
			assert.Equal(t, 2, v.Summary.Waiting)
		},
	}, {
		name: "a gang the controller let go leaves its queue; stale positions never put two items at one place",
		in: func(t *testing.T) ClusterInputs {
			// After gang a was admitted, a-0 runs while a-1 still carries the
			// gate and its old condition; b's condition says position 1 already.
			// c and d both say 2: written before and after an item left.
			first := "position 1 in queue training: 8 GPUs are not free"
			second := "position 2 in queue training: 8 GPUs are not free"
			return ClusterInputs{Now: testNow,
				Claims: []*resourceapi.ResourceClaim{pendingClaim("ns", "a-0", 4), pendingClaim("ns", "a-1", 4), pendingClaim("ns", "b-0", 4),
					pendingClaim("ns", "c-0", 4), pendingClaim("ns", "d-0", 4)},
				Pods: []*corev1.Pod{
					func() *corev1.Pod {
						p := gangPod("ns", "a-0", "a", "training", "", gpudrav1.ReasonWaitingForDevices, first, "a-0")
						p.Spec.SchedulingGates, p.Spec.NodeName = nil, "node-a"
						p.Status.Conditions[0].Status = corev1.ConditionTrue
						return p
					}(),
					gangPod("ns", "a-1", "a", "training", "", gpudrav1.ReasonWaitingForDevices, first, "a-1"),
					gangPod("ns", "b-0", "b", "training", "", gpudrav1.ReasonWaitingForDevices, first, "b-0"),
					gangPod("ns", "c-0", "c", "training", "", gpudrav1.ReasonBehindInQueue, second, "c-0"),
					gangPod("ns", "d-0", "d", "training", "", gpudrav1.ReasonBehindInQueue, second, "d-0"),
				}}
		},
		check: func(t *testing.T, v *View) {
			q := queueNamed(t, v, "training")
			var got []string
			for _, it := range q.Items {
				got = append(got, fmt.Sprintf("%d %s", it.Position, it.Name))
			}
			assert.Equal(t, []string{"1 b", "2 c", "3 d"}, got)
		},
	}, {
		name: "estimates stop after an item without a declared duration; a queue with no GpuQueue",
		in: func(t *testing.T) ClusterInputs {
			return ClusterInputs{Now: testNow, Reservations: []*gpudrav1.GpuReservation{
				testReservation("ns", "first", "", 1, 0), testReservation("ns", "second", "", 2, time.Hour), testReservation("ns", "third", "", 3, time.Hour)}}
		},
		check: func(t *testing.T, v *View) {
			q := queueNamed(t, v, "default")
			assert.False(t, q.Exists)
			assert.Equal(t, "FCFS", q.Policy)
			require.Len(t, q.Items, 3)
			assert.Equal(t, testNow, *q.Items[0].EstimatedStart, "the head starts now")
			assert.Nil(t, q.Items[1].EstimatedStart, "behind one that declares no duration")
			assert.Nil(t, q.Items[2].EstimatedStart)
		},
	}, {
		name: "a held reservation is not waiting",
		in: func(t *testing.T) ClusterInputs {
			r := testReservation("ns", "held", "", 0, 0)
			r.Status.Phase = gpudrav1.ReservationHeld
			return ClusterInputs{Reservations: []*gpudrav1.GpuReservation{r}}
		},
		check: func(t *testing.T, v *View) {
			assert.Empty(t, v.Queues)
			assert.Zero(t, v.Summary.Waiting)
		},
	}, {
		name: "a pending pod with claims in no gang: the scheduler's reason, not queued",
		in: func(t *testing.T) ClusterInputs {
			return ClusterInputs{Claims: []*resourceapi.ResourceClaim{pendingClaim("team-p", "nb", 1)},
				Pods: []*corev1.Pod{
					testPod("team-p", "notebook", func(p *corev1.Pod) {
						withClaim("nb")(p)
						p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionFalse, Reason: "Unschedulable",
							Message: "0/3 nodes are available: 3 cannot allocate all claims."}}
					}),
					testPod("team-p", "cpu-only", nil),
					testPod("team-p", "running", func(p *corev1.Pod) { withClaim("nb")(p); p.Spec.NodeName = "node-a" }),
				}}
		},
		check: func(t *testing.T, v *View) {
			q := queueNamed(t, v, "")
			assert.False(t, q.Exists)
			require.Len(t, q.Items, 1)
			assert.Equal(t, QueueItem{Kind: "Pod", Namespace: "team-p", Name: "notebook", Reason: "Unschedulable",
				Message: "0/3 nodes are available: 3 cannot allocate all claims.", Devices: 1, Since: ptr.To(testNow.Add(-time.Hour)),
				Kubectl: "kubectl describe pod -n team-p notebook"}, q.Items[0])
			assert.Zero(t, v.Summary.Waiting, "not queued")
		},
	}, {
		name: "the namespace filter lists holders' and waiters' namespaces once, sorted; states always offered",
		in: func(t *testing.T) ClusterInputs {
			return ClusterInputs{Slices: nodeSlices(t, "node-a", twoGPUs, slicebuilder.Options{}),
				Claims: []*resourceapi.ResourceClaim{allocatedClaim("zeta", "a", "node-a", []string{"gpu-0"}), allocatedClaim("alpha", "b", "node-a", []string{"gpu-1-mig-1g-10gb-0"}),
					allocatedClaim("zeta", "c", "node-a", []string{"gpu-1-mig-1g-10gb-1"}), pendingClaim("mid", "p", 1)},
				Reservations: []*gpudrav1.GpuReservation{testReservation("queued-ns", "r", "", 1, 0)},
				Pods:         []*corev1.Pod{testPod("mid", "p", withClaim("p"))}}
		},
		check: func(t *testing.T, v *View) {
			assert.Equal(t, []string{"alpha", "mid", "queued-ns", "zeta"}, v.Filters.Namespaces)
			assert.Equal(t, []string{StateFree, StatePartial, StateAllocated, StateBlocked, StateUnhealthy}, v.Filters.States)
		},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			in := tc.in(t)
			v := Build(in)
			assert.Equal(t, "cluster", v.Mode)
			tc.check(t, v)
		})
	}
}

// TestBuildIsPure: the same inputs give the same View, and Build changes
// none of them (the informers' objects are shared).
func TestBuildIsPure(t *testing.T) {
	in := ClusterInputs{Now: testNow, Slices: nodeSlices(t, "node-a", twoGPUs, slicebuilder.Options{}),
		Claims: []*resourceapi.ResourceClaim{allocatedClaim("a", "x", "node-a", []string{"gpu-0"}), allocatedClaim("b", "y", "node-a", []string{"gpu-0"})}}
	before := in.Claims[0].DeepCopy()
	v1, v2 := Build(in), Build(in)
	assert.Equal(t, v1, v2)
	assert.Equal(t, before, in.Claims[0])
}

// fleet is n nodes of 8 GPUs (every fourth node with 2 GPUs in MIG mode),
// one claim per GPU or MIG device held: what the benchmark builds.
func buildFleet(b testing.TB, nodes int) ClusterInputs {
	plain := nodeSlices(b, "tmpl", "name: f\ngpuCount: 8\nnvlink: nvswitch\n", slicebuilder.Options{})
	mig := nodeSlices(b, "tmpl", "name: f\ngpuCount: 8\nnvlink: nvswitch\nmigEnabled: [6, 7]\n", slicebuilder.Options{})
	in := ClusterInputs{Now: testNow, DeviceClasses: local.Classes(), Usage: map[string]*top.Snapshot{}, UsageSource: "plugin", Spark: map[string][]*float64{}}
	for i := range nodes {
		node := fmt.Sprintf("node-%04d", i)
		tmpl := plain
		if i%4 == 0 {
			tmpl = mig
		}
		for _, s := range tmpl {
			c := *s
			c.Name = node + "-" + s.Name
			c.Spec.NodeName = ptr.To(node)
			c.Spec.Pool.Name = node
			in.Slices = append(in.Slices, &c)
		}
		snap := &top.Snapshot{Node: node}
		for g := range 8 {
			dev := fmt.Sprintf("gpu-%d", g)
			if i%4 == 0 && g >= 6 {
				dev = fmt.Sprintf("gpu-%d-mig-1g-10gb-%d", g, i%7)
			}
			ns := fmt.Sprintf("team-%d", i%40)
			name := fmt.Sprintf("c-%d-%d", i, g)
			in.Claims = append(in.Claims, allocatedClaim(ns, name, node, []string{dev}, name+"-pod"))
			in.Pods = append(in.Pods, testPod(ns, name+"-pod", func(p *corev1.Pod) { p.Spec.NodeName = node; p.Status.Phase = corev1.PodRunning }))
			snap.Devices = append(snap.Devices, top.Device{Name: dev, Utilization: fp(float64(g) / 8), MemoryUsedBytes: fp(1e9)})
			in.Spark[SparkKey(node, dev)] = []*float64{fp(0), fp(0.5)}
		}
		in.Usage[node] = snap
	}
	return in
}

func BenchmarkBuild1000Nodes(b *testing.B) {
	in := buildFleet(b, 1000)
	require.Len(b, in.Claims, 8000)
	v := Build(in)
	require.Equal(b, 8000, v.Summary.GPUs)
	require.Equal(b, 8000, v.Summary.Allocated)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		Build(in)
	}
}
