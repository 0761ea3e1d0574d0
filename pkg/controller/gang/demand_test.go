package gang

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

func TestNodePool(t *testing.T) {
	for _, tc := range []struct {
		name   string
		labels map[string]string
		want   string
	}{
		{"karpenter", map[string]string{"karpenter.sh/nodepool": "gpu-spot"}, "gpu-spot"},
		{"the first key wins", map[string]string{"cloud.google.com/gke-nodepool": "b", "eks.amazonaws.com/nodegroup": "a"}, "a"},
		{"none of them", map[string]string{"kubernetes.io/hostname": "n1"}, ""},
		{"no labels", nil, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, NodePool(tc.labels, DefaultNodePoolLabels))
		})
	}
}

func poolNode(name, pool string) *corev1.Node {
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if pool != "" {
		n.Labels = map[string]string{"karpenter.sh/nodepool": pool}
	}
	return n
}

// TestClassCounterNodePools: devices are counted in their node's pool,
// whether the node or its slices come first; a node relabelled moves its
// devices, a node deleted leaves them in pool "", and a pool with no device
// left has no count.
func TestClassCounterNodePools(t *testing.T) {
	ctx := context.Background()
	counter := newClassCounter(cel.NewCache(10, cel.Features{}), DefaultNodePoolLabels...)
	counter.upsertClass(ctx, celClass("gpu.gpudra.dev", `device.attributes["gpu.gpudra.dev"].type == "gpu"`))
	gpus := func(free, allocated int) classCount { return classCount{free: free, allocated: allocated} }
	slicesOf := map[string][]*resourceapi.ResourceSlice{}
	publish := func(node string) {
		slicesOf[node] = nodeSlices(t, "dgx-h100-nomig", node, slicebuilder.Options{})
		for _, s := range slicesOf[node] {
			counter.upsertSlice(ctx, s)
		}
	}
	type want map[classPool]classCount
	steps := []struct {
		name string
		do   func()
		want want
	}{
		{"a node, then its slices", func() { counter.upsertNode(poolNode("a", "spot")); publish("a") },
			want{{"gpu.gpudra.dev", ""}: {}, {"gpu.gpudra.dev", "spot"}: gpus(8, 0)}},
		{"slices, then their node", func() { publish("b"); counter.upsertNode(poolNode("b", "ondemand")) },
			want{{"gpu.gpudra.dev", ""}: {}, {"gpu.gpudra.dev", "spot"}: gpus(8, 0), {"gpu.gpudra.dev", "ondemand"}: gpus(8, 0)}},
		{"a node without a pool label", func() { counter.upsertNode(poolNode("c", "")); publish("c") },
			want{{"gpu.gpudra.dev", ""}: gpus(8, 0), {"gpu.gpudra.dev", "spot"}: gpus(8, 0), {"gpu.gpudra.dev", "ondemand"}: gpus(8, 0)}},
		{"an allocation counts in its node's pool", func() {
			cl := allocatedClaim("x", "gpu-0")
			cl.Status.Allocation.Devices.Results[0].Pool = "a"
			counter.upsertClaim(cl)
		}, want{{"gpu.gpudra.dev", ""}: gpus(8, 0), {"gpu.gpudra.dev", "spot"}: gpus(7, 1), {"gpu.gpudra.dev", "ondemand"}: gpus(8, 0)}},
		{"relabelled: the devices move, with their state", func() { counter.upsertNode(poolNode("a", "ondemand")) },
			want{{"gpu.gpudra.dev", ""}: gpus(8, 0), {"gpu.gpudra.dev", "ondemand"}: gpus(15, 1)}},
		{"node deleted: its devices in pool \"\"", func() { counter.deleteNode(poolNode("b", "ondemand")) },
			want{{"gpu.gpudra.dev", ""}: gpus(16, 0), {"gpu.gpudra.dev", "ondemand"}: gpus(7, 1)}},
		{"slices deleted", func() {
			for _, s := range slicesOf["a"] {
				counter.deleteSlice(s)
			}
		}, want{{"gpu.gpudra.dev", ""}: gpus(16, 0)}},
	}
	for _, s := range steps {
		s.do()
		require.Equal(t, map[classPool]classCount(s.want), counter.snapshotByPool(), s.name)
	}
	assert.False(t, counter.upsertNode(poolNode("c", "")), "an unchanged pool costs nothing")
}

func pendingPod(name string, nodeSelector map[string]string, claims ...string) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns"}, Spec: corev1.PodSpec{NodeSelector: nodeSelector}}
	for _, c := range claims {
		p.Spec.ResourceClaims = append(p.Spec.ResourceClaims, corev1.PodResourceClaim{Name: c, ResourceClaimName: ptr.To(c)})
	}
	return p
}

func askClaim(name string, requests ...resourceapi.DeviceRequest) *resourceapi.ResourceClaim {
	return &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", UID: types.UID("uid-" + name)},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: requests}}}
}

func exactly(class string, count int64) resourceapi.DeviceRequest {
	return resourceapi.DeviceRequest{Name: "r", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: class, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: count}}
}

func TestPendingDemand(t *testing.T) {
	const gpu, mig = "gpu.gpudra.dev", "mig.gpudra.dev"
	allocated := askClaim("done", exactly(gpu, 1))
	allocated.Status.Allocation = &resourceapi.AllocationResult{}
	claims := map[string]*resourceapi.ResourceClaim{
		"two":  askClaim("two", exactly(gpu, 2)),
		"done": allocated,
		"mixed": askClaim("mixed", exactly(mig, 0), resourceapi.DeviceRequest{Name: "f", FirstAvailable: []resourceapi.DeviceSubRequest{
			{Name: "big", DeviceClassName: gpu, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 4},
			{Name: "small", DeviceClassName: mig, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1}}}),
		"all":     askClaim("all", resourceapi.DeviceRequest{Name: "a", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: gpu, AllocationMode: resourceapi.DeviceAllocationModeAll}}),
		"made-ab": askClaim("made-ab", exactly(mig, 3)),
	}
	lookup := func(_, name string) *resourceapi.ResourceClaim { return claims[name] }
	fromTemplate := pendingPod("t", nil)
	fromTemplate.Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "ab", ResourceClaimTemplateName: ptr.To("tmpl")}}
	notMadeYet := fromTemplate.DeepCopy()
	fromTemplate.Status.ResourceClaimStatuses = []corev1.PodResourceClaimStatus{{Name: "ab", ResourceClaimName: ptr.To("made-ab")}}
	for _, tc := range []struct {
		name string
		pods []*corev1.Pod
		want map[demandKey]float64
	}{
		{"nothing pending", nil, map[demandKey]float64{}},
		{"an unallocated claim, counted in the pool the pod selects",
			[]*corev1.Pod{pendingPod("p", map[string]string{"karpenter.sh/nodepool": "spot"}, "two")},
			map[demandKey]float64{{gpu, "spot", DemandPendingPods}: 2}},
		{"a claim two pods share counts once", []*corev1.Pod{pendingPod("p", nil, "two"), pendingPod("q", nil, "two")},
			map[demandKey]float64{{gpu, "", DemandPendingPods}: 2}},
		{"an allocated claim is no demand", []*corev1.Pod{pendingPod("p", nil, "done")}, map[demandKey]float64{}},
		{"a missing claim is not counted yet", []*corev1.Pod{pendingPod("p", nil, "gone")}, map[demandKey]float64{}},
		{"count 0 is 1; a prioritized list asks for its first choice",
			[]*corev1.Pod{pendingPod("p", nil, "mixed")}, map[demandKey]float64{{mig, "", DemandPendingPods}: 1, {gpu, "", DemandPendingPods}: 4}},
		{"allocationMode All has no count", []*corev1.Pod{pendingPod("p", nil, "all")}, map[demandKey]float64{}},
		{"a template's claim, once made", []*corev1.Pod{fromTemplate}, map[demandKey]float64{{mig, "", DemandPendingPods}: 3}},
		{"a template's claim not made yet", []*corev1.Pod{notMadeYet}, map[demandKey]float64{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, pendingDemand(tc.pods, lookup, DefaultNodePoolLabels))
		})
	}
}

func TestPendingIndex(t *testing.T) {
	bound := pendingPod("b", nil, "c")
	bound.Spec.NodeName = "n1"
	ended := pendingPod("e", nil, "c")
	ended.Status.Phase = corev1.PodSucceeded
	for _, tc := range []struct {
		name string
		pod  *corev1.Pod
		want []string
	}{
		{"pending with a claim", pendingPod("p", nil, "c"), []string{"pending"}},
		{"no claim", pendingPod("p", nil), nil},
		{"bound", bound, nil},
		{"ended", ended, nil},
		{"a gang's member: its gang's demand", plain("g", "gang", "2", "c"), nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := pendingWithClaims(tc.pod)
			require.NoError(t, err)
			assert.Equal(t, tc.want, got)
		})
	}
}

// TestDemandGauges: a round sets gpudra_class_demand_devices from the
// queued reservation and the pending pod, zero for the sources nothing
// waits on; once they are gone, the next round says zero and leaves no
// pool series behind.
func TestDemandGauges(t *testing.T) {
	queuedAt := metav1.NewTime(t0.Add(-time.Minute))
	r := &gpudrav1.GpuReservation{TypeMeta: metav1.TypeMeta{APIVersion: gpudrav1.APIVersion, Kind: gpudrav1.KindGpuReservation},
		ObjectMeta: metav1.ObjectMeta{Name: "r", Namespace: "ns", UID: "uid-r", CreationTimestamp: queuedAt},
		Spec:       gpudrav1.GpuReservationSpec{DeviceClassName: "gpu.gpudra.dev", Claims: 2, Count: 1, TTL: metav1.Duration{Duration: time.Hour}},
		Status:     gpudrav1.GpuReservationStatus{Phase: gpudrav1.ReservationQueued, QueuedAt: &queuedAt}}
	p := pendingPod("p", map[string]string{"karpenter.sh/nodepool": "spot"}, "c")
	h := newRoundHarness(t, p, askClaim("c", exactly("gpu.gpudra.dev", 3)))
	reg := prometheus.NewRegistry()
	m, err := newMetrics(reg)
	require.NoError(t, err)
	h.c.metrics = m
	h.c.counter.upsertClass(context.Background(), celClass("gpu.gpudra.dev", `device.attributes["gpu.gpudra.dev"].type == "gpu"`))
	h.withReservations(t, r)
	_ = h.round(t)

	demand := func(pool, source string) float64 {
		return testutil.ToFloat64(h.c.metrics.demand.WithLabelValues("gpu.gpudra.dev", pool, source))
	}
	assert.Equal(t, 2.0, demand("", DemandReservations), "the queued reservation's devices")
	assert.Equal(t, 3.0, demand("spot", DemandPendingPods), "the pending pod's claim")
	assert.Equal(t, 0.0, demand("", DemandGangs), "no gang waits: zero, not absent")
	assert.Equal(t, 0.0, demand("", DemandPendingPods))
	assert.Equal(t, 4, testutil.CollectAndCount(reg, "gpudra_class_demand_devices"))

	// The pod and the reservation go.
	require.NoError(t, h.client.CoreV1().Pods("ns").Delete(context.Background(), "p", metav1.DeleteOptions{}))
	h.withReservations(t)
	require.NoError(t, h.c.reservations.Replace(nil, ""))
	_ = h.round(t)
	assert.Equal(t, 3, testutil.CollectAndCount(reg, "gpudra_class_demand_devices"), "the spot series is gone")
	assert.Equal(t, 0.0, demand("", DemandReservations))
}
