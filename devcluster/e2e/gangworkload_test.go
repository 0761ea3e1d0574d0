package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/gpudra/gpudra/pkg/controller"
	"github.com/gpudra/gpudra/pkg/controller/gang"
	"github.com/gpudra/gpudra/pkg/controller/grove"
)

// gangMode is the gpudra controller's --gang-mode now; the suite starts on
// auto, which on devcluster (it serves the Workload API) is the Workload
// API path.
var gangMode = controller.GangModeAuto

// onGangPath runs the controller with --gang-mode mode from now on (a chart
// upgrade of gangs.mode), unless it runs so already. Every gang test says
// which path it tests.
func onGangPath(t testing.TB, mode string) {
	t.Helper()
	if gangMode == mode {
		return
	}
	require.NoError(t, cluster.SetGangMode(context.Background(), mode))
	gangMode = mode
}

// gangPaths are the two paths gang scenarios run on: kube-scheduler's
// Workload API, and the gate path with the Workload API unused.
var gangPaths = []string{controller.GangModeWorkload, controller.GangModeGates}

// heldBack says whether gpudra still holds a gang pod back on the path:
// gated on the gate path; on the Workload API path, naming its PodGroup,
// which does not exist yet. Either way it is not bound.
func heldBack(t *testing.T, p *v1.Pod, mode string) bool {
	t.Helper()
	if p.Spec.NodeName != "" {
		return false
	}
	if mode == controller.GangModeGates {
		return gatedByGpudra(p)
	}
	if p.Spec.SchedulingGroup == nil || p.Spec.SchedulingGroup.PodGroupName == nil || gatedByGpudra(p) {
		return false
	}
	_, err := cluster.Client.SchedulingV1beta1().PodGroups(p.Namespace).Get(context.Background(), *p.Spec.SchedulingGroup.PodGroupName, metav1.GetOptions{})
	return apierrors.IsNotFound(err)
}

// countFences counts the fences (DeviceTaintRules labelled
// gpudra.dev/fence) created from now until the test ends: call the
// returned function for the count so far. The Workload API path makes none.
func countFences(t *testing.T) func() int {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	w, err := cluster.Client.ResourceV1().DeviceTaintRules().Watch(ctx, metav1.ListOptions{LabelSelector: gang.LabelFence})
	require.NoError(t, err)
	var mu sync.Mutex
	n := 0
	go func() {
		for ev := range w.ResultChan() {
			if ev.Type == watch.Added {
				mu.Lock()
				n++
				mu.Unlock()
			}
		}
	}()
	t.Cleanup(func() { w.Stop(); cancel() })
	return func() int {
		mu.Lock()
		defer mu.Unlock()
		return n
	}
}

// podGroup waits for a gang's PodGroup.
func podGroup(t *testing.T, ns, name string) *schedulingv1beta1.PodGroup {
	t.Helper()
	var pg *schedulingv1beta1.PodGroup
	require.NoError(t, wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		var err error
		pg, err = cluster.Client.SchedulingV1beta1().PodGroups(ns).Get(ctx, name, metav1.GetOptions{})
		return err == nil, nil
	}), "no PodGroup %s/%s: %s", ns, name, podStates(ns))
	return pg
}

// TestWorkloadPathPlainGang: on the Workload API path a plain gang's pods
// are not gated; they name the gang's PodGroup, which the controller makes
// (minCount = the gang's size) with its Workload, and kube-scheduler binds
// all four with their claims allocated by the scheduler, without a fence.
func TestWorkloadPathPlainGang(t *testing.T) {
	onGangPath(t, controller.GangModeAuto)
	fences := countFences(t)
	ns := namespace(t)
	apply(t, ns, filepath.Join(examples, "gang", "plain-pods.yaml"))
	var pods []*v1.Pod
	for i := range 4 {
		pods = append(pods, waitRunning(t, ns, fmt.Sprintf("trainer-%d", i)))
	}
	for _, p := range pods {
		assert.False(t, gatedByGpudra(p), "pod %s: no gate on the Workload API path", p.Name)
		require.NotNil(t, p.Spec.SchedulingGroup, "pod %s names its PodGroup", p.Name)
		assert.Equal(t, "trainer", *p.Spec.SchedulingGroup.PodGroupName)
		cond := gangCondition(t, ns, p.Name, v1.ConditionTrue, gang.ReasonPodGroupCreated)
		assert.Contains(t, cond.Message, "Workload API path")
	}
	pg := podGroup(t, ns, "trainer")
	require.NotNil(t, pg.Spec.SchedulingPolicy.Gang)
	assert.EqualValues(t, 4, pg.Spec.SchedulingPolicy.Gang.MinCount)
	wl, err := cluster.Client.SchedulingV1beta1().Workloads(ns).Get(context.Background(), "trainer", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, wl.UID, metav1.GetControllerOf(pg).UID)
	require.NotNil(t, pg.Spec.SchedulingConstraints, "the gang fits one node: kept on one")
	assert.Equal(t, gang.TopologyKeyNode, pg.Spec.SchedulingConstraints.Topology[0].Key)
	nodes, domains, devices := gangDevices(t, pods)
	assert.Equal(t, 8, devices)
	assert.Len(t, nodes, 1, "one node: %v", nodes)
	assert.Len(t, domains, 1, "one NVLink domain: %v", domains)
	assert.Zero(t, fences(), "no fence on the Workload API path")
}

// TestWorkloadPathGrovePodGang: a Grove PodGang of two cliques of four
// pods, one GPU each, is one gang PodGroup of minCount 8; all eight are
// bound, with no gate and no DeviceTaintRule.
func TestWorkloadPathGrovePodGang(t *testing.T) {
	onGangPath(t, controller.GangModeAuto)
	fences := countFences(t)
	ns := namespace(t)
	ctx := context.Background()
	apply(t, ns, filepath.Join(examples, "gang", "podcliqueset.yaml"))
	t.Cleanup(func() {
		_ = dyn(t).Resource(schema.GroupVersionResource{Group: "grove.io", Version: "v1alpha1", Resource: "podcliquesets"}).Namespace(ns).
			Delete(ctx, "disagg", metav1.DeleteOptions{})
	})
	pods := runningPodGangPods(t, ns, "disagg-0", 8)
	for _, p := range pods {
		assert.False(t, gatedByGpudra(p), "pod %s: no gpudra gate", p.Name)
		require.NotNil(t, p.Spec.SchedulingGroup)
		assert.Equal(t, "disagg-0", *p.Spec.SchedulingGroup.PodGroupName)
	}
	pg := podGroup(t, ns, "disagg-0")
	require.NotNil(t, pg.Spec.SchedulingPolicy.Gang)
	assert.EqualValues(t, 8, pg.Spec.SchedulingPolicy.Gang.MinCount, "both cliques' minAvailable, in one PodGroup")
	wl, err := cluster.Client.SchedulingV1beta1().Workloads(ns).Get(ctx, "disagg-0", metav1.GetOptions{})
	require.NoError(t, err)
	require.NotNil(t, wl.Spec.ControllerRef)
	assert.Equal(t, "PodGang", wl.Spec.ControllerRef.Kind)
	nodes, domains, devices := gangDevices(t, pods)
	assert.Equal(t, 8, devices)
	assert.Len(t, nodes, 1, "one node: %v", nodes)
	assert.Len(t, domains, 1, "one NVLink domain: %v", domains)
	assert.Zero(t, fences(), "no fence on the Workload API path")
}

// TestGangThatCannotFitWaitsWhileSinglePodsSchedule, on both paths: a gang
// that does not fit now is held back whole (no pod bound, no claim
// allocated) and says why; one that can never fit says so without holding
// the queue; single pods keep scheduling on the same node; once the node
// empties the waiting gang lands whole.
func TestGangThatCannotFitWaitsWhileSinglePodsSchedule(t *testing.T) {
	for _, mode := range gangPaths {
		t.Run(mode, func(t *testing.T) {
			onGangPath(t, mode)
			ns := namespace(t)
			ctx := context.Background()
			create(t, ns, gpus("one", 1))
			create(t, ns, gpus("four", 4))
			create(t, ns, nil, func() *v1.Pod { p := gpuPod("single-a", "one"); pinned(nomigNode)(p); return p }())
			waitRunning(t, ns, "single-a")
			create(t, ns, nil, gangPod("waits-0", "waits", 2, "four", pinned(nomigNode)), gangPod("waits-1", "waits", 2, "four", pinned(nomigNode)))
			cond := gangCondition(t, ns, "waits-0", v1.ConditionFalse, "WaitingForDevices")
			assert.Contains(t, cond.Message, "waiting for 8 free devices")
			create(t, ns, nil, gangPod("never-0", "never", 3, "four", pinned(nomigNode)), gangPod("never-1", "never", 3, "four", pinned(nomigNode)),
				gangPod("never-2", "never", 3, "four", pinned(nomigNode)))
			cond = gangCondition(t, ns, "never-0", v1.ConditionFalse, "Unsatisfiable")
			assert.Contains(t, cond.Message, "even on an empty cluster")
			create(t, ns, nil, func() *v1.Pod { p := gpuPod("single-b", "one"); pinned(nomigNode)(p); return p }())
			waitRunning(t, ns, "single-b")
			for _, name := range []string{"waits-0", "waits-1", "never-0"} {
				p, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
				require.NoError(t, err)
				assert.True(t, heldBack(t, p, mode), "pod %s still held back", name)
				for _, st := range p.Status.ResourceClaimStatuses {
					c, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, *st.ResourceClaimName, metav1.GetOptions{})
					require.NoError(t, err)
					assert.Nil(t, c.Status.Allocation, "a waiting gang holds nothing: claim %s", c.Name)
				}
			}
			waitEvent(t, ns, "never-0", "Unsatisfiable")
			for _, name := range []string{"single-a", "single-b"} {
				require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{}))
			}
			a, b := waitRunning(t, ns, "waits-0"), waitRunning(t, ns, "waits-1")
			_, domains, devices := gangDevices(t, []*v1.Pod{a, b})
			assert.Equal(t, 8, devices)
			assert.Len(t, domains, 1)
			deleteAllPods(t, ns)
		})
	}
}

// TestPodGroupClaimSharedBy300Pods: with DRAWorkloadResourceClaims a claim
// that a PodGroup lists is reserved for the PodGroup, in one reservedFor
// entry, so 300 pods share it (the limit is 256 entries). The claim is
// prepared once on its node, every pod runs, and `gpudra groups` (the
// Grove diagnostics) counts every pod as reserved, with no limit warning.
func TestPodGroupClaimSharedBy300Pods(t *testing.T) {
	ns := namespace(t)
	ctx := context.Background()
	const claimName, group, n = "pcs-shared", "serving", 300
	groveClaim(t, ns, claimName, 1)
	_, err := cluster.Client.SchedulingV1beta1().PodGroups(ns).Create(ctx, &schedulingv1beta1.PodGroup{
		ObjectMeta: metav1.ObjectMeta{Name: group},
		Spec: schedulingv1beta1.PodGroupSpec{
			SchedulingPolicy: schedulingv1beta1.PodGroupSchedulingPolicy{Basic: &schedulingv1beta1.BasicSchedulingPolicy{}},
			ResourceClaims:   []schedulingv1beta1.PodGroupResourceClaim{{Name: claimName, ResourceClaimName: ptr(claimName)}},
		},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	for i := range n {
		groveConsumer(t, ns, fmt.Sprintf("replica-%03d", i), claimName, func(p *v1.Pod) {
			p.Spec.SchedulingGroup = &v1.PodSchedulingGroup{PodGroupName: ptr(group)}
			p.Spec.NodeSelector = map[string]string{"kubernetes.io/hostname": nomigNode}
		})
	}
	require.NoError(t, wait.PollUntilContextTimeout(ctx, time.Second, 3*time.Minute, true, func(ctx context.Context) (bool, error) {
		list, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		running := 0
		for _, p := range list.Items {
			if p.Status.Phase == v1.PodRunning {
				running++
			}
		}
		return running == n, nil
	}), "%d pods running", n)
	claim, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, claimName, metav1.GetOptions{})
	require.NoError(t, err)
	require.Len(t, claim.Status.ReservedFor, 1, "one entry for the PodGroup")
	assert.Equal(t, resourceapi.ResourceClaimConsumerReference{APIGroup: "scheduling.k8s.io", Resource: "podgroups", Name: group,
		UID: claim.Status.ReservedFor[0].UID}, claim.Status.ReservedFor[0])
	require.NotNil(t, claim.Status.Allocation)
	assert.Equal(t, nomigNode, claim.Status.Allocation.Devices.Results[0].Pool)

	groups, err := grove.ListGroups(ctx, cluster.Client, ns, time.Now())
	require.NoError(t, err)
	require.Len(t, groups, 1)
	g := groups[0]
	assert.Empty(t, g.Problems, "no limit warning for a PodGroup's pods")
	assert.Len(t, g.Consumers, n)
	for _, c := range g.Consumers {
		if !assert.True(t, c.Reserved, "pod %s reserved through its PodGroup", c.Name) {
			break
		}
	}
	assert.Equal(t, 1, g.ReservedFor)
	// No TooManyConsumers Event either.
	events, err := cluster.Client.EventsV1().Events(ns).List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	for _, e := range events.Items {
		assert.NotEqual(t, grove.ReasonTooManyConsumers, e.Reason, "Event %s: %s", e.Name, e.Note)
	}
}
