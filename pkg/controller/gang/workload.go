package gang

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/allocator"
	"github.com/gpudra/gpudra/pkg/webhook"
)

// The Workload API hand-off (PathWorkload): a gang that its queue lets go is
// handed to kube-scheduler as a Workload and a gang PodGroup that its pods
// name; kube-scheduler places all of its pods, and allocates their claims,
// or none. gpudra writes only the claims that several of the gang's pods
// share (sharedAllocations), from its plan and behind the fence (commit.go),
// before the PodGroup exists. Until the pods are bound, the gang's plan
// counts as allocated (handed), and Workloads of gangs that ended are swept.

// podGroupTemplate names the one PodGroup template of a gang's Workload.
const podGroupTemplate = "gang"

// ReasonPodGroupCreated is the reason of the gang condition and Event when
// a gang was handed to kube-scheduler as a PodGroup.
const ReasonPodGroupCreated = "PodGroupCreated"

// ReasonHandOffBlocked is the gang condition's reason while an object of
// the gang's name (a Workload or PodGroup being deleted, or not gpudra's)
// keeps it from being handed over.
const ReasonHandOffBlocked = "HandOffBlocked"

// workloadSweepAge: a Workload of a plain gang with no member left is
// deleted once its PodGroup is this old (a gang whose pods are being made
// again keeps it).
const workloadSweepAge = time.Minute

// awaitsPodGroup is waitsOnGpudra on the Workload API path: the pod names
// its gang's PodGroup (the webhook set spec.schedulingGroup), which does
// not exist yet (or is being deleted: an earlier gang's of that name) and
// which this controller did not just make. A pod that names another
// scheduling group belongs to somebody else's PodGroup.
func (c *Controller) awaitsPodGroup(p *corev1.Pod) bool {
	name, _ := gangKey(p)
	sg := p.Spec.SchedulingGroup
	if name == "" || sg == nil || sg.PodGroupName == nil || *sg.PodGroupName != name {
		return false
	}
	pg := c.podGroup(p.Namespace, name)
	return (pg == nil || pg.DeletionTimestamp != nil) && !c.podGroupJustMade(p.Namespace, name)
}

// podGroup is a PodGroup from the informer; nil when absent or off this
// path.
func (c *Controller) podGroup(namespace, name string) *schedulingv1beta1.PodGroup {
	if c.podGroups == nil {
		return nil
	}
	obj, ok, err := c.podGroups.GetByKey(namespace + "/" + name)
	if err != nil || !ok {
		return nil
	}
	return obj.(*schedulingv1beta1.PodGroup)
}

// template is a ResourceClaimTemplate from the informer; nil when absent or
// off this path (podClaims plans a claim not made yet from it).
func (c *Controller) template(namespace, name string) *resourceapi.ResourceClaimTemplate {
	if c.templates == nil {
		return nil
	}
	obj, ok, err := c.templates.GetByKey(namespace + "/" + name)
	if err != nil || !ok {
		return nil
	}
	return obj.(*resourceapi.ResourceClaimTemplate)
}

// priorityConflict says why kube-scheduler would place no pod of the gang
// as one PodGroup: its pods differ in priority ("all pods in a single pod
// group should have the same priority"); "" when they agree. The webhook
// refuses such a pod, but two made at once can both pass its view, and pods
// made before it checked are there: such a gang is not handed over, and
// says why, instead of waiting for ever on the scheduler.
func priorityConflict(g *Gang) string {
	if g == nil || len(g.Pods) < 2 {
		return ""
	}
	for _, p := range g.Pods[1:] {
		if webhook.PodPriority(p) != webhook.PodPriority(g.Pods[0]) {
			return fmt.Sprintf("gang %s: its pods' priorities differ (%s of pod %s, %s of pod %s); kube-scheduler places no pod of a "+
				"PodGroup whose pods' priorities differ: give every pod of the gang one PriorityClass (docs/gangs.md)",
				g.Name, webhook.DescribePriority(g.Pods[0]), g.Pods[0].Name, webhook.DescribePriority(p), p.Name)
		}
	}
	return ""
}

// minCount is how many of a gang's pods kube-scheduler must place together:
// a plain gang's gpudra.dev/gang-size; for a Grove PodGang the sum of its
// groups' minReplicas (podGangMinCount), in one PodGroup, so that the cliques land together
// (PodGroups per clique would need CompositePodGroups, alpha in 1.37, to be
// all or nothing across cliques).
func minCount(g *Gang, podGang *unstructured.Unstructured) (int32, error) {
	if !g.Grove {
		n, err := strconv.Atoi(g.Pods[0].Annotations[gpudrav1.AnnotationGangSize])
		if err != nil || n < 1 {
			return 0, fmt.Errorf("gang %s: annotation %s: %q is no size", g.Key, gpudrav1.AnnotationGangSize, g.Pods[0].Annotations[gpudrav1.AnnotationGangSize])
		}
		return int32(n), nil
	}
	return podGangMinCount(g, podGang)
}

// TopologyKeyNode is the topology constraint of a gang planned on one node:
// an H100 node (HGX) is one NVLink domain, so "one node" says "one NVLink
// domain" in the words the PodGroup topology API has (node labels).
const TopologyKeyNode = "kubernetes.io/hostname"

// topologyKey is the PodGroup topology constraint for a plan: a gang that
// fits on one node (the planner packs NVLink domains first) is kept on one
// node; "" for none (a gang that needs several nodes: H100 NVLink does not
// cross nodes).
func topologyKey(result *allocator.Result) string {
	if result != nil && len(result.Nodes) == 1 {
		return TopologyKeyNode
	}
	return ""
}

// sharedAllocations are the planned allocations of the claims that two or
// more of the gang's pods name (spec.resourceClaims[].resourceClaimName).
// kube-scheduler allocates such a claim at the PreBind of whichever pod of
// the PodGroup gets there first; with several pods of one PodGroup on one
// claim it failed with "got allocated elsewhere in the meantime" and then
// gave one device to two claims (kubernetes/kubernetes#140053; issue 35,
// item 0). gpudra writes these from its plan, behind the fence, before it
// hands the PodGroup over, so that kube-scheduler allocates only claims
// that one pod of the gang uses.
func sharedAllocations(g *Gang, result allocator.Result) allocator.Result {
	users := map[string]int{}
	for _, p := range g.Pods {
		for _, rc := range p.Spec.ResourceClaims {
			if rc.ResourceClaimName != nil {
				users[p.Namespace+"/"+*rc.ResourceClaimName]++
			}
		}
	}
	out := allocator.Result{Nodes: result.Nodes, NVLinkDomains: result.NVLinkDomains}
	for _, a := range result.Allocations {
		if users[a.Claim.Namespace+"/"+a.Claim.Name] > 1 {
			out.Allocations = append(out.Allocations, a)
		}
	}
	return out
}

// handOffAdmitted hands an admitted gang to kube-scheduler as a PodGroup
// (Workload API path) and records it.
func (c *Controller) handOffAdmitted(ctx context.Context, a *admission, now time.Time) error {
	if err := c.handOff(ctx, a.it.gang, topologyKey(&a.result)); err != nil {
		c.reportGang(ctx, a.it.gang, gpudrav1.ReasonWaitingForDevices, err.Error())
		return err
	}
	c.rememberHanded(a.it.Key, a.it.gang, a.result)
	return c.admitted(ctx, a, now)
}

// handOff creates the gang's Workload, with one gang template, and its
// PodGroup, which the pods name; topology, when not empty, is the
// PodGroup's topology constraint (an API server without the alpha gate
// TopologyAwareWorkloadScheduling drops it). An object there already (an
// earlier round, or a leader that stopped between the two creates) is
// kept, so a failover finishes a half-written hand-off.
func (c *Controller) handOff(ctx context.Context, g *Gang, topology string) error {
	pg := c.podGang(g.Namespace, g.Name)
	n, err := minCount(g, pg)
	if err != nil {
		return err
	}
	policy := schedulingv1beta1.PodGroupSchedulingPolicy{Gang: &schedulingv1beta1.GangSchedulingPolicy{MinCount: n}}
	var constraints *schedulingv1beta1.PodGroupSchedulingConstraints
	if topology != "" {
		constraints = &schedulingv1beta1.PodGroupSchedulingConstraints{Topology: []schedulingv1beta1.TopologyConstraint{{Key: topology}}}
	}
	labels := map[string]string{gpudrav1.LabelGang: g.Name}
	// kube-scheduler refuses a PodGroup whose priority is not its pods'
	// ("all pods in a single pod group should have the same priority").
	priorityClass := gangPriorityClass(g)
	wl := &schedulingv1beta1.Workload{
		ObjectMeta: metav1.ObjectMeta{Name: g.Name, Namespace: g.Namespace, Labels: labels},
		Spec: schedulingv1beta1.WorkloadSpec{PodGroupTemplates: []schedulingv1beta1.PodGroupTemplate{{
			Name: podGroupTemplate, SchedulingPolicy: policy, SchedulingConstraints: constraints, PriorityClassName: priorityClass}}},
	}
	if g.Grove && pg != nil {
		ownedByPodGang(wl, pg) // deleted with its PodGang
	}
	api := c.opts.Client.SchedulingV1beta1()
	created, err := api.Workloads(g.Namespace).Create(ctx, wl, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		created, err = api.Workloads(g.Namespace).Get(ctx, g.Name, metav1.GetOptions{})
		if err == nil {
			if why := blockedBy("Workload", created, g); why != "" {
				return errors.New(why)
			}
		}
	}
	if err != nil {
		return fmt.Errorf("gang %s: Workload: %w", g.Key, err)
	}
	group := &schedulingv1beta1.PodGroup{
		ObjectMeta: metav1.ObjectMeta{Name: g.Name, Namespace: g.Namespace, Labels: labels,
			// Deleted with its Workload.
			OwnerReferences: []metav1.OwnerReference{{APIVersion: schedulingv1beta1.SchemeGroupVersion.String(), Kind: "Workload",
				Name: created.Name, UID: created.UID, Controller: ptr.To(true)}}},
		Spec: schedulingv1beta1.PodGroupSpec{
			WorkloadRef:           &schedulingv1beta1.WorkloadReference{WorkloadName: created.Name, TemplateName: podGroupTemplate},
			SchedulingPolicy:      policy,
			SchedulingConstraints: constraints,
			PriorityClassName:     priorityClass,
		},
	}
	_, err = api.PodGroups(g.Namespace).Create(ctx, group, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		var have *schedulingv1beta1.PodGroup
		if have, err = api.PodGroups(g.Namespace).Get(ctx, g.Name, metav1.GetOptions{}); err == nil {
			if why := blockedBy("PodGroup", have, g); why != "" {
				return errors.New(why)
			}
		}
	}
	if err != nil {
		return fmt.Errorf("gang %s: PodGroup: %w", g.Key, err)
	}
	c.rememberPodGroup(g.Namespace, g.Name)
	klog.FromContext(ctx).V(2).Info("Handed to kube-scheduler", "gang", g.Key, "podGroup", g.Name, "minCount", n, "topology", topology)
	return nil
}

// blockedBy says why an object of the gang's name (its Workload or
// PodGroup) keeps gpudra from handing the gang over, or "" when it does
// not: it is being deleted (an earlier gang's), or it is not gpudra's.
// gpudra adopts only what it made: kube-scheduler takes a PodGroup by name,
// and one made by someone else would hand the gang over on terms gpudra did
// not set.
func blockedBy(kind string, obj metav1.Object, g *Gang) string {
	switch {
	case obj.GetDeletionTimestamp() != nil:
		return fmt.Sprintf("gang %s: %s %s/%s of an earlier gang of that name is being deleted: handed over once it is gone", g.Key, kind, g.Namespace, g.Name)
	case obj.GetLabels()[gpudrav1.LabelGang] != g.Name:
		return fmt.Sprintf("gang %s: %s %s/%s exists and is not gpudra's (no label %s=%s): delete it or rename the gang",
			g.Key, kind, g.Namespace, g.Name, gpudrav1.LabelGang, g.Name)
	}
	return ""
}

// handOffBlocked says, from the informers, why the gang cannot be handed
// over now ("" when it can): checked before anything is written for it, so
// that a blocked hand-off waits instead of writing the gang's shared claims,
// failing, taking them back and writing them again every round (a fence,
// settles and two cluster-wide lists each time).
func (c *Controller) handOffBlocked(g *Gang) string {
	if wl := c.workload(g.Namespace, g.Name); wl != nil {
		if why := blockedBy("Workload", wl, g); why != "" {
			return why
		}
	}
	if pg := c.podGroup(g.Namespace, g.Name); pg != nil {
		if why := blockedBy("PodGroup", pg, g); why != "" {
			return why
		}
	}
	return intruder(g, c.podsNaming(g.Namespace, g.Name))
}

// schedulingGroupIndex indexes pods not ended by the PodGroup their
// spec.schedulingGroup names ("<namespace>/<PodGroup>").
const schedulingGroupIndex = "schedulingGroup"

func namedPodGroup(obj any) ([]string, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok || p.Spec.SchedulingGroup == nil || p.Spec.SchedulingGroup.PodGroupName == nil || !member(p) {
		return nil, nil
	}
	return []string{p.Namespace + "/" + *p.Spec.SchedulingGroup.PodGroupName}, nil
}

// podsNaming are the pods that name the PodGroup (nil where the informer
// has no such index).
func (c *Controller) podsNaming(namespace, podGroup string) []*corev1.Pod {
	objs, err := c.pods.ByIndex(schedulingGroupIndex, namespace+"/"+podGroup)
	if err != nil {
		return nil
	}
	out := make([]*corev1.Pod, 0, len(objs))
	for _, o := range objs {
		out = append(out, o.(*corev1.Pod))
	}
	return out
}

// intruder says why a pod that names the gang's PodGroup but is not one of
// its members keeps the gang from being handed over ("" when there is
// none): kube-scheduler would count it in the gang's minCount and place it
// on devices gpudra did not plan for it. The webhook refuses such a pod
// once the gang's pods exist; one made before them is caught here.
func intruder(g *Gang, naming []*corev1.Pod) string {
	for _, p := range naming {
		if name, _ := gangKey(p); name != g.Name {
			return fmt.Sprintf("gang %s: pod %s/%s names PodGroup %s in spec.schedulingGroup but is not a member of the gang: handed over once it is gone "+
				"(a pod may join only its own gang's PodGroup)", g.Key, p.Namespace, p.Name, g.Name)
		}
	}
	return ""
}

// workload is a Workload from the informer; nil when absent or off this
// path.
func (c *Controller) workload(namespace, name string) *schedulingv1beta1.Workload {
	if c.workloads == nil {
		return nil
	}
	obj, ok, err := c.workloads.GetByKey(namespace + "/" + name)
	if err != nil || !ok {
		return nil
	}
	return obj.(*schedulingv1beta1.Workload)
}

// gangPriorityClass is the PriorityClass of the gang's highest-priority
// pod, which its PodGroup takes (the gang's pods should share one: the
// scheduler places no pod of a PodGroup whose pods differ, and says so in a
// FailedScheduling Event).
func gangPriorityClass(g *Gang) string {
	class := ""
	var best *int32
	for _, p := range g.Pods {
		if best == nil || (p.Spec.Priority != nil && *p.Spec.Priority > *best) {
			best, class = p.Spec.Priority, p.Spec.PriorityClassName
			if best == nil {
				best = ptr.To[int32](0)
			}
		}
	}
	return class
}

// markHandedOff sets the gang condition on the members: which PodGroup
// serves the gang, and so which path.
func (c *Controller) markHandedOff(ctx context.Context, g *Gang) error {
	c.mu.Lock()
	delete(c.reported, g.Key)
	c.mu.Unlock()
	patch := gangConditionPatch(corev1.ConditionTrue, ReasonPodGroupCreated,
		fmt.Sprintf("handed to kube-scheduler as PodGroup %s (Workload API path): it places all of the gang's pods or none", g.Name))
	var errs []error
	for _, p := range g.Waiting {
		errs = append(errs, c.conditions.set(ctx, p, patch))
	}
	return errors.Join(errs...)
}

// sweepWorkloads deletes the Workloads gpudra made for plain gangs that have
// no member left (a Grove gang's goes with its PodGang): the next gang of
// that name gets a PodGroup of its own size. The PodGroup goes with it.
func (c *Controller) sweepWorkloads(ctx context.Context) error {
	if c.podGroups == nil {
		return nil
	}
	var errs []error
	for _, obj := range c.podGroups.List() {
		pg := obj.(*schedulingv1beta1.PodGroup)
		name := pg.Labels[gpudrav1.LabelGang]
		if name == "" || c.opts.Now().Sub(pg.CreationTimestamp.Time) < workloadSweepAge {
			continue
		}
		if members, _ := c.pods.ByIndex(gangMemberIndex, pg.Namespace+"/"+name); len(members) > 0 {
			continue
		}
		owner := metav1.GetControllerOf(pg)
		if owner == nil || owner.Kind != "Workload" {
			continue
		}
		err := c.opts.Client.SchedulingV1beta1().Workloads(pg.Namespace).Delete(ctx, owner.Name,
			metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &owner.UID}, PropagationPolicy: ptr.To(metav1.DeletePropagationBackground)})
		if err == nil {
			klog.FromContext(ctx).V(2).Info("Deleted the Workload of an ended gang", "workload", klog.KRef(pg.Namespace, owner.Name))
		}
		if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			errs = append(errs, fmt.Errorf("delete Workload %s/%s: %w", pg.Namespace, owner.Name, err))
		}
	}
	return errors.Join(errs...)
}

// handedTTL bounds how long a handed-off gang's plan counts against the
// devices: kube-scheduler places a gang within seconds when it fits; one it
// cannot place (it planned other devices, or the cluster changed) must not
// hold the queue for ever.
const handedTTL = 2 * time.Minute

// handed is a gang handed to kube-scheduler whose pods are not all bound
// yet: its claims as planned, and its pods.
type handed struct {
	at     time.Time
	claims []*resourceapi.ResourceClaim
	pods   []*corev1.Pod
	// namespace and name are the gang's, its PodGroup's; checked: whether
	// kube-scheduler acting on it was looked at (checkHandedOff).
	namespace, name string
	checked         bool
}

// rememberHanded keeps a handed-off gang's plan: until the scheduler has
// bound its pods (it writes their claims' allocations before it binds),
// the devices count as used, so that the items behind it in the queue are
// not handed the same devices, which would undo the queue's order.
func (c *Controller) rememberHanded(key string, g *Gang, result allocator.Result) {
	h := handed{at: c.opts.Now(), pods: g.Pods, namespace: g.Namespace, name: g.Name}
	for _, a := range result.Allocations {
		cl := a.Claim.DeepCopy()
		cl.Status.Allocation = a.Result.DeepCopy()
		h.claims = append(h.claims, cl)
	}
	c.mu.Lock()
	c.handed[key] = h
	c.mu.Unlock()
	if c.opts.HandedOff != nil {
		c.opts.HandedOff()
	}
}

// HandedClaims are the claims of the gangs handed to kube-scheduler whose
// pods are not all bound yet (within handedTTL), each with the allocation
// the controller planned: on the Workload API path, a gang being admitted
// holds no allocated claim until kube-scheduler writes them, and these say
// on which nodes it is expected. Safe to call from any goroutine; the
// claims are the controller's own: read only.
func (c *Controller) HandedClaims() []*resourceapi.ResourceClaim {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.opts.Now()
	var out []*resourceapi.ResourceClaim
	for _, h := range c.handed {
		if now.Sub(h.at) <= handedTTL {
			out = append(out, h.claims...)
		}
	}
	return out
}

// handedClaims are the planned claims of handed-off gangs whose pods are
// not all bound; bound(namespace, name) says whether a pod is bound (or
// gone). Entries whose pods are all bound, or past handedTTL, are
// forgotten.
func (c *Controller) handedClaims(bound func(namespace, name string) bool) []*resourceapi.ResourceClaim {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []*resourceapi.ResourceClaim
	for key, h := range c.handed {
		done := true
		for _, p := range h.pods {
			if !bound(p.Namespace, p.Name) {
				done = false
				break
			}
		}
		if done || c.opts.Now().Sub(h.at) > handedTTL {
			delete(c.handed, key)
			continue
		}
		out = append(out, h.claims...)
	}
	return out
}

// schedulerActGrace is how long kube-scheduler is given to act on a
// PodGroup gpudra created before the gang says it did not.
const schedulerActGrace = 30 * time.Second

// podGroupScheduled is the PodGroup condition kube-scheduler sets when it
// decided about the group (True: placed; False: why not).
const podGroupScheduled = "PodGroupInitiallyScheduled"

// ReasonSchedulerNotActing and ReasonPodGroupUnschedulable are the gang
// condition's reasons when, after a hand-off, kube-scheduler did nothing
// with the PodGroup, or said it cannot place it.
const (
	ReasonSchedulerNotActing    = "SchedulerNotActing"
	ReasonPodGroupUnschedulable = "PodGroupUnschedulable"
)

// checkHandedOff looks, once per hand-off and schedulerActGrace after it,
// at whether kube-scheduler acted on the gang's PodGroup: the Workload API
// path is chosen from API discovery alone, and a kube-scheduler without
// the GenericWorkload gate or its GangScheduling plugin (or the pods of
// another scheduler) leaves the gang Pending with nothing said. A PodGroup
// kube-scheduler marked unschedulable has its reason copied onto the
// gang's pods. A gang with a pod bound, or one kube-scheduler tried to
// schedule, was acted on.
func (c *Controller) checkHandedOff(ctx context.Context) {
	now := c.opts.Now()
	var due []handed
	c.mu.Lock()
	for key, h := range c.handed {
		if !h.checked && now.Sub(h.at) >= schedulerActGrace {
			h.checked = true
			c.handed[key] = h
			due = append(due, h)
		}
	}
	c.mu.Unlock()
	for _, h := range due {
		pods := make([]*corev1.Pod, 0, len(h.pods))
		tried := false
		for _, p := range h.pods {
			obj, ok, err := c.pods.GetByKey(p.Namespace + "/" + p.Name)
			if err != nil || !ok {
				continue
			}
			cur := obj.(*corev1.Pod)
			pods = append(pods, cur)
			tried = tried || cur.Spec.NodeName != "" || slices.ContainsFunc(cur.Status.Conditions, func(c corev1.PodCondition) bool {
				return c.Type == corev1.PodScheduled
			})
		}
		if len(pods) == 0 {
			continue
		}
		var reason, msg string
		pg := c.podGroup(h.namespace, h.name)
		var cond *metav1.Condition
		if pg != nil {
			cond = meta.FindStatusCondition(pg.Status.Conditions, podGroupScheduled)
		}
		switch {
		case cond != nil && cond.Status == metav1.ConditionFalse:
			reason = ReasonPodGroupUnschedulable
			msg = fmt.Sprintf("kube-scheduler cannot place PodGroup %s: %s: %s", h.name, cond.Reason, cond.Message)
		case cond == nil && !tried:
			reason = ReasonSchedulerNotActing
			msg = fmt.Sprintf("kube-scheduler has not acted on PodGroup %s in %s (no %s condition, no pod tried): check that kube-scheduler "+
				"runs with the GenericWorkload feature gate and its GangScheduling plugin, and that the pods use it (schedulerName); "+
				"or set gangs.mode: gates (docs/gangs.md)", h.name, now.Sub(h.at).Round(time.Second), podGroupScheduled)
		default:
			continue
		}
		c.metrics.handOffsNotPlaced.WithLabelValues(reason).Inc()
		klog.FromContext(ctx).Info("A gang handed to kube-scheduler is not placed", "gang", klog.KRef(h.namespace, h.name), "reason", reason, "message", msg)
		c.recordGang(&Gang{Pods: pods}, corev1.EventTypeWarning, reason, fmt.Sprintf("gang %s: %s", h.name, msg))
		patch := gangConditionPatch(corev1.ConditionFalse, reason, msg)
		for _, p := range pods {
			if err := c.conditions.set(ctx, p, patch); err != nil {
				klog.FromContext(ctx).Error(err, "Set gang condition", "pod", klog.KObj(p))
			}
		}
	}
}
