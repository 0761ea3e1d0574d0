package grove

import (
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	"k8s.io/apimachinery/pkg/util/sets"
	corev1helpers "k8s.io/component-helpers/scheduling/corev1"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
	"k8s.io/klog/v2"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// Problem reasons. They are Event reasons and metric labels: never rename.
const (
	// ReasonTooManyConsumers: more pods reference the claim than its
	// status.reservedFor can hold; the rest can never be scheduled.
	ReasonTooManyConsumers = "TooManyConsumers"
	// ReasonConsumerNodeExcluded: a consumer's nodeSelector, required node
	// affinity or untolerated taints exclude the node the claim is
	// allocated on; it cannot run beside the others.
	ReasonConsumerNodeExcluded = "ConsumerNodeExcluded"
	// ReasonConsumersPending: consumers stay unschedulable, for longer than
	// the grace period, with a scheduler message about claims (the shared
	// devices cannot be allocated: they are taken).
	ReasonConsumersPending = "ConsumersPending"
	// ReasonMPSUsersDiffer: the claim shares through MPS and its consumers'
	// containers run as different users; an MPS server serves one user at
	// a time, so the others wait (docs/sharing.md).
	ReasonMPSUsersDiffer = "MPSUsersDiffer"
	// ReasonInvalidConfig: the claim's GpuConfig does not decode; the
	// plugin will refuse to prepare it.
	ReasonInvalidConfig = "InvalidConfig"
)

// Reasons lists every problem reason, for metrics.
var Reasons = []string{ReasonTooManyConsumers, ReasonConsumerNodeExcluded, ReasonConsumersPending, ReasonMPSUsersDiffer, ReasonInvalidConfig}

// DefaultPendingGrace is how long a consumer may be unschedulable on claims
// before it is reported: the scheduler retries, and a gang starts pod by
// pod.
const DefaultPendingGrace = 2 * time.Minute

// maxNamed caps the pods a message names.
const maxNamed = 10

// Input is what Analyze looks at. Pods may hold pods that do not reference
// the claim; they are ignored.
type Input struct {
	Claim *resourceapi.ResourceClaim
	Pods  []*corev1.Pod
	// Nodes are the nodes the allocation's node selector may name; the
	// node of the group is the one that matches.
	Nodes []*corev1.Node
	Now   time.Time
	// PendingGrace: zero means DefaultPendingGrace.
	PendingGrace time.Duration
}

// reservingPodGroups are the PodGroups a claim is, or will be, reserved
// for: those in its status.reservedFor, and the PodGroup that owns it (the
// claim controller made it from the PodGroup's template).
func reservingPodGroups(claim *resourceapi.ResourceClaim) sets.Set[string] {
	out := sets.New[string]()
	for _, r := range claim.Status.ReservedFor {
		if r.APIGroup == schedulingv1beta1.GroupName && r.Resource == "podgroups" {
			out.Insert(r.Name)
		}
	}
	for _, o := range claim.OwnerReferences {
		if o.Kind == "PodGroup" && strings.HasPrefix(o.APIVersion, schedulingv1beta1.GroupName+"/") {
			out.Insert(o.Name)
		}
	}
	return out
}

// podGroupOf is the PodGroup a pod names in spec.schedulingGroup, or "".
func podGroupOf(p *corev1.Pod) string {
	if sg := p.Spec.SchedulingGroup; sg != nil && sg.PodGroupName != nil {
		return *sg.PodGroupName
	}
	return ""
}

// Analyze describes the group of a Grove claim and what stops it from
// working. recheck > 0 is when the answer may change with time alone (a
// pending consumer reaching the grace period).
func Analyze(in Input) (g Group, recheck time.Duration) {
	claim := in.Claim
	g = describe(claim)
	grace := in.PendingGrace
	if grace == 0 {
		grace = DefaultPendingGrace
	}
	groups := reservingPodGroups(claim)
	var consumers []*corev1.Pod
	for _, p := range in.Pods {
		if References(p, claim.Name) && p.Namespace == claim.Namespace && p.DeletionTimestamp == nil {
			consumers = append(consumers, p)
		}
	}
	sort.Slice(consumers, func(i, j int) bool { return consumers[i].Name < consumers[j].Name })
	// A claim reserved for a PodGroup (DRAWorkloadResourceClaims) is
	// reserved for every pod of it, in one reservedFor entry: those pods
	// do not count against the limit.
	slots := len(groups)
	for _, p := range consumers {
		inGroup := groups.Has(podGroupOf(p))
		if !inGroup {
			slots++
		}
		g.Consumers = append(g.Consumers, Consumer{Name: p.Name, UID: p.UID, Node: p.Spec.NodeName, Phase: p.Status.Phase,
			Reserved: inGroup || resourceclaim.IsReservedForPod(p, claim, false)})
	}

	var nodes []*corev1.Node
	if a := claim.Status.Allocation; a != nil {
		g.Allocated = true
		for _, r := range a.Devices.Results {
			if r.Driver == slicebuilder.DriverName {
				g.Devices = append(g.Devices, Device{Request: r.Request, Pool: r.Pool, Device: r.Device})
			}
		}
		nodes = allocationNodes(a.NodeSelector, in.Nodes)
		switch {
		case len(nodes) == 1:
			g.Node = nodes[0].Name
		case len(nodes) == 0:
			// The Node object is gone or was not given (a user who may not
			// list nodes): the selector the scheduler writes names it.
			g.Node = selectorNodeName(a.NodeSelector)
		}
	}

	cfg, err := sharingConfig(claim)
	if err != nil {
		g.Problems = append(g.Problems, Problem{Reason: ReasonInvalidConfig, Message: err.Error()})
	} else {
		g.Sharing = cfg.Sharing
	}

	if n := slots; n > resourceapi.ResourceClaimReservedForMaxSize {
		var waiting []string
		for _, c := range g.Consumers {
			if !c.Reserved {
				waiting = append(waiting, c.Name)
			}
		}
		who := fmt.Sprintf("%d pods", n)
		if len(groups) > 0 {
			who = fmt.Sprintf("%d pods outside PodGroup %s and the PodGroup", n-len(groups), strings.Join(sets.List(groups), ", "))
		}
		g.Problems = append(g.Problems, Problem{Reason: ReasonTooManyConsumers, Pods: waiting, Message: fmt.Sprintf(
			"%s reference claim %s, a claim can be reserved for at most %d; not reserved: %s",
			who, claim.Name, resourceapi.ResourceClaimReservedForMaxSize, capList(waiting))})
	}
	if claim.Status.Allocation != nil && claim.Status.Allocation.NodeSelector != nil && len(nodes) > 0 {
		if p := nodeExcluded(consumers, nodes); p != nil {
			g.Problems = append(g.Problems, *p)
		}
	}
	if p, next := pending(consumers, claim.Name, in.Now, grace); p != nil {
		g.Problems = append(g.Problems, *p)
	} else {
		recheck = next
	}
	if cfg != nil && cfg.Sharing != nil && cfg.Sharing.Strategy == gpuapi.MPS {
		if p := mpsUsers(consumers, claim.Name); p != nil {
			g.Problems = append(g.Problems, *p)
		}
	}
	return g, recheck
}

// sharingConfig is the claim's GpuConfig for our driver: from the allocation
// (class configs included) when allocated, else the claim's own configs,
// the last one winning as at prepare. A claim with no config is Exclusive.
func sharingConfig(claim *resourceapi.ResourceClaim) (*gpuapi.GpuConfig, error) {
	var raws [][]byte
	if a := claim.Status.Allocation; a != nil {
		for _, r := range a.Devices.Results {
			if r.Driver != slicebuilder.DriverName {
				continue
			}
			for _, c := range resourceclaim.ConfigForResult(a.Devices.Config, r) {
				if c.Opaque.Driver == slicebuilder.DriverName {
					raws = append(raws, c.Opaque.Parameters.Raw)
				}
			}
			// The plugin refuses a claim whose devices differ in config;
			// the first device's config stands for the claim.
			break
		}
	} else {
		for _, c := range claim.Spec.Devices.Config {
			if c.Opaque != nil && c.Opaque.Driver == slicebuilder.DriverName {
				raws = append(raws, c.Opaque.Parameters.Raw)
			}
		}
	}
	cfg := gpuapi.DefaultConfig()
	for _, raw := range raws {
		decoded, err := gpuapi.Decode(raw)
		if err != nil {
			return nil, fmt.Errorf("claim %s: %w", claim.Name, err)
		}
		cfg = decoded
	}
	return cfg, nil
}

// allocationNodes are the nodes the allocation's node selector matches; all
// of them when it has none (the devices are reachable from every node).
func allocationNodes(sel *corev1.NodeSelector, all []*corev1.Node) []*corev1.Node {
	if sel == nil {
		return nil
	}
	ns, err := nodeaffinity.NewNodeSelector(sel)
	if err != nil {
		return nil
	}
	var out []*corev1.Node
	for _, n := range all {
		if ns.Match(n) {
			out = append(out, n)
		}
	}
	return out
}

// selectorNodeName is the node of a selector of the form the scheduler
// writes for node-local devices: one term, metadata.name In [node].
func selectorNodeName(sel *corev1.NodeSelector) string {
	if sel == nil || len(sel.NodeSelectorTerms) != 1 {
		return ""
	}
	t := sel.NodeSelectorTerms[0]
	if len(t.MatchExpressions) != 0 || len(t.MatchFields) != 1 {
		return ""
	}
	f := t.MatchFields[0]
	if f.Key != "metadata.name" || f.Operator != corev1.NodeSelectorOpIn || len(f.Values) != 1 {
		return ""
	}
	return f.Values[0]
}

// nodeExcluded finds consumers that fit none of the allocation's nodes.
// Pods already bound are left out: the scheduler put them there.
func nodeExcluded(consumers []*corev1.Pod, nodes []*corev1.Node) *Problem {
	var why, pods []string
	for _, p := range consumers {
		if p.Spec.NodeName != "" {
			continue
		}
		affinity := nodeaffinity.GetRequiredNodeAffinity(p)
		var reasons []string
		fits := false
		for _, n := range nodes {
			if ok, err := affinity.Match(n); err != nil || !ok {
				reasons = append(reasons, fmt.Sprintf("node %s does not match its nodeSelector or required node affinity", n.Name))
				continue
			}
			if t, untolerated := corev1helpers.FindMatchingUntoleratedTaint(klog.Background(), n.Spec.Taints, p.Spec.Tolerations, hardTaint, false); untolerated {
				reasons = append(reasons, fmt.Sprintf("node %s has taint %s=%s:%s it does not tolerate", n.Name, t.Key, t.Value, t.Effect))
				continue
			}
			fits = true
			break
		}
		if !fits {
			pods = append(pods, p.Name)
			why = append(why, fmt.Sprintf("pod %s: %s", p.Name, strings.Join(reasons, "; ")))
		}
	}
	if len(why) == 0 {
		return nil
	}
	return &Problem{Reason: ReasonConsumerNodeExcluded, Pods: pods, Message: fmt.Sprintf("the claim is allocated on %s, which %d consumer(s) cannot use: %s",
		nodeNames(nodes), len(why), capList(why))}
}

func hardTaint(t *corev1.Taint) bool {
	return t.Effect == corev1.TaintEffectNoSchedule || t.Effect == corev1.TaintEffectNoExecute
}

// pending finds consumers that are unschedulable because of claims for
// longer than grace. Gated pods (Grove gates pods until their gang exists)
// have reason SchedulingGated and are not counted. next is when the first
// consumer still inside its grace period reaches it.
func pending(consumers []*corev1.Pod, claim string, now time.Time, grace time.Duration) (*Problem, time.Duration) {
	var stuck, pods []string
	var next time.Duration
	for _, p := range consumers {
		if p.Spec.NodeName != "" || p.Status.Phase != corev1.PodPending {
			continue
		}
		c := podScheduled(p)
		if c == nil || c.Status != corev1.ConditionFalse || c.Reason != corev1.PodReasonUnschedulable || !aboutClaims(c.Message, claim) {
			continue
		}
		waited := now.Sub(c.LastTransitionTime.Time)
		if waited < grace {
			if left := grace - waited; next == 0 || left < next {
				next = left
			}
			continue
		}
		pods = append(pods, p.Name)
		stuck = append(stuck, fmt.Sprintf("pod %s: %s", p.Name, c.Message))
	}
	if len(stuck) == 0 {
		return nil, next
	}
	return &Problem{Reason: ReasonConsumersPending, Pods: pods, Message: fmt.Sprintf("%d consumer(s) of claim %s cannot be scheduled for longer than %s: %s",
		len(stuck), claim, grace, capList(stuck))}, 0
}

func podScheduled(p *corev1.Pod) *corev1.PodCondition {
	for i := range p.Status.Conditions {
		if p.Status.Conditions[i].Type == corev1.PodScheduled {
			return &p.Status.Conditions[i]
		}
	}
	return nil
}

// aboutClaims says whether the scheduler's message is about DRA claims:
// the DynamicResources plugin says "cannot allocate all claims",
// "resourceclaim ... is not ..." or names the claim.
func aboutClaims(msg, claim string) bool {
	m := strings.ToLower(msg)
	return strings.Contains(m, "cannot allocate all claims") || strings.Contains(m, "resourceclaim") ||
		strings.Contains(msg, claim)
}

// mpsUsers finds containers using the claim that run as different users.
// A container's user is its runAsUser, else the pod's; containers with
// neither run as their image's user, which is unknown here and not
// counted.
func mpsUsers(consumers []*corev1.Pod, claim string) *Problem {
	byUser := map[int64][]string{}
	var pods []string
	for _, p := range consumers {
		entry := podClaimEntry(p, claim)
		var podUser *int64
		if p.Spec.SecurityContext != nil {
			podUser = p.Spec.SecurityContext.RunAsUser
		}
		for _, c := range slices.Concat(p.Spec.InitContainers, p.Spec.Containers) {
			if !usesClaim(&c, entry) {
				continue
			}
			user := podUser
			if c.SecurityContext != nil && c.SecurityContext.RunAsUser != nil {
				user = c.SecurityContext.RunAsUser
			}
			if user != nil {
				byUser[*user] = append(byUser[*user], p.Name+"/"+c.Name)
				if !slices.Contains(pods, p.Name) {
					pods = append(pods, p.Name)
				}
			}
		}
	}
	if len(byUser) < 2 {
		return nil
	}
	users := make([]int64, 0, len(byUser))
	for u := range byUser {
		users = append(users, u)
	}
	slices.Sort(users)
	parts := make([]string, 0, len(users))
	for _, u := range users {
		parts = append(parts, fmt.Sprintf("user %d: %s", u, capList(byUser[u])))
	}
	return &Problem{Reason: ReasonMPSUsersDiffer, Pods: pods, Message: fmt.Sprintf(
		"claim %s shares through MPS, whose server serves one user at a time, but its containers run as %d users (runAsUser): %s",
		claim, len(users), strings.Join(parts, "; "))}
}

func usesClaim(c *corev1.Container, entry string) bool {
	for _, rc := range c.Resources.Claims {
		if rc.Name == entry {
			return true
		}
	}
	return false
}

// capList joins at most maxNamed items and says how many more there are,
// so that an Event stays readable with 300 consumers.
func capList(items []string) string {
	if len(items) <= maxNamed {
		return strings.Join(items, ", ")
	}
	return strings.Join(items[:maxNamed], ", ") + " and " + strconv.Itoa(len(items)-maxNamed) + " more"
}

func nodeNames(nodes []*corev1.Node) string {
	out := make([]string, 0, len(nodes))
	for _, n := range nodes {
		out = append(out, n.Name)
	}
	return "node " + capList(out)
}
