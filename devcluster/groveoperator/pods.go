package groveoperator

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"slices"
	"strconv"

	grovecommon "github.com/ai-dynamo/grove/operator/api/common"
	grove "github.com/ai-dynamo/grove/operator/api/core/v1alpha1"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/rand"
)

// cliqueInstance is one PodClique of a PodCliqueSet replica: standalone, or
// of one replica of a scaling group.
type cliqueInstance struct {
	tmpl       *grove.PodCliqueTemplateSpec
	fqn        string
	pcsReplica int
	gang       string // the PodGang its pods belong to
	baseGang   string // set when gang is a scaled PodGang: gates wait for this one
	sg         *grove.PodCliqueScalingGroupConfig
	sgFQN      string
	sgReplica  int
	owner      metav1.OwnerReference
}

// labels are the PodClique's labels, which its pods inherit
// (podcliqueset/components/podclique and podcliquescalinggroup/components/podclique in Grove).
func (cl *cliqueInstance) labels(pcs *grove.PodCliqueSet) map[string]string {
	component := grovecommon.LabelComponentNamePodCliqueSetPodClique
	extra := map[string]string{}
	if cl.sg != nil {
		component = grovecommon.LabelComponentNamePodCliqueScalingGroupPodClique
		extra[grovecommon.LabelPodCliqueScalingGroup] = cl.sgFQN
		extra[grovecommon.LabelPodCliqueScalingGroupReplicaIndex] = strconv.Itoa(cl.sgReplica)
		if cl.baseGang != "" {
			extra[grovecommon.LabelBasePodGang] = cl.baseGang
		}
	}
	spec, _ := json.Marshal(cl.tmpl.Spec.PodSpec)
	h := fnv.New32a()
	_, _ = h.Write(spec)
	return merge(cl.tmpl.Labels, grovecommon.GetDefaultLabelsForPodCliqueSetManagedResources(pcs.Name), map[string]string{
		grovecommon.LabelAppNameKey:               cl.fqn,
		grovecommon.LabelComponentKey:             component,
		grovecommon.LabelPodCliqueSetReplicaIndex: strconv.Itoa(cl.pcsReplica),
		grovecommon.LabelPodGang:                  cl.gang,
		grovecommon.LabelPodTemplateHash:          rand.SafeEncodeString(fmt.Sprint(h.Sum32())),
	}, extra)
}

// syncClique makes the PodClique object, its claims, then its missing
// pods (lowest free indices first).
func (g *Operator) syncClique(ctx context.Context, pcs *grove.PodCliqueSet, cl *cliqueInstance) error {
	lbls := cl.labels(pcs)
	pclq := &grove.PodClique{
		TypeMeta: metav1.TypeMeta{APIVersion: grove.SchemeGroupVersion.String(), Kind: "PodClique"},
		ObjectMeta: metav1.ObjectMeta{Name: cl.fqn, Namespace: pcs.Namespace, Labels: lbls, Annotations: cl.tmpl.Annotations,
			OwnerReferences: []metav1.OwnerReference{cl.owner}},
		Spec: cl.tmpl.Spec,
	}
	got, err := g.ensure(ctx, pclqGVR, pclq)
	if err != nil {
		return err
	}
	pclq.UID = got.GetUID()
	owner := controllerRef(pclq, "PodClique")
	for _, s := range cl.tmpl.ResourceSharing {
		for _, idx := range replicaIndices(s.Scope, cl.tmpl.Spec.Replicas) {
			extra := map[string]string{grovecommon.LabelPodClique: cl.fqn}
			if idx != nil {
				extra[grovecommon.LabelPodCliquePodIndex] = strconv.Itoa(*idx)
			}
			if err := g.syncClaim(ctx, pcs, cl.fqn, s, idx, owner, extra); err != nil {
				return err
			}
		}
	}
	pods, err := g.client.CoreV1().Pods(pcs.Namespace).List(ctx, metav1.ListOptions{LabelSelector: grovecommon.LabelPodClique + "=" + cl.fqn})
	if err != nil {
		return fmt.Errorf("list pods of PodClique %s: %w", cl.fqn, err)
	}
	have := map[string]bool{}
	for _, p := range pods.Items {
		have[p.Labels[grovecommon.LabelPodCliquePodIndex]] = true
	}
	for idx := 0; idx < int(cl.tmpl.Spec.Replicas); idx++ {
		if have[strconv.Itoa(idx)] {
			continue
		}
		pod := g.buildPod(pcs, cl, lbls, owner, idx)
		if _, err := g.client.CoreV1().Pods(pcs.Namespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create pod %d of PodClique %s: %w", idx, cl.fqn, err)
		}
	}
	return nil
}

// buildPod is Grove's pod (podclique/components/pod/pod.go, buildResource):
// the clique's pod spec, gated, with Grove's names, labels and environment
// and every shared claim in scope in every container and init container.
func (g *Operator) buildPod(pcs *grove.PodCliqueSet, cl *cliqueInstance, pclqLabels map[string]string, owner metav1.OwnerReference, idx int) *v1.Pod {
	pcsReplica := grovecommon.ResourceNameReplica{Name: pcs.Name, Replica: cl.pcsReplica}
	spec := cl.tmpl.Spec.PodSpec.DeepCopy()
	spec.SchedulingGates = append(spec.SchedulingGates, v1.PodSchedulingGate{Name: podGangGate})
	if spec.SchedulerName == "" {
		spec.SchedulerName = v1.DefaultSchedulerName
	}
	spec.Hostname = fmt.Sprintf("%s-%d", cl.fqn, idx)
	spec.Subdomain = grovecommon.GenerateHeadlessServiceName(pcsReplica)
	env := []v1.EnvVar{
		{Name: "GROVE_PCS_NAME", Value: pcs.Name},
		{Name: "GROVE_PCS_INDEX", Value: strconv.Itoa(cl.pcsReplica)},
		{Name: "GROVE_PCLQ_NAME", Value: cl.fqn},
		{Name: "GROVE_HEADLESS_SERVICE", Value: grovecommon.GenerateHeadlessServiceAddress(pcsReplica, pcs.Namespace)},
		{Name: "GROVE_PCLQ_POD_INDEX", Value: strconv.Itoa(idx)},
	}
	if cl.sg != nil {
		var pods int32
		for _, name := range cl.sg.CliqueNames {
			if t := findClique(pcs, name); t != nil {
				pods += t.Spec.Replicas
			}
		}
		env = append(env, v1.EnvVar{Name: "GROVE_PCSG_NAME", Value: cl.sgFQN}, v1.EnvVar{Name: "GROVE_PCSG_INDEX", Value: strconv.Itoa(cl.sgReplica)},
			v1.EnvVar{Name: "GROVE_PCSG_TEMPLATE_NUM_PODS", Value: strconv.Itoa(int(pods))})
	}
	for i := range spec.Containers {
		spec.Containers[i].Env = append(spec.Containers[i].Env, env...)
	}
	for i := range spec.InitContainers {
		spec.InitContainers[i].Env = append(spec.InitContainers[i].Env, env...)
	}

	// Grove's injection order: PodCliqueSet AllReplicas, PerReplica, scaling
	// group AllReplicas, PerReplica, PodClique AllReplicas, PerReplica.
	matchNames := []string{cl.tmpl.Name}
	if cl.sg != nil {
		matchNames = append(matchNames, cl.sg.Name)
	}
	for _, s := range pcs.Spec.Template.ResourceSharing {
		if s.Scope == grove.ResourceSharingScopeAllReplicas && s.FilterMatches(matchNames...) {
			injectClaim(spec, claimName(pcs.Name, s.ResourceSharingSpec, nil))
		}
	}
	for _, s := range pcs.Spec.Template.ResourceSharing {
		if s.Scope == grove.ResourceSharingScopePerReplica && s.FilterMatches(matchNames...) {
			injectClaim(spec, claimName(pcs.Name, s.ResourceSharingSpec, &cl.pcsReplica))
		}
	}
	if cl.sg != nil {
		for _, scope := range []grove.ResourceSharingScope{grove.ResourceSharingScopeAllReplicas, grove.ResourceSharingScopePerReplica} {
			for _, s := range cl.sg.ResourceSharing {
				if s.Scope == scope && s.FilterMatches(cl.tmpl.Name) {
					injectClaim(spec, claimName(cl.sgFQN, s.ResourceSharingSpec, scopeIndex(scope, cl.sgReplica)))
				}
			}
		}
	}
	for _, scope := range []grove.ResourceSharingScope{grove.ResourceSharingScopeAllReplicas, grove.ResourceSharingScopePerReplica} {
		for _, s := range cl.tmpl.ResourceSharing {
			if s.Scope == scope {
				injectClaim(spec, claimName(cl.fqn, s, scopeIndex(scope, idx)))
			}
		}
	}

	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{GenerateName: cl.fqn + "-", Namespace: pcs.Namespace, Annotations: cl.tmpl.Annotations,
			Labels: merge(pclqLabels, grovecommon.GetDefaultLabelsForPodCliqueSetManagedResources(pcs.Name), map[string]string{
				grovecommon.LabelPodClique:                cl.fqn,
				grovecommon.LabelPodCliqueSetReplicaIndex: strconv.Itoa(cl.pcsReplica),
				grovecommon.LabelPodGang:                  cl.gang,
				grovecommon.LabelPodCliquePodIndex:        strconv.Itoa(idx),
			}),
			OwnerReferences: []metav1.OwnerReference{owner}},
		Spec: *spec,
	}
}

func scopeIndex(scope grove.ResourceSharingScope, idx int) *int {
	if scope == grove.ResourceSharingScopeAllReplicas {
		return nil
	}
	return &idx
}

// injectClaim is Grove's InjectResourceClaimRefs for one claim: the pod
// entry is named after the claim, and every container, init containers
// included, gets the whole claim.
func injectClaim(spec *v1.PodSpec, name string) {
	spec.ResourceClaims = append(spec.ResourceClaims, v1.PodResourceClaim{Name: name, ResourceClaimName: &name})
	for i := range spec.Containers {
		spec.Containers[i].Resources.Claims = append(spec.Containers[i].Resources.Claims, v1.ResourceClaim{Name: name})
	}
	for i := range spec.InitContainers {
		spec.InitContainers[i].Resources.Claims = append(spec.InitContainers[i].Resources.Claims, v1.ResourceClaim{Name: name})
	}
}

// syncGangs writes the replica's PodGangs (podgroups of the cliques' pods,
// as Grove's podgang component does) and lifts the gate of every pod that
// is in its PodGang, once a scaled PodGang's base PodGang is scheduled
// (podclique/components/pod/syncflow.go, checkAndRemovePodSchedulingGates).
func (g *Operator) syncGangs(ctx context.Context, pcs *grove.PodCliqueSet, cliques []*cliqueInstance) error {
	pods, err := g.client.CoreV1().Pods(pcs.Namespace).List(ctx, metav1.ListOptions{LabelSelector: grovecommon.LabelPartOfKey + "=" + pcs.Name})
	if err != nil {
		return fmt.Errorf("list pods of PodCliqueSet %s: %w", pcs.Name, err)
	}
	byClique := map[string][]v1.Pod{}
	for _, p := range pods.Items {
		if p.DeletionTimestamp == nil {
			byClique[p.Labels[grovecommon.LabelPodClique]] = append(byClique[p.Labels[grovecommon.LabelPodClique]], p)
		}
	}
	type group struct {
		cl   *cliqueInstance
		refs []string
	}
	gangs := map[string][]group{}
	var order []string
	for _, cl := range cliques {
		if _, ok := gangs[cl.gang]; !ok {
			order = append(order, cl.gang)
		}
		gangs[cl.gang] = append(gangs[cl.gang], group{cl: cl, refs: sortedNames(byClique[cl.fqn])})
	}
	for _, name := range order {
		var podgroups []any
		complete := true
		for _, grp := range gangs[name] {
			refs := make([]any, 0, len(grp.refs))
			for _, r := range grp.refs {
				refs = append(refs, map[string]any{"namespace": pcs.Namespace, "name": r})
			}
			complete = complete && len(grp.refs) >= int(grp.cl.tmpl.Spec.Replicas)
			podgroups = append(podgroups, map[string]any{"name": grp.cl.fqn, "podReferences": refs, "minReplicas": int64(*grp.cl.tmpl.Spec.MinAvailable)})
		}
		if err := g.writeGang(ctx, pcs, name, podgroups, complete); err != nil {
			return err
		}
	}
	// A PodGang is scheduled when each of its cliques has at least
	// minReplicas pods bound to a node.
	scheduled := func(gang string) bool {
		for _, grp := range gangs[gang] {
			bound := 0
			for _, p := range byClique[grp.cl.fqn] {
				if p.Spec.NodeName != "" {
					bound++
				}
			}
			if bound < int(*grp.cl.tmpl.Spec.MinAvailable) {
				return false
			}
		}
		return true
	}
	for _, grp := range flatten(gangs) {
		if grp.cl.baseGang != "" && !scheduled(grp.cl.baseGang) {
			continue
		}
		for _, p := range byClique[grp.cl.fqn] {
			if !slices.Contains(grp.refs, p.Name) || !hasGate(&p) {
				continue
			}
			if err := g.removeGate(ctx, &p); err != nil {
				return err
			}
		}
	}
	return nil
}

func flatten[T any](m map[string][]T) []T {
	var out []T
	for _, v := range m {
		out = append(out, v...)
	}
	return out
}

func hasGate(p *v1.Pod) bool {
	return slices.ContainsFunc(p.Spec.SchedulingGates, func(g v1.PodSchedulingGate) bool { return g.Name == podGangGate })
}

// removeGate deletes only Grove's gate with a merge patch, as Grove does.
func (g *Operator) removeGate(ctx context.Context, p *v1.Pod) error {
	gates := []v1.PodSchedulingGate{}
	for _, gate := range p.Spec.SchedulingGates {
		if gate.Name != podGangGate {
			gates = append(gates, gate)
		}
	}
	patch, err := json.Marshal(map[string]any{"spec": map[string]any{"schedulingGates": gates}})
	if err != nil {
		return err
	}
	if _, err := g.client.CoreV1().Pods(p.Namespace).Patch(ctx, p.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("remove scheduling gate of pod %s: %w", p.Name, err)
	}
	return nil
}

// writeGang creates or updates a PodGang and its Initialized condition.
func (g *Operator) writeGang(ctx context.Context, pcs *grove.PodCliqueSet, name string, podgroups []any, complete bool) error {
	ri := g.dyn.Resource(podGangGVR).Namespace(pcs.Namespace)
	gang, err := ri.Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		gang = &unstructured.Unstructured{Object: map[string]any{"apiVersion": podGangGVR.GroupVersion().String(), "kind": "PodGang"}}
		gang.SetName(name)
		gang.SetNamespace(pcs.Namespace)
		gang.SetLabels(merge(pcs.Labels, grovecommon.GetDefaultLabelsForPodCliqueSetManagedResources(pcs.Name),
			map[string]string{grovecommon.LabelComponentKey: grovecommon.LabelComponentNamePodGang}))
		gang.SetOwnerReferences([]metav1.OwnerReference{controllerRef(pcs, "PodCliqueSet")})
		if err := unstructured.SetNestedSlice(gang.Object, podgroups, "spec", "podgroups"); err != nil {
			return err
		}
		if gang, err = ri.Create(ctx, gang, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create PodGang %s: %w", name, err)
		}
	} else if err != nil {
		return fmt.Errorf("get PodGang %s: %w", name, err)
	} else {
		old, _, _ := unstructured.NestedSlice(gang.Object, "spec", "podgroups")
		if !equalJSON(old, podgroups) {
			if err := unstructured.SetNestedSlice(gang.Object, podgroups, "spec", "podgroups"); err != nil {
				return err
			}
			if gang, err = ri.Update(ctx, gang, metav1.UpdateOptions{}); err != nil {
				return fmt.Errorf("update PodGang %s: %w", name, err)
			}
		}
	}
	status, reason := "False", "PodGangPodsCreationPending"
	if complete {
		status, reason = "True", "PodGangPodsCreated"
	}
	conds, _, _ := unstructured.NestedSlice(gang.Object, "status", "conditions")
	if len(conds) == 1 {
		if c, ok := conds[0].(map[string]any); ok && c["status"] == status {
			return nil
		}
	}
	cond := map[string]any{"type": "Initialized", "status": status, "reason": reason, "message": reason,
		"lastTransitionTime": metav1.Now().UTC().Format("2006-01-02T15:04:05Z")}
	gang.Object["status"] = map[string]any{"phase": "Pending", "conditions": []any{cond}}
	if _, err := ri.UpdateStatus(ctx, gang, metav1.UpdateOptions{}); err != nil && !apierrors.IsConflict(err) {
		return fmt.Errorf("update status of PodGang %s: %w", name, err)
	}
	return nil
}

func equalJSON(a, b any) bool {
	ja, errA := json.Marshal(a)
	jb, errB := json.Marshal(b)
	return errA == nil && errB == nil && string(ja) == string(jb)
}
