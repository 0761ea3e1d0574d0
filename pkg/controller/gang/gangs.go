package gang

import (
	"cmp"
	"context"
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
	"github.com/gpudra/gpudra/pkg/controller/queue"
)

// Collecting gangs, the core's first step for both paths: the pods of every
// gang with a member still waiting on gpudra (waitsOnGpudra) are grouped
// into Gangs, and a complete one becomes a queue item. Grove's PodGang is
// read in grove.go; the claims a pod names are resolved here.

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
	// Waiting are the members that still wait on gpudra (waitsOnGpudra):
	// on the gate path those that carry its gate, on the Workload API path
	// those whose PodGroup does not exist yet.
	Waiting []*corev1.Pod
	// Admitted: a member no longer waits on gpudra (its gate was lifted,
	// or its PodGroup made). The gang was admitted once; its waiting
	// members are handed over at once, whatever happened in between (a
	// failed lift, a recreated pod).
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
	// KueueQueue is the Kueue LocalQueue of the gang's pods (label
	// kueue.x-k8s.io/queue-name): Kueue admitted the gang, so it waits in
	// no GpuQueue; gpudra only places it (docs/queues.md). Empty: not
	// Kueue's.
	KueueQueue string
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

// waitsOnGpudra says whether a gang pod still waits on gpudra to be handed
// to the scheduler. It is the one question the core asks each path about a
// pod, and it means one thing per path:
//
//   - gate path (stillGated, gates.go): the pod carries gpudra's
//     scheduling gate, and this controller did not just lift it;
//   - Workload API path (awaitsPodGroup, workload.go): the pod names its
//     gang's PodGroup (the webhook set spec.schedulingGroup), which does
//     not exist yet and was not just made. A pod that names another
//     scheduling group belongs to somebody else's PodGroup.
//
// A gang with such a member is collected each round (gangPods); its members
// that no longer wait make it Admitted. An event about such a pod runs a
// round (Run); one about another pod is a soft kick at most.
func (c *Controller) waitsOnGpudra(p *corev1.Pod) bool {
	if c.opts.Path == PathWorkload {
		return c.awaitsPodGroup(p)
	}
	return c.stillGated(p)
}

// gangMemberIndex indexes every gang member pod (member: not ended, not
// being deleted) by its gang's key, whether it still waits on gpudra or
// not.
const gangMemberIndex = "gang"

// memberGang is gangMemberIndex's index function: the key
// ("<namespace>/<gang name>") of a member pod's gang.
func memberGang(obj any) ([]string, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok || !member(p) {
		return nil, nil
	}
	if name, _ := gangKey(p); name != "" {
		return []string{p.Namespace + "/" + name}, nil
	}
	return nil, nil
}

// gangPods are the members of the gangs that have a pod waiting on gpudra,
// waiting or not.
func (c *Controller) gangPods() []*corev1.Pod {
	var out []*corev1.Pod
	for _, key := range c.pods.ListIndexFuncValues(gangMemberIndex) {
		objs, _ := c.pods.ByIndex(gangMemberIndex, key)
		if !slices.ContainsFunc(objs, func(o any) bool { return c.waitsOnGpudra(o.(*corev1.Pod)) }) {
			continue
		}
		for _, o := range objs {
			out = append(out, o.(*corev1.Pod))
		}
	}
	return out
}

// gangItems collects the gangs with a member waiting on gpudra: a complete
// one that needs planning becomes an item; one admitted before, or with
// nothing left to allocate, is handed over at once (admitGang); a
// half-written one is taken back to be planned whole; the others are told
// what they wait for. found says whether there was any such gang.
func (c *Controller) gangItems(ctx context.Context, snap *snapshot) (items []*item, found bool, errs []error) {
	for _, g := range collectGangs(c.gangPods(), c.waitsOnGpudra, c.podGang, c.podClaims) {
		found = true
		if g.Admitted {
			// Released before: its remaining waiting members go now (a
			// gate lift that failed, a pod recreated by its owner).
			errs = append(errs, c.admitGang(ctx, g))
			continue
		}
		if g.Missing != "" {
			c.reportGang(ctx, g, ReasonWaitingForPods, "waiting for "+g.Missing)
			continue
		}
		groups, err := gangGroups(g, snap.nodes, c.podClaims)
		if err != nil {
			c.reportGang(ctx, g, ReasonWaitingForPods, "waiting for "+err.Error())
			continue
		}
		if len(groups) == 0 {
			// Everything is allocated (a round stopped between writing and
			// lifting the gates, or the pods use held claims only).
			errs = append(errs, c.admitGang(ctx, g))
			continue
		}
		if half := c.halfWrittenGang(g); len(half) > 0 {
			// Some of its claims hold this controller's writes, others
			// none (a hand-off that failed after the shared claims were
			// written, a leader that stopped between writes): planned
			// around them, the gang could leave its NVLink domain. They
			// are taken back and the whole gang is planned anew, as a
			// half-written reservation is.
			n, err := c.takeBackGang(ctx, g, half)
			errs = append(errs, err)
			if n > 0 {
				c.kick() // planned whole next round; a round that took nothing back waits for an event
			}
			continue
		}
		it := &item{kind: KindGang, queueName: g.Queue, gang: g, groups: groups}
		if g.KueueQueue != "" {
			it.queueName = "" // Kueue's, in no GpuQueue (planQueues)
		}
		it.Item = queue.Item{Key: KindGang + "/" + g.Key, Namespace: g.Namespace, Priority: g.Priority, QueuedAt: g.QueuedAt,
			Duration: g.Duration, Devices: demand(groups, nil)}
		for _, grp := range groups {
			for _, cl := range grp.Claims {
				it.classes = append(it.classes, requestClasses(cl)...)
			}
		}
		items = append(items, it)
	}
	return items, found, errs
}

// collectGangs groups gang pods into gangs, keeps those with a waiting
// member, and says, for each, whether it was admitted already or can be
// planned: for plain pods, the gang-size annotation's number of members
// exist; for Grove, the PodGang exists and each of its groups has at least
// minReplicas members. In both cases every member's claims must exist.
// waiting says whether a member still waits on gpudra (nil: it carries the
// gate; the controller passes waitsOnGpudra); podGangs looks up a PodGang
// (nil when absent); claims a pod's claims.
func collectGangs(pods []*corev1.Pod, waiting func(*corev1.Pod) bool, podGangs func(namespace, name string) *unstructured.Unstructured,
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
		if waiting == nil {
			waiting = gated
		}
		if waiting(p) {
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
		for _, p := range g.Pods {
			if q := p.Labels[gpudrav1.LabelKueueQueue]; q != "" {
				g.KueueQueue = q
			}
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

// missingPods says which members a gang waits for before it can be
// planned ("" when none): for plain pods, as many as the gang-size
// annotation says; for Grove, per group of its PodGang (grove.go).
func (g *Gang) missingPods(podGangs func(namespace, name string) *unstructured.Unstructured) string {
	if g.Grove {
		return g.missingPodGangPods(podGangs(g.Namespace, g.Name))
	}
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

// podClaims are a pod's claims. On the Workload API path a claim still to
// be made from a template is planned from the template: the claim
// controller makes it only once the pod's PodGroup exists.
func (c *Controller) podClaims(p *corev1.Pod) ([]*resourceapi.ResourceClaim, error) {
	var template func(namespace, name string) *resourceapi.ResourceClaimTemplate
	if c.opts.Path == PathWorkload {
		template = c.template
	}
	return claimsOfPod(p, c.claim, template)
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
