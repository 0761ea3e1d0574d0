package gang

import (
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
)

// dropUnread is the informers' transform: it drops, before an object is
// cached, what the gang controller never reads, so that its memory follows
// what it uses rather than what a large cluster stores (issue 26). The
// controller only patches pods and nodes it reads from these caches (JSON
// and strategic-merge patches of the fields it keeps) and updates claims,
// whose fields it keeps, so nothing dropped is ever written back.
//
// Dropped everywhere: managed fields (often half an object). Pods: volumes,
// and of each container everything but its name and resources (claims);
// container statuses. Nodes: images, volumes and daemon endpoints.
func dropUnread(obj any) (any, error) {
	if m, err := meta.Accessor(obj); err == nil {
		m.SetManagedFields(nil)
	}
	switch o := obj.(type) {
	case *corev1.Pod:
		o.Spec.Volumes = nil
		o.Spec.Containers = slimContainers(o.Spec.Containers)
		o.Spec.InitContainers = slimContainers(o.Spec.InitContainers)
		o.Spec.EphemeralContainers = nil
		o.Status.ContainerStatuses, o.Status.InitContainerStatuses, o.Status.EphemeralContainerStatuses = nil, nil, nil
	case *corev1.Node:
		o.Status.Images, o.Status.VolumesInUse, o.Status.VolumesAttached = nil, nil, nil
		o.Status.DaemonEndpoints = corev1.NodeDaemonEndpoints{}
	}
	return obj, nil
}

func slimContainers(cs []corev1.Container) []corev1.Container {
	if cs == nil {
		return nil
	}
	out := make([]corev1.Container, len(cs))
	for i, c := range cs {
		out[i] = corev1.Container{Name: c.Name, Resources: c.Resources}
	}
	return out
}
