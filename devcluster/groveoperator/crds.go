// Package groveoperator is devcluster's stand-in for Grove's operator
// (ai-dynamo/grove v0.1.0-alpha.12-rc1): Grove's real CRDs, from its API
// module, and an operator that makes from a PodCliqueSet what Grove makes
// (PodCliques, scaling groups, the ResourceClaims of resourceSharing, gated
// pods and PodGangs; operator.go says what it leaves out). The stand-in is
// devcluster's code; the objects' types and CRDs are Grove's. The PodGang
// CRD is a minimal one, as Grove's scheduler API module does not download
// here.
package groveoperator

import (
	"context"
	"fmt"
	"time"

	grovecommon "github.com/ai-dynamo/grove/operator/api/common"
	grove "github.com/ai-dynamo/grove/operator/api/core/v1alpha1"
	grovecrds "github.com/ai-dynamo/grove/operator/api/core/v1alpha1/crds"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	restclient "k8s.io/client-go/rest"
	"sigs.k8s.io/yaml"
)

// podGangCRD is a minimal CRD for Grove's PodGang (scheduler.grove.io):
// Grove's scheduler API module does not download here, so its CRD cannot be
// installed. The stand-in writes PodGangs as Grove does and reads them as
// unstructured objects; the schema keeps whatever it is given.
const podGangCRD = `
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: podgangs.scheduler.grove.io
spec:
  group: scheduler.grove.io
  scope: Namespaced
  names: {plural: podgangs, singular: podgang, kind: PodGang, listKind: PodGangList, shortNames: [pg]}
  versions:
  - name: v1alpha1
    served: true
    storage: true
    subresources: {status: {}}
    schema:
      openAPIV3Schema:
        type: object
        x-kubernetes-preserve-unknown-fields: true
`

var (
	podGangGVR = schema.GroupVersionResource{Group: "scheduler.grove.io", Version: "v1alpha1", Resource: "podgangs"}
)

// CRDs are Grove's own CRDs, as its API module embeds them, and the
// PodGang CRD.
func CRDs() ([]*unstructured.Unstructured, error) {
	var objs []*unstructured.Unstructured
	for _, doc := range []string{grovecrds.PodCliqueSetCRD(), grovecrds.PodCliqueCRD(), grovecrds.PodCliqueScalingGroupCRD(),
		grovecrds.ClusterTopologyCRD(), podGangCRD} {
		u := &unstructured.Unstructured{}
		if err := yaml.Unmarshal([]byte(doc), &u.Object); err != nil {
			return nil, fmt.Errorf("decode Grove CRD: %w", err)
		}
		objs = append(objs, u)
	}
	return objs, nil
}

// WaitForPods waits until the stand-in has created every pod of the
// namespace's PodCliqueSets, so that a wait for Running pods that follows
// sees them: they appear only after the token Secret is filled.
func WaitForPods(ctx context.Context, cfg *restclient.Config, client kubernetes.Interface, namespace string, timeout time.Duration) error {
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return err
	}
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		list, err := dyn.Resource(pcsGVR).Namespace(namespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		for i := range list.Items {
			var pcs grove.PodCliqueSet
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(list.Items[i].Object, &pcs); err != nil {
				return false, fmt.Errorf("decode PodCliqueSet %s: %w", list.Items[i].GetName(), err)
			}
			pods, err := client.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{LabelSelector: grovecommon.LabelPartOfKey + "=" + pcs.Name})
			if err != nil || len(pods.Items) < expectedGrovePods(&pcs) {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		return fmt.Errorf("Grove pods not created within %s: %w", timeout, err)
	}
	return nil
}

// expectedGrovePods is how many pods Grove makes for a PodCliqueSet.
func expectedGrovePods(pcs *grove.PodCliqueSet) int {
	applyDefaults(pcs)
	inGroup := map[string]bool{}
	perReplica := 0
	for _, sg := range pcs.Spec.Template.PodCliqueScalingGroupConfigs {
		for _, name := range sg.CliqueNames {
			inGroup[name] = true
			if c := findClique(pcs, name); c != nil {
				perReplica += int(*sg.Replicas) * int(c.Spec.Replicas)
			}
		}
	}
	for _, c := range pcs.Spec.Template.Cliques {
		if !inGroup[c.Name] {
			perReplica += int(c.Spec.Replicas)
		}
	}
	return int(pcs.Spec.Replicas) * perReplica
}
