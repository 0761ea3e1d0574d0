package gang

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

var t0 = time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)

// pod is a gated pod; claims are names of claims it references directly.
func pod(name string, labels, annotations map[string]string, claims ...string) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", Labels: labels, Annotations: annotations, CreationTimestamp: metav1.NewTime(t0)},
		Spec:       corev1.PodSpec{SchedulingGates: []corev1.PodSchedulingGate{{Name: gpudrav1.SchedulingGate}}},
	}
	for _, c := range claims {
		p.Spec.ResourceClaims = append(p.Spec.ResourceClaims, corev1.PodResourceClaim{Name: c, ResourceClaimName: ptr.To(c)})
	}
	return p
}

func plain(name, gang string, size string, claims ...string) *corev1.Pod {
	return pod(name, map[string]string{gpudrav1.LabelGang: gang}, map[string]string{gpudrav1.AnnotationGangSize: size}, claims...)
}

func claimsOf(names ...string) func(string, string) *resourceapi.ResourceClaim {
	set := sets.New(names...)
	return func(ns, name string) *resourceapi.ResourceClaim {
		if !set.Has(name) {
			return nil
		}
		return &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}}
	}
}

func podGangObj(groups ...map[string]any) *unstructured.Unstructured {
	var gs []any
	for _, g := range groups {
		gs = append(gs, g)
	}
	return &unstructured.Unstructured{Object: map[string]any{"metadata": map[string]any{"name": "pg", "namespace": "ns"},
		"spec": map[string]any{"podgroups": gs}}}
}

func group(name string, min int64, pods ...string) map[string]any {
	var refs []any
	for _, p := range pods {
		refs = append(refs, map[string]any{"namespace": "ns", "name": p})
	}
	return map[string]any{"name": name, "minReplicas": min, "podReferences": refs}
}

func TestCollectGangs(t *testing.T) {
	grove := func(name string, claims ...string) *corev1.Pod {
		return pod(name, map[string]string{LabelPodGang: "pg"}, nil, claims...)
	}
	tests := []struct {
		name     string
		pods     []*corev1.Pod
		podGang  *unstructured.Unstructured
		claims   []string
		wantKeys []string
		missing  string
		admitted bool
		gated    []string // nil: every member
	}{{
		name:     "plain gang complete",
		pods:     []*corev1.Pod{plain("a", "g", "2", "ca"), plain("b", "g", "2", "cb")},
		claims:   []string{"ca", "cb"},
		wantKeys: []string{"ns/g"},
	}, {
		name:     "plain gang short of pods",
		pods:     []*corev1.Pod{plain("a", "g", "3", "ca"), plain("b", "g", "3", "cb")},
		claims:   []string{"ca", "cb"},
		wantKeys: []string{"ns/g"},
		missing:  "2 of 3 pods exist",
	}, {
		name:     "plain gang with a bad size",
		pods:     []*corev1.Pod{plain("a", "g", "two")},
		wantKeys: []string{"ns/g"},
		missing:  `a valid gpudra.dev/gang-size annotation (got "two")`,
	}, {
		name:     "claim not made yet",
		pods:     []*corev1.Pod{plain("a", "g", "1", "ca")},
		wantKeys: []string{"ns/g"},
		missing:  "claim ca of pod a",
	}, {
		name: "ungated and deleted pods are not counted",
		pods: []*corev1.Pod{func() *corev1.Pod { p := plain("a", "g", "1"); p.Spec.SchedulingGates = nil; return p }(),
			func() *corev1.Pod { p := plain("b", "h", "1"); p.DeletionTimestamp = &metav1.Time{Time: t0}; return p }()},
	}, {
		// The review's case: one gate lift failed; the other member's
		// gate is gone, so only one pod is gated. Counting gated pods
		// said "1 of 2 pods" for ever.
		name:     "a gang with a released member is admitted",
		pods:     []*corev1.Pod{plain("a", "g", "2", "ca"), ungated(plain("b", "g", "2", "cb"))},
		claims:   []string{"ca", "cb"},
		wantKeys: []string{"ns/g"},
		admitted: true,
		gated:    []string{"a"},
	}, {
		name:     "a pod whose lift is not yet in the informer counts as released",
		pods:     []*corev1.Pod{plain("a", "g", "2", "ca"), plain("lifted", "g", "2", "cb")},
		claims:   []string{"ca", "cb"},
		wantKeys: []string{"ns/g"},
		admitted: true,
		gated:    []string{"a"},
	}, {
		// A Job recreated a failed member: the old one ended, the new one
		// is gated, the others run.
		name: "a recreated member of an admitted gang",
		pods: []*corev1.Pod{ungated(plain("a", "g", "2", "ca")), withPhase(ungated(plain("b", "g", "2", "cb")), corev1.PodFailed),
			plain("b2", "g", "2", "cb2")},
		claims:   []string{"ca", "cb", "cb2"},
		wantKeys: []string{"ns/g"},
		admitted: true,
		gated:    []string{"b2"},
	}, {
		name:     "ended members do not count",
		pods:     []*corev1.Pod{plain("a", "g", "2", "ca"), withPhase(plain("b", "g", "2", "cb"), corev1.PodSucceeded)},
		claims:   []string{"ca", "cb"},
		wantKeys: []string{"ns/g"},
		missing:  "1 of 2 pods exist",
		gated:    []string{"a"},
	}, {
		name:     "grove gang waits for its PodGang",
		pods:     []*corev1.Pod{grove("p0")},
		wantKeys: []string{"ns/pg"},
		missing:  "its PodGang pg",
	}, {
		name:     "grove gang with each group at minReplicas",
		pods:     []*corev1.Pod{grove("p0"), grove("d0")},
		podGang:  podGangObj(group("prefill", 1, "p0", "p1"), group("decode", 1, "d0")),
		wantKeys: []string{"ns/pg"},
	}, {
		name:     "grove gang short in one group",
		pods:     []*corev1.Pod{grove("p0")},
		podGang:  podGangObj(group("prefill", 1, "p0"), group("decode", 2, "d0", "d1")),
		wantKeys: []string{"ns/pg"},
		missing:  "group decode: 0 of 2 pods",
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			waits := func(p *corev1.Pod) bool { return gated(p) && p.Name != "lifted" }
			gangs := collectGangs(tt.pods, waits, func(ns, name string) *unstructured.Unstructured {
				if tt.podGang != nil && name == "pg" {
					return tt.podGang
				}
				return nil
			}, claimsByName(claimsOf(tt.claims...)))
			var keys []string
			for _, g := range gangs {
				keys = append(keys, g.Key)
			}
			assert.Equal(t, tt.wantKeys, keys)
			if len(gangs) == 1 {
				g := gangs[0]
				if !tt.admitted {
					assert.Equal(t, tt.missing, g.Missing)
				}
				assert.Equal(t, tt.admitted, g.Admitted)
				want := tt.gated
				if want == nil {
					for _, p := range g.Pods {
						want = append(want, p.Name)
					}
				}
				var got []string
				for _, p := range g.Waiting {
					got = append(got, p.Name)
				}
				assert.Equal(t, want, got, "gated members")
			}
		})
	}
}

func TestCollectGangsQueueFields(t *testing.T) {
	a := plain("a", "g", "2")
	a.Annotations[gpudrav1.AnnotationQueue] = "training"
	a.Annotations[gpudrav1.AnnotationDuration] = "30m"
	a.Spec.Priority = ptr.To[int32](5)
	b := plain("b", "g", "2")
	b.Spec.Priority = ptr.To[int32](50)
	b.CreationTimestamp = metav1.NewTime(t0.Add(-time.Minute))
	gangs := collectGangs([]*corev1.Pod{b, a}, nil, func(string, string) *unstructured.Unstructured { return nil }, claimsByName(claimsOf()))
	require.Len(t, gangs, 1)
	g := gangs[0]
	assert.Equal(t, "training", g.Queue, "from the first pod by name")
	require.NotNil(t, g.Duration)
	assert.Equal(t, 30*time.Minute, *g.Duration)
	assert.EqualValues(t, 50, g.Priority, "the highest pod priority")
	assert.Equal(t, t0.Add(-time.Minute), g.QueuedAt, "the oldest pod")
}

func TestGangGroups(t *testing.T) {
	nodes := []*corev1.Node{
		{ObjectMeta: metav1.ObjectMeta{Name: "n0", Labels: map[string]string{"zone": "a"}}},
		{ObjectMeta: metav1.ObjectMeta{Name: "n1", Labels: map[string]string{"zone": "b"}}},
	}
	allocatedOn := func(node string) *resourceapi.AllocationResult {
		return &resourceapi.AllocationResult{NodeSelector: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
			MatchFields: []corev1.NodeSelectorRequirement{{Key: "metadata.name", Operator: corev1.NodeSelectorOpIn, Values: []string{node}}}}}}}
	}
	claims := map[string]*resourceapi.ResourceClaim{}
	for _, n := range []string{"a", "b", "shared", "c"} {
		claims[n] = &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: n, Namespace: "ns"}}
	}
	claims["held"] = &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "held", Namespace: "ns"},
		Status: resourceapi.ResourceClaimStatus{Allocation: allocatedOn("n1")}}
	lookup := func(ns, name string) *resourceapi.ResourceClaim { return claims[name] }

	zoneA := plain("za", "g", "1", "c")
	zoneA.Spec.NodeSelector = map[string]string{"zone": "a"}
	g := &Gang{Pods: []*corev1.Pod{
		plain("p0", "g", "4", "a", "shared"),
		plain("p1", "g", "4", "b", "shared"),
		plain("p2", "g", "4", "held"),
		zoneA,
	}}
	groups, err := gangGroups(g, nodes, claimsByName(lookup))
	require.NoError(t, err)
	require.Len(t, groups, 2, "p0+p1 share a claim; p2 needs nothing new; za alone")
	assert.Equal(t, "pod p0+p1", groups[0].Name)
	assert.Len(t, groups[0].Claims, 3, "a, shared (once), b")
	assert.Nil(t, groups[0].Nodes, "any node")
	assert.Equal(t, "pod za", groups[1].Name)
	assert.Equal(t, sets.New("n0"), groups[1].Nodes, "its node selector")

	// A pod with a held claim and a new one is tied to the held claim's node.
	g = &Gang{Pods: []*corev1.Pod{plain("p3", "g", "1", "held", "c")}}
	groups, err = gangGroups(g, nodes, claimsByName(lookup))
	require.NoError(t, err)
	require.Len(t, groups, 1)
	assert.Equal(t, sets.New("n1"), groups[0].Nodes)

	_, err = gangGroups(&Gang{Pods: []*corev1.Pod{plain("p4", "g", "1", "gone")}}, nodes, claimsByName(lookup))
	assert.ErrorContains(t, err, "claim gone of pod p4")
}

// TestGangGroupsHonourCordonsAndTaints: the review's case of a planner that
// placed gang pods on nodes the scheduler would never bind them to. A
// cordoned node and one with an untolerated NoSchedule or NoExecute taint
// are left out, as the scheduler's NodeUnschedulable and TaintToleration
// filters leave them out; a PreferNoSchedule taint and a tolerated taint
// are not.
func TestGangGroupsHonourCordonsAndTaints(t *testing.T) {
	taint := func(key string, effect corev1.TaintEffect) []corev1.Taint {
		return []corev1.Taint{{Key: key, Value: "x", Effect: effect}}
	}
	nodes := []*corev1.Node{
		{ObjectMeta: metav1.ObjectMeta{Name: "free"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "cordoned"}, Spec: corev1.NodeSpec{Unschedulable: true}},
		{ObjectMeta: metav1.ObjectMeta{Name: "noschedule"}, Spec: corev1.NodeSpec{Taints: taint("dedicated", corev1.TaintEffectNoSchedule)}},
		{ObjectMeta: metav1.ObjectMeta{Name: "noexecute"}, Spec: corev1.NodeSpec{Taints: taint("maintenance", corev1.TaintEffectNoExecute)}},
		{ObjectMeta: metav1.ObjectMeta{Name: "prefer"}, Spec: corev1.NodeSpec{Taints: taint("soft", corev1.TaintEffectPreferNoSchedule)}},
	}
	lookup := func(ns, name string) *resourceapi.ResourceClaim {
		return &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}}
	}
	groups, err := gangGroups(&Gang{Pods: []*corev1.Pod{plain("p", "g", "1", "c")}}, nodes, claimsByName(lookup))
	require.NoError(t, err)
	require.Len(t, groups, 1)
	assert.Equal(t, sets.New("free", "prefer"), groups[0].Nodes)

	tolerant := plain("t", "g", "1", "c")
	tolerant.Spec.Tolerations = []corev1.Toleration{{Key: "dedicated", Operator: corev1.TolerationOpExists},
		{Key: corev1.TaintNodeUnschedulable, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule}}
	groups, err = gangGroups(&Gang{Pods: []*corev1.Pod{tolerant}}, nodes, claimsByName(lookup))
	require.NoError(t, err)
	assert.Equal(t, sets.New("free", "prefer", "noschedule", "cordoned"), groups[0].Nodes, "what it tolerates")
}

func TestReservationClaims(t *testing.T) {
	r := &gpudrav1.GpuReservation{ObjectMeta: metav1.ObjectMeta{Name: "r", Namespace: "ns", UID: "uid-r"},
		Spec: gpudrav1.GpuReservationSpec{DeviceClassName: "gpu.gpudra.dev", Claims: 2, Count: 4, SameNVLinkDomain: true,
			Selectors: []string{`device.attributes["gpu.gpudra.dev"].type == "gpu"`}}}
	existing := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "r-1", Namespace: "ns", UID: "uid-c1"}}
	claims := reservationClaims(r, func(ns, name string) *resourceapi.ResourceClaim {
		if name == "r-1" {
			return existing
		}
		return nil
	})
	require.Len(t, claims, 2)
	c := claims[0]
	assert.Equal(t, "r-0", c.Name)
	assert.Equal(t, "r", c.Labels[gpudrav1.LabelReservation])
	require.Len(t, c.OwnerReferences, 1)
	assert.Equal(t, "uid-r", string(c.OwnerReferences[0].UID))
	assert.True(t, ownedBy(c, r))
	req := c.Spec.Devices.Requests[0].Exactly
	assert.EqualValues(t, 4, req.Count)
	assert.Equal(t, "gpu.gpudra.dev", req.DeviceClassName)
	require.Len(t, req.Selectors, 1)
	require.Len(t, c.Spec.Devices.Constraints, 1, "one NVLink domain within the claim")
	assert.Same(t, existing, claims[1], "an existing claim is used as it is")
}
