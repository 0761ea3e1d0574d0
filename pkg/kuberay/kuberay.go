// Package kuberay is what gpudra names of KubeRay (ray.io/v1, KubeRay
// v1.5): its resources, for the dynamic client. gpudra does not import
// KubeRay's module, which pins other Kubernetes versions (docs/ray.md).
package kuberay

import "k8s.io/apimachinery/pkg/runtime/schema"

// KubeRay's resources.
var (
	RayClusters = schema.GroupVersionResource{Group: "ray.io", Version: "v1", Resource: "rayclusters"}
	RayJobs     = schema.GroupVersionResource{Group: "ray.io", Version: "v1", Resource: "rayjobs"}
	RayServices = schema.GroupVersionResource{Group: "ray.io", Version: "v1", Resource: "rayservices"}
)
