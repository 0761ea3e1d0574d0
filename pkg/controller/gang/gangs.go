package gang

import (
	"cmp"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/webhook"
)

// LabelPodGang is the label Grove puts on the pods of a PodGang; the
// webhook, which holds such pods at creation, owns the name.
const LabelPodGang = webhook.LabelGrovePodGang

// Gang is the pods of one gang, whether enough of them exist to plan, and
// which still wait on gpudra to be handed to the scheduler.
type Gang struct {
	// Key is "<namespace>/<name>".
	Key, Namespace, Name string
	// Grove: a Grove PodGang; otherwise pods labelled gpudra.dev/gang.
	Grove bool
	// Pods are the gang's members, sorted by name: every pod of the gang
	// that has not ended and is not being deleted, gated or not. Counting
	// only the gated ones stranded pods: after one failed gate lift, or
	// for a pod a Job or Grove recreated, the gang looked incomplete for
	// ever.
	Pods []*corev1.Pod
	// Waiting are the members that still wait on gpudra: on the gate
	// path those that carry its gate, on the Workload API path those
	// whose PodGroup does not exist yet.
	Waiting []*corev1.Pod
	// Admitted: a member was released already (its gate lifted). The
	// gang was admitted once; its waiting members are released at once,
	// whatever happened in between (a failed lift, a recreated pod).
	Admitted bool
	// Missing says what the gang waits for before it can be planned
	// ("2 of 4 pods", "the claims of pod a"); empty: ready.
	Missing string
	// Queue, Priority, QueuedAt and Duration come from the gang's pods:
	// the queue annotation and declared duration of its first pod, the
	// highest pod priority, the oldest pod's creation.
	Queue    string
	Priority int32
	QueuedAt time.Time
	Duration *time.Duration
}

// gated says whether the pod carries gpudra's gate.
func gated(p *corev1.Pod) bool {
	return slices.ContainsFunc(p.Spec.SchedulingGates, func(g corev1.PodSchedulingGate) bool { return g.Name == gpudrav1.SchedulingGate })
}

// member says whether the pod counts as a member of its gang: it has not
// ended and is not being deleted.
func member(p *corev1.Pod) bool {
	return p.DeletionTimestamp == nil && p.Status.Phase != corev1.PodSucceeded && p.Status.Phase != corev1.PodFailed
}

// gangKey is the gang a pod belongs to, or "" for none.
func gangKey(p *corev1.Pod) (name string, grove bool) {
	if n := p.Labels[gpudrav1.LabelGang]; n != "" {
		return n, false
	}
	if n := p.Labels[LabelPodGang]; n != "" {
		return n, true
	}
	return "", false
}

// podGangGroups reads a Grove PodGang's spec.podgroups: each group's pod
// names and minReplicas.
type podGroup struct {
	name        string
	pods        []string
	minReplicas int64
}

func podGangGroups(pg *unstructured.Unstructured) ([]podGroup, error) {
	raw, _, err := unstructured.NestedSlice(pg.Object, "spec", "podgroups")
	if err != nil {
		return nil, fmt.Errorf("PodGang %s/%s: spec.podgroups: %w", pg.GetNamespace(), pg.GetName(), err)
	}
	var out []podGroup
	for i, r := range raw {
		m, ok := r.(map[string]any)
		if !ok {
			return nil, fmt.Errorf("PodGang %s/%s: spec.podgroups[%d] is not an object", pg.GetNamespace(), pg.GetName(), i)
		}
		g := podGroup{}
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

// collectGangs groups gang pods into gangs, keeps those with a waiting
// member, and says, for each, whether it was admitted already or can be
// planned: for plain pods, the gang-size annotation's number of members
// exist; for Grove, the PodGang exists and each of its groups has at least
// minReplicas members. In both cases every member's claims must exist.
// waits says whether a member still waits on gpudra (nil: it carries the
// gate; the controller also counts a pod whose gate lift the informer has
// not shown yet as released, and on the Workload API path asks whether the
// gang's PodGroup exists); podGangs looks up a PodGang (nil when
// absent); claims a claim.
func collectGangs(pods []*corev1.Pod, waits func(*corev1.Pod) bool, podGangs func(namespace, name string) *unstructured.Unstructured,
	claims podClaims) []*Gang {
	byKey := map[string]*Gang{}
	for _, p := range pods {
		if !member(p) {
			continue
		}
		name, grove := gangKey(p)
		if name == "" {
			continue
		}
		key := p.Namespace + "/" + name
		g := byKey[key]
		if g == nil {
			g = &Gang{Key: key, Namespace: p.Namespace, Name: name, Grove: grove, Queue: gpudrav1.DefaultQueue}
			byKey[key] = g
		}
		g.Pods = append(g.Pods, p)
		if waits == nil {
			waits = gated
		}
		if waits(p) {
			g.Waiting = append(g.Waiting, p)
		} else {
			g.Admitted = true
		}
	}
	out := make([]*Gang, 0, len(byKey))
	for _, g := range byKey {
		if len(g.Waiting) == 0 {
			continue // nothing of it waits on gpudra
		}
		slices.SortFunc(g.Pods, func(a, b *corev1.Pod) int { return strings.Compare(a.Name, b.Name) })
		slices.SortFunc(g.Waiting, func(a, b *corev1.Pod) int { return strings.Compare(a.Name, b.Name) })
		first := g.Pods[0]
		if q := first.Annotations[gpudrav1.AnnotationQueue]; q != "" {
			g.Queue = q
		}
		if d, err := time.ParseDuration(first.Annotations[gpudrav1.AnnotationDuration]); err == nil && d > 0 {
			g.Duration = &d
		}
		g.QueuedAt = first.CreationTimestamp.Time
		for i, p := range g.Pods {
			if pr := p.Spec.Priority; pr != nil && (i == 0 || *pr > g.Priority) {
				g.Priority = *pr
			}
			if p.CreationTimestamp.Time.Before(g.QueuedAt) {
				g.QueuedAt = p.CreationTimestamp.Time
			}
		}
		g.Missing = g.missingPods(podGangs)
		if g.Missing == "" {
			g.Missing = g.missingClaims(claims)
		}
		out = append(out, g)
	}
	slices.SortFunc(out, func(a, b *Gang) int { return cmp.Compare(a.Key, b.Key) })
	return out
}

func (g *Gang) missingPods(podGangs func(namespace, name string) *unstructured.Unstructured) string {
	if !g.Grove {
		raw := g.Pods[0].Annotations[gpudrav1.AnnotationGangSize]
		size, err := strconv.Atoi(raw)
		if err != nil || size < 1 {
			return fmt.Sprintf("a valid %s annotation (got %q)", gpudrav1.AnnotationGangSize, raw)
		}
		if len(g.Pods) < size {
			return fmt.Sprintf("%d of %d pods exist", len(g.Pods), size)
		}
		return ""
	}
	pg := podGangs(g.Namespace, g.Name)
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

func (g *Gang) missingClaims(claims podClaims) string {
	for _, p := range g.Pods {
		if _, err := claims(p); err != nil {
			return err.Error()
		}
	}
	return ""
}

// podClaims returns a pod's ResourceClaims, or an error naming the first
// that does not exist (yet).
type podClaims func(p *corev1.Pod) ([]*resourceapi.ResourceClaim, error)

// claimsByName are a pod's claims looked up by name: those it names, and
// those made from its templates (in its status once the claim controller
// made them).
func claimsByName(claim func(namespace, name string) *resourceapi.ResourceClaim) podClaims {
	return func(p *corev1.Pod) ([]*resourceapi.ResourceClaim, error) {
		return claimsOfPod(p, claim, nil)
	}
}

// claimsOfPod resolves a pod's claims. template, when not nil, stands in
// for a claim the claim controller has not made from its template yet:
// the claim as planned, from the template's spec. On the Workload API
// path the claim controller waits for a pod's PodGroup before it makes the
// claims, and the PodGroup is what the plan decides to create.
func claimsOfPod(p *corev1.Pod, claim func(namespace, name string) *resourceapi.ResourceClaim,
	template func(namespace, name string) *resourceapi.ResourceClaimTemplate) ([]*resourceapi.ResourceClaim, error) {
	var out []*resourceapi.ResourceClaim
	for _, rc := range p.Spec.ResourceClaims {
		name := ""
		switch {
		case rc.ResourceClaimName != nil:
			name = *rc.ResourceClaimName
		case rc.ResourceClaimTemplateName != nil:
			i := slices.IndexFunc(p.Status.ResourceClaimStatuses, func(s corev1.PodResourceClaimStatus) bool { return s.Name == rc.Name })
			switch {
			case i >= 0 && p.Status.ResourceClaimStatuses[i].ResourceClaimName == nil:
				continue // not needed
			case i >= 0:
				name = *p.Status.ResourceClaimStatuses[i].ResourceClaimName
			case template == nil:
				return nil, fmt.Errorf("the claim %s of pod %s (not made from its template yet)", rc.Name, p.Name)
			default:
				t := template(p.Namespace, *rc.ResourceClaimTemplateName)
				if t == nil {
					return nil, fmt.Errorf("the ResourceClaimTemplate %s of pod %s", *rc.ResourceClaimTemplateName, p.Name)
				}
				out = append(out, &resourceapi.ResourceClaim{
					ObjectMeta: metav1.ObjectMeta{Name: p.Name + "-" + rc.Name, Namespace: p.Namespace, Labels: map[string]string{labelPlanned: "true"}},
					Spec:       *t.Spec.Spec.DeepCopy()})
				continue
			}
		default:
			continue
		}
		c := claim(p.Namespace, name)
		if c == nil {
			return nil, fmt.Errorf("claim %s of pod %s", name, p.Name)
		}
		out = append(out, c)
	}
	return out, nil
}

// labelPlanned marks a claim that claimsOfPod made from a template, only
// to plan with: it is never written.
const labelPlanned = "gpudra.dev/planned-from-template"
