package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	schedulingv1 "k8s.io/api/scheduling/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/controller"
	"github.com/gpudra/gpudra/pkg/controller/gang"
)

// nomigNode has eight whole H100s on one NVLink domain and nothing else:
// the gang tests pin their pods there so that they know its capacity.
const nomigNode = "dgx-h100-1"

func dyn(t testing.TB) dynamic.Interface {
	t.Helper()
	d, err := dynamic.NewForConfig(cluster.RESTConfig)
	require.NoError(t, err)
	return d
}

// gangPod is a pod of a plain gang with count GPUs from its own claim.
func gangPod(name, gangName string, size int, template string, mutate func(*v1.Pod)) *v1.Pod {
	p := gpuPod(name, template)
	p.Labels = map[string]string{gpudrav1.LabelGang: gangName}
	p.Annotations = map[string]string{gpudrav1.AnnotationGangSize: fmt.Sprint(size)}
	if mutate != nil {
		mutate(p)
	}
	return p
}

func pinned(node string) func(*v1.Pod) {
	return func(p *v1.Pod) { p.Spec.NodeSelector = map[string]string{"kubernetes.io/hostname": node} }
}

func gpus(name string, count int64) *resourceapi.ResourceClaimTemplate {
	return template(name, resourceapi.DeviceRequest{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{
		DeviceClassName: "gpu.gpudra.dev", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: count}}, nil, nil)
}

// gangCondition waits for a pod's gpudra.dev/GangAllocated condition to have
// the status and, when not empty, the reason.
func gangCondition(t *testing.T, ns, pod string, status v1.ConditionStatus, reason string) v1.PodCondition {
	t.Helper()
	var got v1.PodCondition
	var last *v1.Pod
	err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		p, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, pod, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		last = p
		for _, c := range p.Status.Conditions {
			if c.Type == gang.PodConditionGang && c.Status == status && (reason == "" || c.Reason == reason) {
				got = c
				return true, nil
			}
		}
		return false, nil
	})
	require.NoError(t, err, "pod %s/%s: no gang condition %s/%s: %s", ns, pod, status, reason, describe(last))
	return got
}

func gatedByGpudra(p *v1.Pod) bool {
	return slices.ContainsFunc(p.Spec.SchedulingGates, func(g v1.PodSchedulingGate) bool { return g.Name == gpudrav1.SchedulingGate })
}

// gangDevices returns the node and NVLink domain of every device of the
// pods' claims.
func gangDevices(t *testing.T, pods []*v1.Pod) (nodes, domains map[string]bool, devices int) {
	t.Helper()
	nodes, domains = map[string]bool{}, map[string]bool{}
	for _, p := range pods {
		for _, st := range p.Status.ResourceClaimStatuses {
			require.NotNil(t, st.ResourceClaimName)
			claim, err := cluster.Client.ResourceV1().ResourceClaims(p.Namespace).Get(context.Background(), *st.ResourceClaimName, metav1.GetOptions{})
			require.NoError(t, err)
			require.NotNil(t, claim.Status.Allocation, "claim %s", claim.Name)
			for _, r := range claim.Status.Allocation.Devices.Results {
				nodes[r.Pool] = true
				domains[attr(device(t, r.Pool, r.Device), "nvlinkDomain")] = true
				devices++
			}
		}
		assert.Equal(t, p.Spec.NodeName, firstKey(nodes), "pod %s runs where its devices are", p.Name)
	}
	return nodes, domains, devices
}

func firstKey(m map[string]bool) string {
	for k := range m {
		return k
	}
	return ""
}

func TestGangGrovePodGangLandsAllOrNothingOnOneNVLinkDomain(t *testing.T) {
	onGangPath(t, controller.GangModeGates)
	ns := namespace(t)
	ctx := context.Background()
	apply(t, ns, filepath.Join(examples, "gang", "podcliqueset.yaml"))
	t.Cleanup(func() {
		_ = dyn(t).Resource(schema.GroupVersionResource{Group: "grove.io", Version: "v1alpha1", Resource: "podcliquesets"}).Namespace(ns).
			Delete(ctx, "disagg", metav1.DeleteOptions{})
	})
	pods := runningPodGangPods(t, ns, "disagg-0", 8)
	// Both cliques are in one PodGang, planned as one.
	for _, p := range pods {
		assert.Equal(t, "disagg-0", p.Labels["grove.io/podgang"])
		assert.False(t, gatedByGpudra(p), "pod %s: gpudra's gate lifted", p.Name)
		gangCondition(t, ns, p.Name, v1.ConditionTrue, gang.ReasonGangAllocated)
	}
	nodes, domains, devices := gangDevices(t, pods)
	assert.Equal(t, 8, devices)
	assert.Len(t, domains, 1, "one NVLink domain: %v", domains)
	assert.Len(t, nodes, 1, "one node: %v", nodes)
}

// runningPodGangPods waits for n running pods of a Grove PodGang (Grove
// names pods <clique>-<random>: they are found by their PodGang label).
func runningPodGangPods(t *testing.T, ns, podGang string, n int) []*v1.Pod {
	t.Helper()
	var pods []*v1.Pod
	require.NoError(t, wait.PollUntilContextTimeout(context.Background(), 200*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		list, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "grove.io/podgang=" + podGang})
		if err != nil {
			return false, nil
		}
		pods = nil
		for i := range list.Items {
			if list.Items[i].Status.Phase == v1.PodRunning {
				pods = append(pods, &list.Items[i])
			}
		}
		return len(pods) == n, nil
	}), "%d pods of PodGang %s running: %s", n, podGang, podStates(ns))
	return pods
}

// TestGangExamplePlainPods: the example on the gate path (the Workload API
// path runs it in TestWorkloadPathPlainGang).
func TestGangExamplePlainPods(t *testing.T) {
	onGangPath(t, controller.GangModeGates)
	ns := namespace(t)
	apply(t, ns, filepath.Join(examples, "gang", "plain-pods.yaml"))
	var pods []*v1.Pod
	for i := range 4 {
		pods = append(pods, waitRunning(t, ns, fmt.Sprintf("trainer-%d", i)))
	}
	_, domains, devices := gangDevices(t, pods)
	assert.Equal(t, 8, devices)
	assert.Len(t, domains, 1, "one NVLink domain: %v", domains)
}

// waitEvent waits for an Event with the reason about the pod.
func waitEvent(t *testing.T, ns, pod, reason string) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 200*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		list, err := cluster.Client.EventsV1().Events(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		for _, e := range list.Items {
			if e.Regarding.Name == pod && e.Reason == reason {
				return true, nil
			}
		}
		return false, nil
	})
	require.NoError(t, err, "no %s Event on pod %s/%s", reason, ns, pod)
}

// reservation returns a GpuReservation as the API server has it.
func reservation(t *testing.T, ns, name string) *gpudrav1.GpuReservation {
	t.Helper()
	u, err := dyn(t).Resource(gpudrav1.GpuReservations).Namespace(ns).Get(context.Background(), name, metav1.GetOptions{})
	require.NoError(t, err)
	r, err := gpudrav1.FromUnstructured[gpudrav1.GpuReservation](u)
	require.NoError(t, err)
	return r
}

func waitReservation(t *testing.T, ns, name string, ok func(*gpudrav1.GpuReservation) bool, what string) *gpudrav1.GpuReservation {
	t.Helper()
	var r *gpudrav1.GpuReservation
	err := wait.PollUntilContextTimeout(context.Background(), 200*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		r = reservation(t, ns, name)
		return ok(r), nil
	})
	require.NoError(t, err, "GpuReservation %s/%s: not %s; status %+v", ns, name, what, r.Status)
	return r
}

func phase(p gpudrav1.ReservationPhase) func(*gpudrav1.GpuReservation) bool {
	return func(r *gpudrav1.GpuReservation) bool { return r.Status.Phase == p }
}

func createReservation(t *testing.T, ns string, r *gpudrav1.GpuReservation) {
	t.Helper()
	r.APIVersion, r.Kind = gpudrav1.APIVersion, gpudrav1.KindGpuReservation
	u, err := gpudrav1.ToUnstructured(r)
	require.NoError(t, err)
	_, err = dyn(t).Resource(gpudrav1.GpuReservations).Namespace(ns).Create(context.Background(), u, metav1.CreateOptions{})
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = dyn(t).Resource(gpudrav1.GpuReservations).Namespace(ns).Delete(context.Background(), r.Name, metav1.DeleteOptions{})
	})
}

func claimPod(name, claim string) *v1.Pod {
	p := gpuPod(name, "")
	p.Spec.ResourceClaims = []v1.PodResourceClaim{{Name: "gpu", ResourceClaimName: &claim}}
	return p
}

// TestReservationHeldConsumedAndReleasedAtTTL runs on the Workload API path
// (TestReservationExample on the gate path): reservations are held the same
// way on both, by the controller behind a fence.
func TestReservationHeldConsumedAndReleasedAtTTL(t *testing.T) {
	onGangPath(t, controller.GangModeWorkload)
	ns := namespace(t)
	ctx := context.Background()
	createReservation(t, ns, &gpudrav1.GpuReservation{ObjectMeta: metav1.ObjectMeta{Name: "burst"}, Spec: gpudrav1.GpuReservationSpec{
		DeviceClassName: "gpu.gpudra.dev", Claims: 2, Count: 1, TTL: metav1.Duration{Duration: 20 * time.Second}}})
	r := waitReservation(t, ns, "burst", phase(gpudrav1.ReservationHeld), "Held")
	require.Len(t, r.Status.Claims, 2)
	assert.EqualValues(t, 2, r.Status.Devices)
	require.NotNil(t, r.Status.ExpiresAt)
	held := map[string]*resourceapi.ResourceClaim{}
	for _, h := range r.Status.Claims {
		c, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, h.Name, metav1.GetOptions{})
		require.NoError(t, err)
		require.NotNil(t, c.Status.Allocation, "claim %s allocated", h.Name)
		assert.Empty(t, c.Status.ReservedFor, "held for no pod yet")
		assert.Equal(t, "burst", metav1.GetControllerOf(c).Name)
		held[h.Name] = c
	}

	// A pod that names a held claim lands on its node and uses its GPU.
	create(t, ns, nil, claimPod("consumer", "burst-0"))
	p := waitRunning(t, ns, "consumer")
	assert.Equal(t, held["burst-0"].Status.Allocation.Devices.Results[0].Pool, p.Spec.NodeName)
	waitReservation(t, ns, "burst", phase(gpudrav1.ReservationConsumed), "Consumed")

	// At the TTL the unused claim is released; the used one stays.
	r = waitReservation(t, ns, "burst", func(r *gpudrav1.GpuReservation) bool { return r.Status.Reason == gpudrav1.ReasonTTLExpired }, "past its TTL")
	assert.Equal(t, gpudrav1.ReservationConsumed, r.Status.Phase)
	require.Len(t, r.Status.Claims, 1)
	assert.Equal(t, "burst-0", r.Status.Claims[0].Name)
	require.NoError(t, wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, "burst-1", metav1.GetOptions{})
		return err != nil, nil
	}), "the unused claim burst-1 was not released")

	// The pod ends: the last claim goes too, and the reservation is over.
	require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(ctx, "consumer", metav1.DeleteOptions{}))
	r = waitReservation(t, ns, "burst", phase(gpudrav1.ReservationExpired), "Expired")
	assert.Empty(t, r.Status.Claims)
}

func TestReservationExample(t *testing.T) {
	onGangPath(t, controller.GangModeGates)
	ns := namespace(t)
	apply(t, ns, filepath.Join(examples, "reservation", "reservation.yaml"))
	t.Cleanup(func() {
		_ = dyn(t).Resource(gpudrav1.GpuReservations).Namespace(ns).Delete(context.Background(), "scale-up", metav1.DeleteOptions{})
	})
	r := waitReservation(t, ns, "scale-up", phase(gpudrav1.ReservationHeld), "Held")
	assert.EqualValues(t, 4, r.Status.Devices)
	assert.Len(t, r.Status.NVLinkDomains, 1, "sameNVLinkDomain")
	apply(t, ns, filepath.Join(examples, "reservation", "pod.yaml"), filepath.Join(examples, "reservation", "queue.yaml"))
	t.Cleanup(func() {
		_ = dyn(t).Resource(gpudrav1.GpuQueues).Delete(context.Background(), "training", metav1.DeleteOptions{})
	})
	p := waitRunning(t, ns, "scale-up-worker")
	assert.Equal(t, r.Status.Claims[0].Node, p.Spec.NodeName)
	waitReservation(t, ns, "scale-up", phase(gpudrav1.ReservationConsumed), "Consumed")
}

// TestQueuePoliciesOrderCompetingGangs: two gangs, A then B, each wanting
// the whole node, wait behind a pod that holds it; when it ends, the
// queue's policy says which gang gets the node: on the gate path the
// controller allocates it, on the Workload API path it hands that gang's
// PodGroup to kube-scheduler first.
func TestQueuePoliciesOrderCompetingGangs(t *testing.T) {
	prio := &schedulingPriorityClass{name: "gpudra-e2e-high", value: 1000}
	prio.create(t)
	for _, mode := range gangPaths {
		t.Run(mode, func(t *testing.T) {
			onGangPath(t, mode)
			queuePolicies(t, mode, prio)
		})
	}
}

func queuePolicies(t *testing.T, mode string, prio *schedulingPriorityClass) {
	ctx := context.Background()
	tests := []struct {
		policy gpudrav1.QueuePolicy
		spec   map[string]any
		// a and b adjust the gangs' pods.
		a, b   func(*v1.Pod)
		winner string
	}{
		{policy: gpudrav1.FCFS, winner: "a"},
		{policy: gpudrav1.Priority, b: func(p *v1.Pod) { p.Spec.PriorityClassName = prio.name }, winner: "b"},
		{policy: gpudrav1.ShortestJobFirst,
			a:      func(p *v1.Pod) { p.Annotations[gpudrav1.AnnotationDuration] = "2h" },
			b:      func(p *v1.Pod) { p.Annotations[gpudrav1.AnnotationDuration] = "10m" },
			winner: "b"},
		// A's namespace already uses a GPU elsewhere: B's goes first.
		{policy: gpudrav1.FairShare, winner: "b"},
	}
	for _, tt := range tests {
		t.Run(string(tt.policy), func(t *testing.T) {
			qname := "e2e-" + strings.ToLower(string(tt.policy))
			q := &unstructured.Unstructured{Object: map[string]any{"apiVersion": gpudrav1.APIVersion, "kind": gpudrav1.KindGpuQueue,
				"metadata": map[string]any{"name": qname}, "spec": map[string]any{"policy": string(tt.policy)}}}
			_, err := dyn(t).Resource(gpudrav1.GpuQueues).Create(ctx, q, metav1.CreateOptions{})
			require.NoError(t, err)
			t.Cleanup(func() { _ = dyn(t).Resource(gpudrav1.GpuQueues).Delete(ctx, qname, metav1.DeleteOptions{}) })
			nsA, nsB := namespace(t), namespace(t)
			for _, ns := range []string{nsA, nsB} {
				create(t, ns, gpus("four", 4))
				create(t, ns, gpus("eight", 8))
			}
			if tt.policy == gpudrav1.FairShare {
				elsewhere := gpuPod("elsewhere", "one")
				pinned("dgx-h100-0")(elsewhere)
				create(t, nsA, gpus("one", 1), elsewhere)
				waitRunning(t, nsA, "elsewhere")
			}
			blocker := gpuPod("blocker", "eight")
			pinned(nomigNode)(blocker)
			create(t, nsB, nil, blocker)
			waitRunning(t, nsB, "blocker")
			mk := func(ns, g string, mutate func(*v1.Pod)) {
				for i := range 2 {
					p := gangPod(fmt.Sprintf("%s-%d", g, i), g, 2, "four", pinned(nomigNode))
					p.Annotations[gpudrav1.AnnotationQueue] = qname
					if mutate != nil {
						mutate(p)
					}
					create(t, ns, nil, p)
				}
			}
			mk(nsA, "a", tt.a)
			gangCondition(t, nsA, "a-0", v1.ConditionFalse, "")
			// Creation times have a resolution of a second: B is later.
			time.Sleep(1100 * time.Millisecond)
			mk(nsB, "b", tt.b)
			gangCondition(t, nsB, "b-0", v1.ConditionFalse, "")
			require.NoError(t, cluster.Client.CoreV1().Pods(nsB).Delete(ctx, "blocker", metav1.DeleteOptions{}))
			winNS, loseNS, loser := nsA, nsB, "b"
			if tt.winner == "b" {
				winNS, loseNS, loser = nsB, nsA, "a"
			}
			waitRunning(t, winNS, tt.winner+"-0")
			waitRunning(t, winNS, tt.winner+"-1")
			cond := gangCondition(t, loseNS, loser+"-0", v1.ConditionFalse, gpudrav1.ReasonWaitingForDevices)
			assert.Contains(t, cond.Message, "queue "+qname)
			p, err := cluster.Client.CoreV1().Pods(loseNS).Get(ctx, loser+"-0", metav1.GetOptions{})
			require.NoError(t, err)
			assert.True(t, heldBack(t, p, mode), "the losing gang stays held back")
			deleteAllPods(t, winNS)
			deleteAllPods(t, loseNS)
		})
	}
}

type schedulingPriorityClass struct {
	name  string
	value int32
}

func (pc *schedulingPriorityClass) create(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	_, err := cluster.Client.SchedulingV1().PriorityClasses().Create(ctx, &schedulingv1.PriorityClass{
		ObjectMeta: metav1.ObjectMeta{Name: pc.name}, Value: pc.value}, metav1.CreateOptions{})
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = cluster.Client.SchedulingV1().PriorityClasses().Delete(ctx, pc.name, metav1.DeleteOptions{})
	})
}
