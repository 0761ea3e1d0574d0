package gang

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/sets"
	corev1helpers "k8s.io/component-helpers/scheduling/corev1"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"
	"k8s.io/klog/v2"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/allocator"
)

// Planning, the core's third step for both paths: the round's snapshot of
// the cluster, and whether one item fits now (plan), with the allocator; a
// gang's pods become allocator groups here.

// snapshot is the cluster as one round sees it. allocated grows as the
// round allocates, since the informers lag behind the round's own writes.
type snapshot struct {
	slices    []*resourceapi.ResourceSlice
	classes   []*resourceapi.DeviceClass
	nodes     []*corev1.Node
	allocated []*resourceapi.ResourceClaim
	// domains maps pool/device to NVLink domain, built on first use.
	domains map[string]string
	// fp is the fingerprint of slices, classes and nodes (0: not yet).
	fp uint64
	// counterIdx reads the slices' shared counters, built on first use.
	counterIdx *counterIndex
}

// counters is the snapshot's counter index.
func (s *snapshot) counters() *counterIndex {
	if s.counterIdx == nil {
		s.counterIdx = newCounterIndex(s.slices)
	}
	return s.counterIdx
}

// fingerprint identifies the cluster's devices, classes and nodes as this
// snapshot sees them: equal fingerprints, equal answers to "would it fit on
// an empty cluster".
func (s *snapshot) fingerprint() uint64 {
	if s.fp != 0 {
		return s.fp
	}
	h := fnv.New64a()
	write := func(uid, rv string) {
		_, _ = h.Write([]byte(uid))
		_, _ = h.Write([]byte{0})
		_, _ = h.Write([]byte(rv))
		_, _ = h.Write([]byte{0})
	}
	var keys []string
	for _, sl := range s.slices {
		keys = append(keys, "s"+string(sl.UID)+"/"+sl.ResourceVersion)
	}
	for _, c := range s.classes {
		keys = append(keys, "c"+string(c.UID)+"/"+c.ResourceVersion)
	}
	for _, n := range s.nodes {
		// A node's status changes every few seconds; its labels are what
		// placement reads.
		keys = append(keys, "n"+n.Name+"/"+labels.FormatLabels(n.Labels))
	}
	slices.Sort(keys)
	for _, k := range keys {
		write(k, "")
	}
	s.fp = h.Sum64() | 1
	return s.fp
}

// domainOf is a device's NVLink domain ("" without one).
func (s *snapshot) domainOf(pool, device string) string {
	if s.domains == nil {
		s.domains = map[string]string{}
		for _, sl := range s.slices {
			if sl.Spec.Driver != allocator.DriverName {
				continue
			}
			for _, d := range sl.Spec.Devices {
				if a, ok := d.Attributes[allocator.NVLinkDomainAttribute]; ok && a.StringValue != nil {
					s.domains[sl.Spec.Pool.Name+"/"+d.Name] = *a.StringValue
				} else if a, ok := d.Attributes["nvlinkDomain"]; ok && a.StringValue != nil {
					s.domains[sl.Spec.Pool.Name+"/"+d.Name] = *a.StringValue
				}
			}
		}
	}
	return s.domains[pool+"/"+device]
}

// input builds the allocator's input for one item over the snapshot.
func (s *snapshot) input(strategy allocator.Strategy, claims []*resourceapi.ResourceClaim, groups []allocator.Group, empty bool) allocator.Input {
	in := allocator.Input{Claims: claims, Groups: groups, Slices: s.slices, Classes: s.classes, Nodes: s.nodes, Strategy: strategy}
	if !empty {
		in.Allocated = s.allocated
	}
	return in
}

// snapshot reads the informers; the claims of gangs handed to
// kube-scheduler and not bound yet count as allocated as planned
// (handedClaims, workload.go).
func (c *Controller) snapshot() *snapshot {
	s := &snapshot{}
	for _, o := range c.slices.List() {
		s.slices = append(s.slices, o.(*resourceapi.ResourceSlice))
	}
	for _, o := range c.classes.List() {
		s.classes = append(s.classes, o.(*resourceapi.DeviceClass))
	}
	for _, o := range c.nodes.List() {
		s.nodes = append(s.nodes, o.(*corev1.Node))
	}
	for _, o := range c.claims.List() {
		if cl := o.(*resourceapi.ResourceClaim); cl.Status.Allocation != nil {
			s.allocated = append(s.allocated, cl)
		}
	}
	s.allocated = append(s.allocated, c.handedClaims(func(namespace, name string) bool {
		obj, ok, err := c.pods.GetByKey(namespace + "/" + name)
		return err != nil || !ok || obj.(*corev1.Pod).Spec.NodeName != ""
	})...)
	return s
}

// claim is a ResourceClaim from the informer, or nil.
func (c *Controller) claim(namespace, name string) *resourceapi.ResourceClaim {
	obj, ok, err := c.claims.GetByKey(namespace + "/" + name)
	if err != nil || !ok {
		return nil
	}
	return obj.(*resourceapi.ResourceClaim)
}

// plan decides whether one item fits now. An item that fits is returned as
// an admission, its devices counted as used for the rest of the round.
func (c *Controller) plan(ctx context.Context, it *item, snap *snapshot) (outcome, *admission, error) {
	if c.handsOff(it) {
		if msg := priorityConflict(it.gang); msg != "" {
			return outcome{reason: gpudrav1.ReasonUnsatisfiable, message: msg}, nil, nil
		}
	}
	start := time.Now()
	result, err := allocator.Plan(ctx, snap.input(c.opts.Strategy, it.claims, it.groups, false))
	c.metrics.planSeconds.Observe(time.Since(start).Seconds())
	if err == nil && it.sameDomain && len(result.NVLinkDomains) > 1 {
		err = &allocator.NotFitError{Unit: it.Key, Devices: it.Devices}
		err = fmt.Errorf("the free devices span %d NVLink domains (%v), one is required: %w", len(result.NVLinkDomains), result.NVLinkDomains, err)
	}
	var nf *allocator.NotFitError
	switch {
	case errors.As(err, &nf):
		// Would it fit on an empty cluster? If not, waiting cannot help,
		// but more nodes can where the empty cluster lacked devices.
		if v := c.verdict(ctx, it, snap); v.message != "" {
			return outcome{reason: gpudrav1.ReasonUnsatisfiable, message: v.message, needsDevices: v.short}, nil, nil
		}
		return outcome{reason: gpudrav1.ReasonWaitingForDevices, message: fmt.Sprintf("waiting for %d free devices: %v", it.Devices, err), needsDevices: true}, nil, nil
	case err != nil:
		return outcome{reason: gpudrav1.ReasonUnsatisfiable, message: err.Error()}, nil, fmt.Errorf("plan %s: %w", it.Key, err)
	}
	for i, a := range result.Allocations {
		for _, w := range it.asWritten {
			if w.Namespace == a.Claim.Namespace && w.Name == a.Claim.Name {
				result.Allocations[i].Claim = w
			}
		}
	}
	// The informers lag (and on the Workload API path the scheduler has not
	// allocated yet): what was just planned counts as used for the rest of
	// the round.
	for _, a := range result.Allocations {
		cl := a.Claim.DeepCopy()
		cl.Status.Allocation = a.Result.DeepCopy()
		snap.allocated = append(snap.allocated, cl)
	}
	return outcome{reason: gpudrav1.ReasonAllocated}, &admission{it: it, result: result}, nil
}

// gangGroups turns a gang's pods into allocator groups: the pods that
// share a claim are one group (their devices must be on one node), limited
// to the nodes their node selectors and affinity allow and to the node of
// any claim they have that is already allocated. It returns the groups
// with something to allocate; a gang whose claims are all allocated has
// none.
func gangGroups(g *Gang, nodes []*corev1.Node, claims podClaims) ([]allocator.Group, error) {
	// Union-find over pods by shared claim.
	parent := make([]int, len(g.Pods))
	for i := range parent {
		parent[i] = i
	}
	var find func(int) int
	find = func(i int) int {
		if parent[i] != i {
			parent[i] = find(parent[i])
		}
		return parent[i]
	}
	owner := map[string]int{}
	perPod := make([][]*resourceapi.ResourceClaim, len(g.Pods))
	for i, p := range g.Pods {
		cls, err := claims(p)
		if err != nil {
			return nil, err
		}
		for _, c := range cls {
			perPod[i] = append(perPod[i], c)
			if j, ok := owner[c.Name]; ok {
				parent[find(i)] = find(j)
			} else {
				owner[c.Name] = i
			}
		}
	}
	type acc struct {
		pods   []string
		claims []*resourceapi.ResourceClaim
		seen   sets.Set[string]
		nodes  sets.Set[string]
	}
	roots := map[int]*acc{}
	var order []int
	for i, p := range g.Pods {
		r := find(i)
		a := roots[r]
		if a == nil {
			a = &acc{seen: sets.New[string]()}
			roots[r] = a
			order = append(order, r)
		}
		a.pods = append(a.pods, p.Name)
		allowed, err := podNodes(p, nodes)
		if err != nil {
			return nil, err
		}
		a.nodes = intersect(a.nodes, allowed)
		for _, c := range perPod[i] {
			if a.seen.Has(c.Name) {
				continue
			}
			a.seen.Insert(c.Name)
			if c.Status.Allocation != nil {
				a.nodes = intersect(a.nodes, allocationNodes(c.Status.Allocation, nodes))
				continue
			}
			a.claims = append(a.claims, c)
		}
	}
	var groups []allocator.Group
	for _, r := range order {
		a := roots[r]
		if len(a.claims) == 0 {
			continue
		}
		groups = append(groups, allocator.Group{Name: "pod " + strings.Join(a.pods, "+"), Claims: a.claims, Nodes: a.nodes})
	}
	return groups, nil
}

// podNodes are the nodes the scheduler could bind the pod to, as far as
// nodes go: its nodeSelector and required node affinity allow them, and
// they are neither cordoned nor tainted NoSchedule or NoExecute against its
// tolerations (the scheduler's NodeUnschedulable and TaintToleration
// filters). Devices planned on another node would be held by a pod that
// can never run. nil means all.
func podNodes(p *corev1.Pod, nodes []*corev1.Node) (sets.Set[string], error) {
	selective := len(p.Spec.NodeSelector) > 0 || (p.Spec.Affinity != nil && p.Spec.Affinity.NodeAffinity != nil)
	var req nodeaffinity.RequiredNodeAffinity
	if selective {
		req = nodeaffinity.GetRequiredNodeAffinity(p)
	}
	out := sets.New[string]()
	excluded := false
	for _, n := range nodes {
		if !admits(n, p) {
			excluded = true
			continue
		}
		if selective {
			ok, err := req.Match(n)
			if err != nil {
				return nil, fmt.Errorf("node affinity of pod %s: %w", p.Name, err)
			}
			if !ok {
				continue
			}
		}
		out.Insert(n.Name)
	}
	if !selective && !excluded {
		return nil, nil
	}
	return out, nil
}

// admits says whether node n takes pod p: not cordoned (unless p tolerates
// node.kubernetes.io/unschedulable), and no NoSchedule or NoExecute taint
// that p does not tolerate.
func admits(n *corev1.Node, p *corev1.Pod) bool {
	logger := klog.Background()
	if n.Spec.Unschedulable && !corev1helpers.TolerationsTolerateTaint(logger, p.Spec.Tolerations,
		&corev1.Taint{Key: corev1.TaintNodeUnschedulable, Effect: corev1.TaintEffectNoSchedule}, false) {
		return false
	}
	_, untolerated := corev1helpers.FindMatchingUntoleratedTaint(logger, n.Spec.Taints, p.Spec.Tolerations, func(t *corev1.Taint) bool {
		return t.Effect == corev1.TaintEffectNoSchedule || t.Effect == corev1.TaintEffectNoExecute
	}, false)
	return !untolerated
}

// allocationNodes are the nodes an allocated claim can be used on.
func allocationNodes(a *resourceapi.AllocationResult, nodes []*corev1.Node) sets.Set[string] {
	if a.NodeSelector == nil {
		return nil
	}
	sel, err := nodeaffinity.NewNodeSelector(a.NodeSelector)
	if err != nil {
		return sets.New[string]()
	}
	out := sets.New[string]()
	for _, n := range nodes {
		if sel.Match(n) {
			out.Insert(n.Name)
		}
	}
	return out
}

// intersect treats nil as "everything".
func intersect(a, b sets.Set[string]) sets.Set[string] {
	switch {
	case a == nil:
		return b
	case b == nil:
		return a
	}
	return a.Intersection(b)
}

// demand is the number of devices a set of groups and claims asks for, as
// the allocator estimates it, for queue metrics and fair share.
func demand(groups []allocator.Group, claims []*resourceapi.ResourceClaim) int64 {
	var n int64
	for _, g := range groups {
		for _, c := range g.Claims {
			n += allocator.ClaimDemand(c)
		}
	}
	for _, c := range claims {
		n += allocator.ClaimDemand(c)
	}
	return n
}
