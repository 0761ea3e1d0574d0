package grove

import (
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
)

var t0 = time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)

// claimOpt changes a fixture claim.
type claimOpt func(*resourceapi.ResourceClaim)

// groveClaim is a PCSG PerReplica claim as Grove makes it: grove-demo's
// scaling group engine, replica 0, template engine-gpu.
func groveClaim(opts ...claimOpt) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{
			Name: "grove-demo-0-engine-0-engine-gpu", Namespace: "default", UID: "claim-uid",
			Labels: map[string]string{
				LabelManagedBy: ManagedByGrove, LabelComponent: ComponentResourceClaim, LabelPartOf: "grove-demo",
				LabelScalingGroup: "grove-demo-0-engine", LabelScalingGroupReplica: "0",
			},
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: "grove.io/v1alpha1", Kind: "PodCliqueScalingGroup", Name: "grove-demo-0-engine",
				UID: "pcsg-uid", Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true),
			}},
		},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.gpudra.dev"}}},
		}},
	}
	for _, o := range opts {
		o(c)
	}
	return c
}

// allocated allocates gpu-0 of the node's pool, on that node.
func allocated(node string) claimOpt {
	return func(c *resourceapi.ResourceClaim) {
		c.Status.Allocation = &resourceapi.AllocationResult{
			Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{
				{Request: "gpu", Driver: "gpu.gpudra.dev", Pool: node, Device: "gpu-0"},
			}},
			NodeSelector: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
				MatchFields: []corev1.NodeSelectorRequirement{{Key: "metadata.name", Operator: corev1.NodeSelectorOpIn, Values: []string{node}}},
			}}},
		}
	}
}

// config sets the claim's GpuConfig (in the spec, and in the allocation if
// there is one, as the scheduler copies it).
func config(params string) claimOpt {
	return func(c *resourceapi.ResourceClaim) {
		dc := resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{
			Driver: "gpu.gpudra.dev", Parameters: runtime.RawExtension{Raw: []byte(params)},
		}}
		c.Spec.Devices.Config = []resourceapi.DeviceClaimConfiguration{{DeviceConfiguration: dc}}
		if a := c.Status.Allocation; a != nil {
			a.Devices.Config = []resourceapi.DeviceAllocationConfiguration{{Source: resourceapi.AllocationConfigSourceClaim, DeviceConfiguration: dc}}
		}
	}
}

func reservedFor(pods ...*corev1.Pod) claimOpt {
	return func(c *resourceapi.ResourceClaim) {
		for _, p := range pods {
			c.Status.ReservedFor = append(c.Status.ReservedFor, resourceapi.ResourceClaimConsumerReference{Resource: "pods", Name: p.Name, UID: p.UID})
		}
	}
}

type podOpt func(*corev1.Pod)

// consumer is a Grove pod with the claim injected into its container.
func consumer(name string, opts ...podOpt) *corev1.Pod {
	claim := "grove-demo-0-engine-0-engine-gpu"
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", UID: types.UID(name + "-uid"),
			Labels: map[string]string{LabelManagedBy: ManagedByGrove}},
		Spec: corev1.PodSpec{
			ResourceClaims: []corev1.PodResourceClaim{{Name: claim, ResourceClaimName: ptr.To(claim)}},
			Containers: []corev1.Container{{Name: "engine", Resources: corev1.ResourceRequirements{
				Claims: []corev1.ResourceClaim{{Name: claim}},
			}}},
		},
		Status: corev1.PodStatus{Phase: corev1.PodPending},
	}
	for _, o := range opts {
		o(p)
	}
	return p
}

func boundTo(node string) podOpt {
	return func(p *corev1.Pod) { p.Spec.NodeName, p.Status.Phase = node, corev1.PodRunning }
}

func nodeSelector(kv ...string) podOpt {
	return func(p *corev1.Pod) { p.Spec.NodeSelector = map[string]string{kv[0]: kv[1]} }
}

func unschedulable(since time.Time, msg string) podOpt {
	return func(p *corev1.Pod) {
		p.Status.Conditions = append(p.Status.Conditions, corev1.PodCondition{
			Type: corev1.PodScheduled, Status: corev1.ConditionFalse, Reason: corev1.PodReasonUnschedulable,
			Message: msg, LastTransitionTime: metav1.NewTime(since),
		})
	}
}

func runAsUser(pod, container *int64) podOpt {
	return func(p *corev1.Pod) {
		if pod != nil {
			p.Spec.SecurityContext = &corev1.PodSecurityContext{RunAsUser: pod}
		}
		if container != nil {
			p.Spec.Containers[0].SecurityContext = &corev1.SecurityContext{RunAsUser: container}
		}
	}
}

func node(name string, lbls map[string]string, taints ...corev1.Taint) *corev1.Node {
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: lbls}, Spec: corev1.NodeSpec{Taints: taints}}
}

func manyConsumers(n int) []*corev1.Pod {
	out := make([]*corev1.Pod, 0, n)
	for i := range n {
		out = append(out, consumer(fmt.Sprintf("p-%03d", i)))
	}
	return out
}

// reservedForPodGroup reserves the claim for a PodGroup, as the claim
// controller does with DRAWorkloadResourceClaims.
func reservedForPodGroup(name string) claimOpt {
	return func(c *resourceapi.ResourceClaim) {
		c.Status.ReservedFor = append(c.Status.ReservedFor, resourceapi.ResourceClaimConsumerReference{
			APIGroup: "scheduling.k8s.io", Resource: "podgroups", Name: name, UID: types.UID(name + "-uid")})
	}
}

// inPodGroup makes the pods name the PodGroup in spec.schedulingGroup.
func inPodGroup(name string, pods []*corev1.Pod) []*corev1.Pod {
	for _, p := range pods {
		p.Spec.SchedulingGroup = &corev1.PodSchedulingGroup{PodGroupName: ptr.To(name)}
	}
	return pods
}
