package gang

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

// The informers' transform keeps every field the controller reads and drops
// the bulk it never does.
func TestDropUnread(t *testing.T) {
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns", UID: "u", Labels: map[string]string{"gpudra.dev/gang": "g"},
			Annotations: map[string]string{"a": "b"}, OwnerReferences: []metav1.OwnerReference{{Name: "o"}},
			ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubectl"}}},
		Spec: corev1.PodSpec{
			NodeName: "n", Priority: ptr.To(int32(5)), PriorityClassName: "high", NodeSelector: map[string]string{"k": "v"},
			Affinity: &corev1.Affinity{}, Tolerations: []corev1.Toleration{{Key: "t"}},
			SchedulingGates: []corev1.PodSchedulingGate{{Name: "gpudra.dev/gang"}}, SchedulingGroup: &corev1.PodSchedulingGroup{PodGroupName: ptr.To("g")},
			ResourceClaims: []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: ptr.To("t")}},
			Volumes:        []corev1.Volume{{Name: "v"}},
			Containers: []corev1.Container{{Name: "c", Image: "i", Env: []corev1.EnvVar{{Name: "E"}}, Command: []string{"x"},
				Resources: corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: "gpu"}}}}},
		},
		Status: corev1.PodStatus{Phase: corev1.PodPending, NominatedNodeName: "n2",
			Conditions:                 []corev1.PodCondition{{Type: "gpudra.dev/GangAllocated"}},
			ResourceClaimStatuses:      []corev1.PodResourceClaimStatus{{Name: "gpu", ResourceClaimName: ptr.To("p-gpu")}},
			ContainerStatuses:          []corev1.ContainerStatus{{Name: "c"}},
			InitContainerStatuses:      []corev1.ContainerStatus{{Name: "i"}},
			EphemeralContainerStatuses: []corev1.ContainerStatus{{Name: "e"}}},
	}
	want := pod.DeepCopy()
	out, err := dropUnread(pod)
	require.NoError(t, err)
	got := out.(*corev1.Pod)

	want.ManagedFields = nil
	want.Spec.Volumes = nil
	want.Spec.Containers = []corev1.Container{{Name: "c", Resources: corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: "gpu"}}}}}
	want.Status.ContainerStatuses, want.Status.InitContainerStatuses, want.Status.EphemeralContainerStatuses = nil, nil, nil
	assert.Equal(t, want, got)

	node := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: "n", Labels: map[string]string{"k": "v"}, ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubelet"}}},
		Spec:       corev1.NodeSpec{Unschedulable: true, Taints: []corev1.Taint{{Key: "t"}}},
		Status: corev1.NodeStatus{Images: []corev1.ContainerImage{{Names: []string{"i"}}}, VolumesInUse: []corev1.UniqueVolumeName{"v"},
			Allocatable: corev1.ResourceList{corev1.ResourcePods: resource.MustParse("110")}},
	}
	wantNode := node.DeepCopy()
	wantNode.ManagedFields, wantNode.Status.Images, wantNode.Status.VolumesInUse = nil, nil, nil
	out, err = dropUnread(node)
	require.NoError(t, err)
	assert.Equal(t, wantNode, out)
}
