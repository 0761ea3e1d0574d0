package devcluster

import (
	"context"
	"fmt"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"sigs.k8s.io/yaml"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

var crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// installGpudraCRDs installs gpudra's CRDs (GpuReservation, GpuQueue), the
// same documents as the chart's crds/.
func (c *Cluster) installGpudraCRDs(ctx context.Context) error {
	docs, err := gpudrav1.CRDs()
	if err != nil {
		return err
	}
	var crds []*unstructured.Unstructured
	for _, doc := range docs {
		u := &unstructured.Unstructured{}
		if err := yaml.Unmarshal(doc, &u.Object); err != nil {
			return fmt.Errorf("decode gpudra CRD: %w", err)
		}
		crds = append(crds, u)
	}
	return c.installCRDs(ctx, crds)
}

// installCRDs applies CRDs and waits until the API server serves them.
func (c *Cluster) installCRDs(ctx context.Context, crds []*unstructured.Unstructured) error {
	if err := c.Apply(ctx, "", crds); err != nil {
		return fmt.Errorf("install CRDs: %w", err)
	}
	dyn, err := dynamic.NewForConfig(c.RESTConfig)
	if err != nil {
		return err
	}
	for _, crd := range crds {
		err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
			got, err := dyn.Resource(crdGVR).Get(ctx, crd.GetName(), metav1.GetOptions{})
			if err != nil {
				return false, nil
			}
			conds, _, _ := unstructured.NestedSlice(got.Object, "status", "conditions")
			for _, cond := range conds {
				m, _ := cond.(map[string]any)
				if m["type"] == "Established" && m["status"] == "True" {
					return true, nil
				}
			}
			return false, nil
		})
		if err != nil {
			return fmt.Errorf("CRD %s not established: %w", crd.GetName(), err)
		}
	}
	return nil
}
