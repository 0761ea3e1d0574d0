package kubeclient

import (
	"fmt"
	"slices"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/discovery"
)

// ResourceServed asks discovery whether the API server serves the
// resource. A group version the server says it does not have (404), or
// one without the resource, is absent (false, nil); any other failure (a
// 500, a 429, a timeout, a refused connection) means discovery could not
// tell, and is an error: "could not tell" is never "absent".
func ResourceServed(disc discovery.ServerResourcesInterface, gvr schema.GroupVersionResource) (bool, error) {
	list, err := disc.ServerResourcesForGroupVersion(gvr.GroupVersion().String())
	switch {
	case apierrors.IsNotFound(err):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("discovery of %s: %w", gvr.GroupVersion(), err)
	}
	return slices.ContainsFunc(list.APIResources, func(r metav1.APIResource) bool { return r.Name == gvr.Resource }), nil
}
