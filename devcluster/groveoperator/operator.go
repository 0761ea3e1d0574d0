package groveoperator

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"time"

	grovecommon "github.com/ai-dynamo/grove/operator/api/common"
	grove "github.com/ai-dynamo/grove/operator/api/core/v1alpha1"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	restclient "k8s.io/client-go/rest"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
)

// The Grove operator stand-in does what Grove (ai-dynamo/grove,
// v0.1.0-alpha.12-rc1) does with claims and pods, so that gpudra is tested
// against the objects Grove really makes: it waits for the PodCliqueSet's
// service-account token Secret, makes PodCliques and PodCliqueScalingGroups,
// the ResourceClaims of resourceSharing at all three levels (names, labels,
// controller owners as Grove sets them), gated pods with the claims in every
// container, and PodGangs, and it lifts the scheduling gate once a pod is in
// its PodGang. It does nothing else Grove does (no rolling updates, topology,
// headless Services, RBAC for pods, startsAfter init containers, scale-in,
// finalizers: the garbage collector removes what a deleted PodCliqueSet
// owned). docs/grove.md names the sources.

// podGangGate is the scheduling gate Grove puts on every pod it creates.
const podGangGate = "grove.io/podgang-pending-creation"

var (
	pcsGVR  = grove.SchemeGroupVersion.WithResource("podcliquesets")
	pclqGVR = grove.SchemeGroupVersion.WithResource("podcliques")
	pcsgGVR = grove.SchemeGroupVersion.WithResource("podcliquescalinggroups")
)

// Operator reconciles every PodCliqueSet by polling: the stand-in is
// for tests of a few objects, where a poll every half second is cheaper to
// get right than Grove's watches.
type Operator struct {
	client kubernetes.Interface
	dyn    dynamic.Interface
}

func NewOperator(cfg *restclient.Config) (*Operator, error) {
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("Grove stand-in client: %w", err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("Grove stand-in dynamic client: %w", err)
	}
	return &Operator{client: client, dyn: dyn}, nil
}

func (g *Operator) Run(ctx context.Context) {
	logger := klog.LoggerWithName(klog.FromContext(ctx), "grove-stand-in")
	wait.UntilWithContext(ctx, func(ctx context.Context) {
		list, err := g.dyn.Resource(pcsGVR).List(ctx, metav1.ListOptions{})
		if err != nil {
			logger.V(2).Info("List PodCliqueSets", "err", err)
			return
		}
		for i := range list.Items {
			var pcs grove.PodCliqueSet
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(list.Items[i].Object, &pcs); err != nil {
				logger.Error(err, "Decode PodCliqueSet", "podcliqueset", klog.KObj(&list.Items[i]))
				continue
			}
			if pcs.DeletionTimestamp != nil {
				continue
			}
			if err := g.sync(ctx, &pcs); err != nil && ctx.Err() == nil {
				logger.Error(err, "Sync PodCliqueSet", "podcliqueset", klog.KObj(&pcs))
			}
		}
	}, 500*time.Millisecond)
}

// applyDefaults applies what Grove's defaulting webhook and CRD defaults
// would have set (webhook/admission/pcs/defaulting).
func applyDefaults(pcs *grove.PodCliqueSet) {
	for _, c := range pcs.Spec.Template.Cliques {
		if c.Spec.Replicas == 0 {
			c.Spec.Replicas = 1
		}
		if c.Spec.MinAvailable == nil {
			c.Spec.MinAvailable = ptr.To(c.Spec.Replicas)
		}
	}
	for i := range pcs.Spec.Template.PodCliqueScalingGroupConfigs {
		sg := &pcs.Spec.Template.PodCliqueScalingGroupConfigs[i]
		if sg.Replicas == nil {
			sg.Replicas = ptr.To[int32](1)
		}
		if sg.MinAvailable == nil {
			sg.MinAvailable = ptr.To[int32](1)
		}
	}
}

// sync is one reconcile of a PodCliqueSet, in Grove's order: service
// account and its token Secret (nothing else until the token is there),
// PodCliqueSet-level claims, then per replica the scaling groups (their
// claims before their cliques), the cliques (their claims before their
// pods), the PodGangs, and the gates.
func (g *Operator) sync(ctx context.Context, pcs *grove.PodCliqueSet) error {
	applyDefaults(pcs)
	ready, err := g.syncTokenSecret(ctx, pcs)
	if err != nil || !ready {
		return err
	}
	owner := controllerRef(pcs, "PodCliqueSet")
	for _, s := range pcs.Spec.Template.ResourceSharing {
		for _, r := range replicaIndices(s.Scope, pcs.Spec.Replicas) {
			extra := map[string]string{}
			if r != nil {
				extra[grovecommon.LabelPodCliqueSetReplicaIndex] = strconv.Itoa(*r)
			}
			if err := g.syncClaim(ctx, pcs, pcs.Name, s.ResourceSharingSpec, r, owner, extra); err != nil {
				return err
			}
		}
	}
	for r := 0; r < int(pcs.Spec.Replicas); r++ {
		if err := g.syncReplica(ctx, pcs, r); err != nil {
			return err
		}
	}
	return nil
}

// syncTokenSecret makes the PodCliqueSet's ServiceAccount and its
// `<pcs>-ic-sat` Secret, and says whether the token controller has filled
// the Secret yet (satokensecret.go in Grove).
func (g *Operator) syncTokenSecret(ctx context.Context, pcs *grove.PodCliqueSet) (bool, error) {
	base := grovecommon.GetDefaultLabelsForPodCliqueSetManagedResources(pcs.Name)
	saName := grovecommon.GeneratePodServiceAccountName(pcs.Name)
	sa := &v1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: saName, Namespace: pcs.Namespace,
		Labels:          merge(base, map[string]string{grovecommon.LabelComponentKey: grovecommon.LabelComponentNamePodServiceAccount, grovecommon.LabelAppNameKey: saName}),
		OwnerReferences: []metav1.OwnerReference{controllerRef(pcs, "PodCliqueSet")}}}
	if _, err := g.client.CoreV1().ServiceAccounts(pcs.Namespace).Create(ctx, sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return false, fmt.Errorf("create ServiceAccount %s: %w", saName, err)
	}
	name := grovecommon.GenerateInitContainerSATokenSecretName(pcs.Name)
	secret, err := g.client.CoreV1().Secrets(pcs.Namespace).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		secret = &v1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: pcs.Namespace,
			Labels:          merge(base, map[string]string{grovecommon.LabelComponentKey: grovecommon.LabelComponentNameServiceAccountTokenSecret, grovecommon.LabelAppNameKey: name}),
			Annotations:     map[string]string{v1.ServiceAccountNameKey: saName},
			OwnerReferences: []metav1.OwnerReference{controllerRef(pcs, "PodCliqueSet")}},
			Type: v1.SecretTypeServiceAccountToken}
		secret, err = g.client.CoreV1().Secrets(pcs.Namespace).Create(ctx, secret, metav1.CreateOptions{})
	}
	if err != nil {
		return false, fmt.Errorf("Secret %s: %w", name, err)
	}
	return len(secret.Data[v1.ServiceAccountTokenKey]) > 0, nil
}

// syncReplica makes one PodCliqueSet replica: its scaling groups with
// their claims and cliques, its standalone cliques, its PodGangs and gates.
func (g *Operator) syncReplica(ctx context.Context, pcs *grove.PodCliqueSet, r int) error {
	pcsReplica := grovecommon.ResourceNameReplica{Name: pcs.Name, Replica: r}
	baseGang := grovecommon.GenerateBasePodGangName(pcsReplica)
	inGroup := map[string]bool{}
	var cliques []*cliqueInstance
	for i := range pcs.Spec.Template.PodCliqueScalingGroupConfigs {
		cfg := &pcs.Spec.Template.PodCliqueScalingGroupConfigs[i]
		pcsg, err := g.syncScalingGroup(ctx, pcs, r, cfg)
		if err != nil {
			return err
		}
		owner := controllerRef(pcsg, "PodCliqueScalingGroup")
		for _, sh := range cfg.ResourceSharing {
			for _, idx := range replicaIndices(sh.Scope, *cfg.Replicas) {
				extra := map[string]string{grovecommon.LabelPodCliqueScalingGroup: pcsg.Name}
				if idx != nil {
					extra[grovecommon.LabelPodCliqueScalingGroupReplicaIndex] = strconv.Itoa(*idx)
				}
				if err := g.syncClaim(ctx, pcs, pcsg.Name, sh.ResourceSharingSpec, idx, owner, extra); err != nil {
					return err
				}
			}
		}
		for j := 0; j < int(*cfg.Replicas); j++ {
			gang := grovecommon.GeneratePodGangNameForPodCliqueOwnedByPCSG(pcs, r, pcsg, j)
			for _, name := range cfg.CliqueNames {
				inGroup[name] = true
				tmpl := findClique(pcs, name)
				if tmpl == nil {
					return fmt.Errorf("scaling group %s names clique %s, which the template lacks", cfg.Name, name)
				}
				cl := &cliqueInstance{tmpl: tmpl, fqn: grovecommon.GeneratePodCliqueName(grovecommon.ResourceNameReplica{Name: pcsg.Name, Replica: j}, name),
					pcsReplica: r, gang: gang, sg: cfg, sgFQN: pcsg.Name, sgReplica: j, owner: owner}
				if gang != baseGang {
					cl.baseGang = baseGang
				}
				cliques = append(cliques, cl)
			}
		}
	}
	for _, tmpl := range pcs.Spec.Template.Cliques {
		if !inGroup[tmpl.Name] {
			cliques = append(cliques, &cliqueInstance{tmpl: tmpl, fqn: grovecommon.GeneratePodCliqueName(pcsReplica, tmpl.Name),
				pcsReplica: r, gang: baseGang, owner: controllerRef(pcs, "PodCliqueSet")})
		}
	}
	for _, cl := range cliques {
		if err := g.syncClique(ctx, pcs, cl); err != nil {
			return err
		}
	}
	return g.syncGangs(ctx, pcs, cliques)
}

// syncScalingGroup makes the PodCliqueScalingGroup object of one replica.
func (g *Operator) syncScalingGroup(ctx context.Context, pcs *grove.PodCliqueSet, r int, cfg *grove.PodCliqueScalingGroupConfig) (*grove.PodCliqueScalingGroup, error) {
	name := grovecommon.GeneratePodCliqueScalingGroupName(grovecommon.ResourceNameReplica{Name: pcs.Name, Replica: r}, cfg.Name)
	pcsg := &grove.PodCliqueScalingGroup{
		TypeMeta: metav1.TypeMeta{APIVersion: grove.SchemeGroupVersion.String(), Kind: "PodCliqueScalingGroup"},
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: pcs.Namespace, Annotations: cfg.Annotations,
			Labels: merge(grovecommon.GetDefaultLabelsForPodCliqueSetManagedResources(pcs.Name), map[string]string{
				grovecommon.LabelAppNameKey: name, grovecommon.LabelComponentKey: grovecommon.LabelComponentNamePodCliqueScalingGroup,
				grovecommon.LabelPodCliqueSetReplicaIndex: strconv.Itoa(r)}),
			OwnerReferences: []metav1.OwnerReference{controllerRef(pcs, "PodCliqueSet")}},
		Spec: grove.PodCliqueScalingGroupSpec{Replicas: *cfg.Replicas, MinAvailable: cfg.MinAvailable, CliqueNames: cfg.CliqueNames},
	}
	got, err := g.ensure(ctx, pcsgGVR, pcsg)
	if err != nil {
		return nil, err
	}
	out := &grove.PodCliqueScalingGroup{}
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(got.Object, out); err != nil {
		return nil, fmt.Errorf("decode PodCliqueScalingGroup %s: %w", name, err)
	}
	return out, nil
}

// ensure creates a Grove object from its typed form unless it exists, and
// returns what the API server has.
func (g *Operator) ensure(ctx context.Context, gvr schema.GroupVersionResource, obj metav1.Object) (*unstructured.Unstructured, error) {
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(obj)
	if err != nil {
		return nil, fmt.Errorf("encode %s %s: %w", gvr.Resource, obj.GetName(), err)
	}
	ri := g.dyn.Resource(gvr).Namespace(obj.GetNamespace())
	got, err := ri.Create(ctx, &unstructured.Unstructured{Object: m}, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		got, err = ri.Get(ctx, obj.GetName(), metav1.GetOptions{})
	}
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", gvr.Resource, obj.GetName(), err)
	}
	return got, nil
}

// replicaIndices are the replica indices of a sharing entry's claims: one
// claim (nil index) for AllReplicas, one per replica for PerReplica.
func replicaIndices(scope grove.ResourceSharingScope, replicas int32) []*int {
	if scope == grove.ResourceSharingScopeAllReplicas {
		return []*int{nil}
	}
	out := make([]*int, 0, replicas)
	for i := 0; i < int(replicas); i++ {
		out = append(out, ptr.To(i))
	}
	return out
}

// claimName is Grove's ResourceClaim name (resourceclaim/naming.go).
func claimName(owner string, s grove.ResourceSharingSpec, idx *int) string {
	if idx == nil {
		return fmt.Sprintf("%s-all-%s", owner, s.Name)
	}
	return fmt.Sprintf("%s-%d-%s", owner, *idx, s.Name)
}

// syncClaim makes one ResourceClaim from the template the sharing entry
// names: the PodCliqueSet's own template (only its spec: Grove drops the
// template's metadata) or a ResourceClaimTemplate object.
func (g *Operator) syncClaim(ctx context.Context, pcs *grove.PodCliqueSet, ownerName string, s grove.ResourceSharingSpec, idx *int,
	owner metav1.OwnerReference, extraLabels map[string]string) error {
	name := claimName(ownerName, s, idx)
	if _, err := g.client.ResourceV1().ResourceClaims(pcs.Namespace).Get(ctx, name, metav1.GetOptions{}); err == nil {
		return nil
	} else if !apierrors.IsNotFound(err) {
		return fmt.Errorf("get ResourceClaim %s: %w", name, err)
	}
	var spec *resourceapi.ResourceClaimSpec
	if s.Namespace == "" {
		for _, t := range pcs.Spec.Template.ResourceClaimTemplates {
			if t.Name == s.Name {
				spec = t.TemplateSpec.Spec.DeepCopy()
				break
			}
		}
	}
	if spec == nil {
		ns := s.Namespace
		if ns == "" {
			ns = pcs.Namespace
		}
		rct, err := g.client.ResourceV1().ResourceClaimTemplates(ns).Get(ctx, s.Name, metav1.GetOptions{})
		if err != nil {
			return fmt.Errorf("ResourceClaimTemplate %s/%s for claim %s: %w", ns, s.Name, name, err)
		}
		spec = rct.Spec.Spec.DeepCopy()
	}
	lbls := merge(grovecommon.GetDefaultLabelsForPodCliqueSetManagedResources(pcs.Name),
		map[string]string{grovecommon.LabelComponentKey: grovecommon.LabelComponentNameResourceClaim})
	claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: pcs.Namespace, Labels: merge(lbls, extraLabels),
		OwnerReferences: []metav1.OwnerReference{owner}}, Spec: *spec}
	if _, err := g.client.ResourceV1().ResourceClaims(pcs.Namespace).Create(ctx, claim, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create ResourceClaim %s: %w", name, err)
	}
	return nil
}

func findClique(pcs *grove.PodCliqueSet, name string) *grove.PodCliqueTemplateSpec {
	for _, c := range pcs.Spec.Template.Cliques {
		if c.Name == name {
			return c
		}
	}
	return nil
}

// controllerRef is the owner reference controller-runtime's
// SetControllerReference makes.
func controllerRef(obj metav1.Object, kind string) metav1.OwnerReference {
	return metav1.OwnerReference{APIVersion: grove.SchemeGroupVersion.String(), Kind: kind, Name: obj.GetName(), UID: obj.GetUID(),
		Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true)}
}

func merge(maps ...map[string]string) map[string]string {
	out := map[string]string{}
	for _, m := range maps {
		for k, v := range m {
			out[k] = v
		}
	}
	return out
}

// sortedNames sorts pods by name, as Grove sorts a PodGang's references.
func sortedNames(pods []v1.Pod) []string {
	names := make([]string, 0, len(pods))
	for _, p := range pods {
		names = append(names, p.Name)
	}
	sort.Strings(names)
	return names
}
