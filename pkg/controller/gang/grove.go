package gang

import (
	"fmt"
	"strings"

	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/gpudra/gpudra/pkg/webhook"
)

// Grove's schema, in one place: everything the controller reads of a Grove
// PodGang (an unstructured object: Grove's types are not imported) and the
// label that ties a pod to its PodGang. A Grove gang is otherwise a gang
// like any other (gangs.go).

// PodGangs is Grove's PodGang resource.
var PodGangs = schema.GroupVersionResource{Group: "scheduler.grove.io", Version: "v1alpha1", Resource: "podgangs"}

// podGangKind is the PodGang's kind, for owner references.
const podGangKind = "PodGang"

// LabelPodGang is the label Grove puts on the pods of a PodGang; the
// webhook, which holds such pods at creation, owns the name.
const LabelPodGang = webhook.LabelGrovePodGang

// podGangGroup is one entry of a Grove PodGang's spec.podgroups: its name,
// its pods' names and its minReplicas. (Not a Workload API PodGroup.)
type podGangGroup struct {
	name        string
	pods        []string
	minReplicas int64
}

// podGangGroups reads a Grove PodGang's spec.podgroups.
func podGangGroups(pg *unstructured.Unstructured) ([]podGangGroup, error) {
	raw, _, err := unstructured.NestedSlice(pg.Object, "spec", "podgroups")
	if err != nil {
		return nil, fmt.Errorf("PodGang %s/%s: spec.podgroups: %w", pg.GetNamespace(), pg.GetName(), err)
	}
	var out []podGangGroup
	for i, r := range raw {
		m, ok := r.(map[string]any)
		if !ok {
			return nil, fmt.Errorf("PodGang %s/%s: spec.podgroups[%d] is not an object", pg.GetNamespace(), pg.GetName(), i)
		}
		g := podGangGroup{}
		g.name, _, _ = unstructured.NestedString(m, "name")
		g.minReplicas, _, _ = unstructured.NestedInt64(m, "minReplicas")
		refs, _, _ := unstructured.NestedSlice(m, "podReferences")
		for _, ref := range refs {
			if rm, ok := ref.(map[string]any); ok {
				if n, _, _ := unstructured.NestedString(rm, "name"); n != "" {
					g.pods = append(g.pods, n)
				}
			}
		}
		out = append(out, g)
	}
	return out, nil
}

// podGang is a PodGang from the informer; nil when absent or when the
// controller does not watch PodGangs (Options.Grove off).
func (c *Controller) podGang(namespace, name string) *unstructured.Unstructured {
	if c.podGangs == nil {
		return nil
	}
	obj, ok, err := c.podGangs.GetByKey(namespace + "/" + name)
	if err != nil || !ok {
		return nil
	}
	return obj.(*unstructured.Unstructured)
}

// missingPodGangPods says what a Grove gang waits for before it can be
// planned: its PodGang (pg nil), or, per group of the PodGang, the pods
// short of its minReplicas; "" when none.
func (g *Gang) missingPodGangPods(pg *unstructured.Unstructured) string {
	if pg == nil {
		return "its PodGang " + g.Name
	}
	groups, err := podGangGroups(pg)
	if err != nil {
		return err.Error()
	}
	present := map[string]bool{}
	for _, p := range g.Pods {
		present[p.Name] = true
	}
	var missing []string
	for _, grp := range groups {
		n := 0
		for _, name := range grp.pods {
			if present[name] {
				n++
			}
		}
		if int64(n) < grp.minReplicas {
			missing = append(missing, fmt.Sprintf("group %s: %d of %d pods", grp.name, n, grp.minReplicas))
		}
	}
	return strings.Join(missing, "; ")
}

// podGangMinCount is the minCount of a Grove gang's one PodGroup (Workload
// API path): the sum of its PodGang's groups' minReplicas (at least 1
// each).
func podGangMinCount(g *Gang, pg *unstructured.Unstructured) (int32, error) {
	if pg == nil {
		return 0, fmt.Errorf("gang %s: its PodGang is gone", g.Key)
	}
	groups, err := podGangGroups(pg)
	if err != nil {
		return 0, err
	}
	var n int64
	for _, grp := range groups {
		n += max(grp.minReplicas, 1)
	}
	return int32(n), nil
}

// ownedByPodGang makes a Grove gang's Workload its PodGang's: deleted with
// it, and naming it as the Workload's controller.
func ownedByPodGang(wl *schedulingv1beta1.Workload, pg *unstructured.Unstructured) {
	wl.OwnerReferences = []metav1.OwnerReference{{APIVersion: PodGangs.GroupVersion().String(), Kind: podGangKind, Name: pg.GetName(), UID: pg.GetUID()}}
	wl.Spec.ControllerRef = &schedulingv1beta1.TypedLocalObjectReference{APIGroup: PodGangs.Group, Kind: podGangKind, Name: pg.GetName()}
}
