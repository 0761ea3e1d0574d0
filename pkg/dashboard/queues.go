package dashboard

import (
	"cmp"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/local"
)

// The queues: every GpuQueue, the queued reservations and gated gangs in
// the queues they name (positions as the controller reported them), and
// the pending pods with claims that are in no gang, under the queue ""
// (not queued: the scheduler's reason is why they wait).

// positionRE reads the position the gang controller writes into its
// condition's message (pkg/controller/gang: reportWaiting).
var positionRE = regexp.MustCompile(`^position (\d+) in queue (\S+): `)

func (b *builder) queues(v *View) []Queue {
	byName := map[string]*Queue{}
	queue := func(name string) *Queue {
		q := byName[name]
		if q == nil {
			q = &Queue{Name: name, Policy: string(gpudrav1.FCFS), Items: []QueueItem{}}
			byName[name] = q
		}
		return q
	}
	for _, gq := range b.in.Queues {
		q := queue(gq.Name)
		q.Exists = true
		q.Kubectl = kubectlQueue(gq.Name)
		if gq.Spec.Policy != "" {
			q.Policy = string(gq.Spec.Policy)
		}
	}
	for _, r := range b.in.Reservations {
		if r.Status.Phase != gpudrav1.ReservationQueued && r.Status.Phase != "" {
			continue
		}
		name := cmp.Or(r.Spec.Queue, gpudrav1.DefaultQueue)
		it := QueueItem{Kind: gpudrav1.KindGpuReservation, Namespace: r.Namespace, Name: r.Name, Position: int(r.Status.QueuePosition),
			Reason: r.Status.Reason, Message: r.Status.Message, Devices: int64(max(r.Spec.Claims, 1)) * max(r.Spec.Count, 1),
			Kubectl: kubectlReservation(r.Namespace, r.Name)}
		since := r.CreationTimestamp.Time
		if r.Status.QueuedAt != nil {
			since = r.Status.QueuedAt.Time
		}
		if !since.IsZero() {
			it.Since = &since
		}
		if r.Spec.Duration != nil {
			it.Duration = r.Spec.Duration.Duration.String()
		}
		b.seeNamespace(r.Namespace)
		q := queue(name)
		q.Items = append(q.Items, it)
	}
	for _, g := range b.gangs() {
		q := queue(g.queue)
		q.Items = append(q.Items, g.item)
	}
	for _, it := range b.pendingPods() {
		q := queue("")
		q.Items = append(q.Items, it)
	}
	out := make([]Queue, 0, len(byName))
	for _, q := range byName {
		slices.SortFunc(q.Items, compareItems)
		numberPositions(q.Items)
		if q.Name != "" {
			estimateStarts(q.Items, b.in.Now)
			v.Summary.Waiting += len(q.Items)
		}
		out = append(out, *q)
	}
	slices.SortFunc(out, func(a, b Queue) int { return cmp.Compare(a.Name, b.Name) })
	return out
}

// compareItems orders a queue: by the controller's position, items
// without one (not yet seen by it) after them by arrival.
func compareItems(a, b QueueItem) int {
	if (a.Position == 0) != (b.Position == 0) {
		if a.Position == 0 {
			return 1
		}
		return -1
	}
	if c := cmp.Compare(a.Position, b.Position); c != 0 {
		return c
	}
	var as, bs time.Time
	if a.Since != nil {
		as = *a.Since
	}
	if b.Since != nil {
		bs = *b.Since
	}
	return cmp.Or(as.Compare(bs), cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Name, b.Name))
}

// numberPositions numbers a sorted queue's items that have a position 1,
// 2, 3... in order: the positions the controller reported are read from
// each item's own status or pod condition, written at different times, and
// two of them can say 1 for a moment (one written before the item ahead of
// it left, one after); a queue never shows two items at one place.
func numberPositions(items []QueueItem) {
	n := 0
	for i := range items {
		if items[i].Position > 0 {
			n++
			items[i].Position = n
		}
	}
}

// estimateStarts sets each item's EstimatedStart: now plus the declared
// durations of the items ahead of it, run one after another; none from
// the first item that follows one without a declared duration.
func estimateStarts(items []QueueItem, now time.Time) {
	at := now
	for i := range items {
		start := at
		items[i].EstimatedStart = &start
		d, err := time.ParseDuration(items[i].Duration)
		if err != nil || d <= 0 {
			return
		}
		at = at.Add(d)
	}
}

type gangWait struct {
	queue string
	item  QueueItem
}

// gangHeldBack says whether a gang's pod waits for its gang: gated by
// gpudra (the gates path), or unbound with the controller's
// GangAllocated=False (the Workload API path, where the pods are not gated
// but wait for a PodGroup the controller has not made yet).
func gangHeldBack(p *corev1.Pod) bool {
	if p.DeletionTimestamp != nil || p.Spec.NodeName != "" {
		return false
	}
	if slices.ContainsFunc(p.Spec.SchedulingGates, func(g corev1.PodSchedulingGate) bool { return g.Name == gpudrav1.SchedulingGate }) {
		return true
	}
	return slices.ContainsFunc(p.Status.Conditions, func(c corev1.PodCondition) bool {
		return string(c.Type) == gpudrav1.GroupName+"/GangAllocated" && c.Status == corev1.ConditionFalse
	})
}

// gangAdmitted says whether a gang's pod shows that the controller let its
// gang go (bound, or GangAllocated=True): the gang's other pods may still be
// gated, or show the condition they had while it waited (the controller
// lifts gates and writes conditions one pod after another), but the gang is
// no longer in its queue.
func gangAdmitted(p *corev1.Pod) bool {
	return p.Spec.NodeName != "" || slices.ContainsFunc(p.Status.Conditions, func(c corev1.PodCondition) bool {
		return string(c.Type) == gpudrav1.GroupName+"/GangAllocated" && c.Status == corev1.ConditionTrue
	})
}

// gangs are the gangs with a pod held back (gangHeldBack), one item per
// (namespace, gang), with the condition the controller set on its pods.
func (b *builder) gangs() []gangWait {
	type acc struct {
		pods   []*corev1.Pod
		gated  bool
		claims map[string]bool
	}
	byKey := map[string]*acc{}
	for _, p := range b.in.Pods {
		name := p.Labels[gpudrav1.LabelGang]
		if name == "" {
			continue
		}
		key := p.Namespace + "/" + name
		a := byKey[key]
		if a == nil {
			a = &acc{claims: map[string]bool{}}
			byKey[key] = a
		}
		a.pods = append(a.pods, p)
		if gangHeldBack(p) {
			a.gated = true
		}
	}
	var out []gangWait
	for _, a := range byKey {
		if !a.gated || slices.ContainsFunc(a.pods, gangAdmitted) {
			continue
		}
		slices.SortFunc(a.pods, func(x, y *corev1.Pod) int { return cmp.Compare(x.Name, y.Name) })
		first := a.pods[0]
		name := first.Labels[gpudrav1.LabelGang]
		g := gangWait{queue: cmp.Or(first.Annotations[gpudrav1.AnnotationQueue], gpudrav1.DefaultQueue)}
		it := QueueItem{Kind: "Gang", Namespace: first.Namespace, Name: name, Kubectl: kubectlGang(first.Namespace, name)}
		if d, err := time.ParseDuration(first.Annotations[gpudrav1.AnnotationDuration]); err == nil && d > 0 {
			it.Duration = d.String()
		}
		since := first.CreationTimestamp.Time
		for _, p := range a.pods {
			if p.CreationTimestamp.Time.Before(since) {
				since = p.CreationTimestamp.Time
			}
			for _, c := range p.Status.Conditions {
				if string(c.Type) != gpudrav1.GroupName+"/GangAllocated" || c.Status != corev1.ConditionFalse || it.Reason != "" {
					continue
				}
				it.Reason, it.Message = c.Reason, c.Message
				if m := positionRE.FindStringSubmatch(c.Message); m != nil {
					it.Position, _ = strconv.Atoi(m[1])
					it.Message = strings.TrimPrefix(c.Message, m[0])
				}
			}
			it.Devices += b.podDevices(p, a.claims)
		}
		if !since.IsZero() {
			it.Since = &since
		}
		b.seeNamespace(first.Namespace)
		g.item = it
		out = append(out, g)
	}
	return out
}

// podDevices counts the devices a pod's claims ask for (exact counts;
// a claim counted once however many pods share it).
func (b *builder) podDevices(p *corev1.Pod, counted map[string]bool) int64 {
	var n int64
	for _, name := range podClaimNames(p) {
		key := p.Namespace + "/" + name
		c := b.claims[key]
		if c == nil || counted[key] {
			continue
		}
		counted[key] = true
		n += local.DevicesAsked(c.Spec.Devices.Requests)
	}
	return n
}

// podClaimNames are the names of a pod's claims: named in its spec, or
// generated from a template (the pod's status says which).
func podClaimNames(p *corev1.Pod) []string {
	var out []string
	for _, rc := range p.Spec.ResourceClaims {
		if rc.ResourceClaimName != nil {
			out = append(out, *rc.ResourceClaimName)
		}
	}
	for _, s := range p.Status.ResourceClaimStatuses {
		if s.ResourceClaimName != nil {
			out = append(out, *s.ResourceClaimName)
		}
	}
	return out
}

// pendingPods are the unscheduled pods with claims in no gang, with the
// scheduler's reason where it gave one.
func (b *builder) pendingPods() []QueueItem {
	var out []QueueItem
	for _, p := range b.in.Pods {
		if len(p.Spec.ResourceClaims) == 0 || p.Spec.NodeName != "" || p.Labels[gpudrav1.LabelGang] != "" ||
			p.Status.Phase != corev1.PodPending || p.DeletionTimestamp != nil {
			continue
		}
		it := QueueItem{Kind: "Pod", Namespace: p.Namespace, Name: p.Name, Kubectl: kubectlPod(p.Namespace, p.Name)}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse {
				it.Reason, it.Message = c.Reason, c.Message
			}
		}
		if since := p.CreationTimestamp.Time; !since.IsZero() {
			it.Since = &since
		}
		it.Devices = b.podDevices(p, map[string]bool{})
		b.seeNamespace(p.Namespace)
		out = append(out, it)
	}
	return out
}
