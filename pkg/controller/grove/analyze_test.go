package grove

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/utils/ptr"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
)

func TestAnalyzeProblems(t *testing.T) {
	nodeA := node("node-a", map[string]string{"zone": "a"})
	nodeB := node("node-b", map[string]string{"zone": "b"})
	tainted := node("node-a", map[string]string{"zone": "a"}, corev1.Taint{Key: "maintenance", Value: "true", Effect: corev1.TaintEffectNoSchedule})
	running := consumer("primary", boundTo("node-a"))
	claimMsg := "0/2 nodes are available: 2 cannot allocate all claims."

	tests := map[string]struct {
		claim   *resourceapi.ResourceClaim
		pods    []*corev1.Pod
		nodes   []*corev1.Node
		reasons []string
		pods0   []string // Pods of the first problem
		contain string   // in the first problem's message
		recheck time.Duration
	}{
		"healthy primary and shadow": {
			claim: groveClaim(allocated("node-a"), reservedFor(running, consumer("shadow"))),
			pods:  []*corev1.Pod{running, consumer("shadow", boundTo("node-a"))},
			nodes: []*corev1.Node{nodeA, nodeB},
		},
		"unallocated, no consumers": {
			claim: groveClaim(),
		},
		"exactly the reservedFor limit": {
			claim: groveClaim(),
			pods:  manyConsumers(resourceapi.ResourceClaimReservedForMaxSize),
		},
		"one consumer over the limit": {
			claim:   groveClaim(),
			pods:    manyConsumers(resourceapi.ResourceClaimReservedForMaxSize + 1),
			reasons: []string{ReasonTooManyConsumers},
			contain: "257 pods reference claim grove-demo-0-engine-0-engine-gpu, a claim can be reserved for at most 256",
		},
		// DRAWorkloadResourceClaims: one reservedFor entry for a whole
		// PodGroup, however many pods it has.
		"300 pods of a PodGroup the claim is reserved for": {
			claim: groveClaim(allocated("node-a"), reservedForPodGroup("serving")),
			pods:  inPodGroup("serving", manyConsumers(300)),
			nodes: []*corev1.Node{nodeA},
		},
		"300 pods of another PodGroup still count one by one": {
			claim:   groveClaim(allocated("node-a"), reservedForPodGroup("serving")),
			pods:    inPodGroup("other", manyConsumers(300)),
			nodes:   []*corev1.Node{nodeA},
			reasons: []string{ReasonTooManyConsumers},
			contain: "300 pods outside PodGroup serving and the PodGroup reference claim",
		},
		"nodeSelector excludes the allocated node": {
			claim:   groveClaim(allocated("node-a"), reservedFor(running)),
			pods:    []*corev1.Pod{running, consumer("shadow", nodeSelector("zone", "b"))},
			nodes:   []*corev1.Node{nodeA, nodeB},
			reasons: []string{ReasonConsumerNodeExcluded},
			pods0:   []string{"shadow"},
			contain: "allocated on node node-a, which 1 consumer(s) cannot use: pod shadow: node node-a does not match its nodeSelector",
		},
		"required node affinity excludes the allocated node": {
			claim: groveClaim(allocated("node-a")),
			pods: []*corev1.Pod{consumer("shadow", func(p *corev1.Pod) {
				p.Spec.Affinity = &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{
					RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
						MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "zone", Operator: corev1.NodeSelectorOpNotIn, Values: []string{"a"}}},
					}}},
				}}
			})},
			nodes:   []*corev1.Node{nodeA, nodeB},
			reasons: []string{ReasonConsumerNodeExcluded},
			pods0:   []string{"shadow"},
		},
		"matching nodeSelector is fine": {
			claim: groveClaim(allocated("node-a")),
			pods:  []*corev1.Pod{consumer("shadow", nodeSelector("zone", "a"))},
			nodes: []*corev1.Node{nodeA, nodeB},
		},
		"untolerated taint on the allocated node": {
			claim:   groveClaim(allocated("node-a")),
			pods:    []*corev1.Pod{consumer("shadow")},
			nodes:   []*corev1.Node{tainted},
			reasons: []string{ReasonConsumerNodeExcluded},
			contain: "node node-a has taint maintenance=true:NoSchedule it does not tolerate",
		},
		"tolerated taint is fine": {
			claim: groveClaim(allocated("node-a")),
			pods: []*corev1.Pod{consumer("shadow", func(p *corev1.Pod) {
				p.Spec.Tolerations = []corev1.Toleration{{Key: "maintenance", Operator: corev1.TolerationOpExists}}
			})},
			nodes: []*corev1.Node{tainted},
		},
		"bound consumers are not checked against the node": {
			claim: groveClaim(allocated("node-a")),
			pods:  []*corev1.Pod{consumer("primary", boundTo("node-a"), nodeSelector("zone", "b"))},
			nodes: []*corev1.Node{nodeA},
		},
		"pending on claims past the grace period": {
			claim:   groveClaim(),
			pods:    []*corev1.Pod{consumer("primary", unschedulable(t0.Add(-3*time.Minute), claimMsg))},
			reasons: []string{ReasonConsumersPending},
			pods0:   []string{"primary"},
			contain: "pod primary: " + claimMsg,
		},
		"pending on claims within the grace period": {
			claim:   groveClaim(),
			pods:    []*corev1.Pod{consumer("primary", unschedulable(t0.Add(-30*time.Second), claimMsg))},
			recheck: 90 * time.Second,
		},
		"pending for another reason": {
			claim: groveClaim(),
			pods:  []*corev1.Pod{consumer("primary", unschedulable(t0.Add(-time.Hour), "0/2 nodes are available: 2 Insufficient cpu."))},
		},
		"gated by Grove": {
			claim: groveClaim(),
			pods: []*corev1.Pod{consumer("primary", func(p *corev1.Pod) {
				p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionFalse, Reason: corev1.PodReasonSchedulingGated}}
			})},
		},
		"MPS, consumers as different users": {
			claim: groveClaim(config(`{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS"}}`)),
			pods: []*corev1.Pod{
				consumer("primary", runAsUser(ptr.To[int64](1000), nil)),
				consumer("shadow", runAsUser(ptr.To[int64](1000), ptr.To[int64](2000))),
			},
			reasons: []string{ReasonMPSUsersDiffer},
			pods0:   []string{"primary", "shadow"},
			contain: "run as 2 users (runAsUser): user 1000: primary/engine; user 2000: shadow/engine",
		},
		"MPS, one user": {
			claim: groveClaim(config(`{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS"}}`)),
			pods: []*corev1.Pod{
				consumer("primary", runAsUser(ptr.To[int64](1000), nil)),
				consumer("shadow", runAsUser(nil, ptr.To[int64](1000))),
				consumer("unknown"),
			},
		},
		"TimeSlicing, different users is fine": {
			claim: groveClaim(config(`{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"TimeSlicing"}}`)),
			pods: []*corev1.Pod{
				consumer("primary", runAsUser(ptr.To[int64](1000), nil)),
				consumer("shadow", runAsUser(ptr.To[int64](2000), nil)),
			},
		},
		"invalid config": {
			claim:   groveClaim(config(`{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"Fast"}}`)),
			reasons: []string{ReasonInvalidConfig},
			contain: "sharing.strategy",
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			g, recheck := Analyze(Input{Claim: tc.claim, Pods: tc.pods, Nodes: tc.nodes, Now: t0})
			var reasons []string
			for _, p := range g.Problems {
				reasons = append(reasons, p.Reason)
			}
			assert.Equal(t, tc.reasons, reasons)
			assert.Equal(t, tc.recheck, recheck)
			if len(tc.reasons) == 0 {
				return
			}
			if tc.pods0 != nil {
				assert.Equal(t, tc.pods0, g.Problems[0].Pods)
			}
			assert.Contains(t, g.Problems[0].Message, tc.contain)
		})
	}
}

func TestAnalyzeDescribesGroup(t *testing.T) {
	primary, shadow := consumer("primary", boundTo("node-a")), consumer("shadow", boundTo("node-a"))
	other := consumer("other")
	other.Spec.ResourceClaims[0].ResourceClaimName = ptr.To("another-claim")
	g, _ := Analyze(Input{
		Claim: groveClaim(allocated("node-a"), reservedFor(primary), config(`{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"ipc":true}}`)),
		Pods:  []*corev1.Pod{shadow, primary, other},
		Nodes: []*corev1.Node{node("node-a", nil), node("node-b", nil)},
		Now:   t0,
	})
	want := Group{
		Namespace: "default", Claim: "grove-demo-0-engine-0-engine-gpu", ClaimUID: "claim-uid",
		Level: LevelScalingGroup, Scope: ScopePerReplica, PodCliqueSet: "grove-demo", Replica: ptr.To(0),
		Owner:     &Owner{APIVersion: "grove.io/v1alpha1", Kind: "PodCliqueScalingGroup", Name: "grove-demo-0-engine", UID: "pcsg-uid"},
		Allocated: true, Node: "node-a",
		Devices: []Device{{Request: "gpu", Pool: "node-a", Device: "gpu-0"}},
		Sharing: &gpuapi.Sharing{Strategy: gpuapi.Exclusive, IPC: true},
		Consumers: []Consumer{
			{Name: "primary", UID: "primary-uid", Node: "node-a", Phase: corev1.PodRunning, Reserved: true},
			{Name: "shadow", UID: "shadow-uid", Node: "node-a", Phase: corev1.PodRunning},
		},
		ReservedFor: 1,
	}
	assert.Equal(t, want, g)
	assert.Equal(t, "Exclusive+IPC", g.SharingMode())
}

func TestDescribeLevels(t *testing.T) {
	tests := map[string]struct {
		labels  map[string]string
		level   Level
		scope   Scope
		replica *int
	}{
		"PodCliqueSet AllReplicas": {labels: map[string]string{}, level: LevelPodCliqueSet, scope: ScopeAllReplicas},
		"PodCliqueSet PerReplica":  {labels: map[string]string{LabelPodCliqueSetReplica: "1"}, level: LevelPodCliqueSet, scope: ScopePerReplica, replica: ptr.To(1)},
		"ScalingGroup AllReplicas": {labels: map[string]string{LabelScalingGroup: "x-0-sg"}, level: LevelScalingGroup, scope: ScopeAllReplicas},
		"PodClique PerReplica":     {labels: map[string]string{LabelPodClique: "x-0-c", LabelPodCliquePodIndex: "2"}, level: LevelPodClique, scope: ScopePerReplica, replica: ptr.To(2)},
		// The PCS replica label on a PodClique-level claim is not its scope.
		"PodClique AllReplicas": {labels: map[string]string{LabelPodClique: "x-0-c", LabelPodCliqueSetReplica: "0"}, level: LevelPodClique, scope: ScopeAllReplicas},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			c := groveClaim()
			c.Labels = map[string]string{LabelManagedBy: ManagedByGrove, LabelComponent: ComponentResourceClaim}
			for k, v := range tc.labels {
				c.Labels[k] = v
			}
			g := describe(c)
			assert.Equal(t, tc.level, g.Level)
			assert.Equal(t, tc.scope, g.Scope)
			assert.Equal(t, tc.replica, g.Replica)
		})
	}
}

func TestIsOurs(t *testing.T) {
	other := groveClaim(allocated("node-a"))
	other.Status.Allocation.Devices.Results[0].Driver = "gpu.nvidia.com"
	otherClass := groveClaim()
	otherClass.Spec.Devices.Requests[0].Exactly.DeviceClassName = "gpu.nvidia.com"
	firstAvailable := groveClaim()
	firstAvailable.Spec.Devices.Requests[0] = resourceapi.DeviceRequest{Name: "gpu", FirstAvailable: []resourceapi.DeviceSubRequest{
		{Name: "big", DeviceClassName: "gpu.nvidia.com"}, {Name: "mig", DeviceClassName: "mig.gpudra.dev"},
	}}
	tests := map[string]struct {
		claim *resourceapi.ResourceClaim
		want  bool
	}{
		"our class":                    {groveClaim(), true},
		"allocated by our driver":      {groveClaim(allocated("node-a")), true},
		"allocated by another driver":  {other, false},
		"another class":                {otherClass, false},
		"our class among alternatives": {firstAvailable, true},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			require.Equal(t, tc.want, IsOurs(tc.claim))
		})
	}
}
