package dashboard

import (
	"cmp"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"

	"github.com/gpudra/gpudra/pkg/kuberay"
	"github.com/gpudra/gpudra/pkg/kueue"
)

// The engines' resources the dashboard groups pods by, read as
// unstructured where served: KubeRay's (ray.io/v1) and Kueue's
// (kueue.x-k8s.io/v1beta2). Their Go modules pin other Kubernetes
// versions than gpudra's and are not imported.
var (
	RayClusters    = kuberay.RayClusters
	RayJobs        = kuberay.RayJobs
	KueueWorkloads = kueue.Workloads
	LocalQueues    = kueue.LocalQueues
)

// KubeRay's labels on the pods of a Ray cluster.
const (
	rayClusterLabel  = "ray.io/cluster"
	rayNodeTypeLabel = "ray.io/node-type"
	rayGroupLabel    = "ray.io/group"
)

// Kueue's states of a Workload, as the page shows them (package kueue).
const (
	KueuePending  = kueue.Pending
	KueueReserved = kueue.Reserved
	KueueAdmitted = kueue.Admitted
	KueueFinished = kueue.Finished
	KueueInactive = kueue.Inactive
)

// Workload is a Ray cluster (alone, or that of the RayJob it belongs to),
// or a job Kueue queues, with its pods and the devices of their claims:
// what the user submitted, as what it is.
type Workload struct {
	// Kind is "RayJob", "RayCluster", or the kind of the object a Kueue
	// Workload belongs to ("Job", ...).
	Kind      string `json:"kind"`
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	// State is KubeRay's: a RayJob's jobDeploymentStatus (and Ray's
	// jobStatus after a slash), a RayCluster's status.state.
	State string `json:"state,omitempty"`
	// RayCluster names a RayJob's cluster, and ClusterState its state.
	RayCluster   string `json:"rayCluster,omitempty"`
	ClusterState string `json:"clusterState,omitempty"`
	// Kueue is the Kueue Workload of it, where one exists.
	Kueue *KueueStatus `json:"kueue,omitempty"`
	// Pods are its pods, the head first, then by name.
	Pods    []WorkloadPod `json:"pods"`
	Kubectl string        `json:"kubectl,omitempty"`
}

// KueueStatus is where Kueue has a workload (package kueue), and the
// kubectl command that shows its Workload.
type KueueStatus struct {
	kueue.Status
	Kubectl string `json:"kubectl,omitempty"`
}

// WorkloadPod is one pod of a workload.
type WorkloadPod struct {
	Name string `json:"name"`
	// Role is KubeRay's node type (head, worker); Group its worker group.
	Role  string `json:"role,omitempty"`
	Group string `json:"group,omitempty"`
	Node  string `json:"node,omitempty"`
	Phase string `json:"phase"`
	// Claims are its ResourceClaims and their devices.
	Claims []WorkloadClaim `json:"claims,omitempty"`
}

// WorkloadClaim is a pod's claim and the devices allocated to it,
// <node pool>/<device>; none while unallocated.
type WorkloadClaim struct {
	Name    string   `json:"name"`
	Devices []string `json:"devices,omitempty"`
}

// WorkloadInputs are the engines' objects, nil where not read.
type WorkloadInputs struct {
	RayClusters, RayJobs        []*unstructured.Unstructured
	KueueWorkloads, LocalQueues []*unstructured.Unstructured
}

// workloads groups the engines' objects with their pods and claims. Pure.
func workloads(in WorkloadInputs, pods []*corev1.Pod, claims map[string]*resourceapi.ResourceClaim) []Workload {
	var out []*Workload
	byUID := map[types.UID]*Workload{}
	byCluster := map[string]*Workload{} // ns/RayCluster name
	add := func(w *Workload, uid types.UID) {
		out = append(out, w)
		if uid != "" {
			byUID[uid] = w
		}
	}
	for _, rj := range in.RayJobs {
		deployment, _, _ := unstructured.NestedString(rj.Object, "status", "jobDeploymentStatus")
		job, _, _ := unstructured.NestedString(rj.Object, "status", "jobStatus")
		cluster, _, _ := unstructured.NestedString(rj.Object, "status", "rayClusterName")
		w := &Workload{Kind: "RayJob", Namespace: rj.GetNamespace(), Name: rj.GetName(), State: strings.Trim(deployment+"/"+job, "/"),
			RayCluster: cluster, Kubectl: kubectlGet("rayjob", rj.GetNamespace(), rj.GetName())}
		add(w, rj.GetUID())
		if cluster != "" {
			byCluster[rj.GetNamespace()+"/"+cluster] = w
		}
	}
	for _, rc := range in.RayClusters {
		state, _, _ := unstructured.NestedString(rc.Object, "status", "state")
		key := rc.GetNamespace() + "/" + rc.GetName()
		owner := byCluster[key]
		for _, o := range rc.GetOwnerReferences() {
			if w := byUID[o.UID]; w != nil && o.Kind == "RayJob" {
				owner = w
			}
		}
		if owner != nil {
			owner.RayCluster, owner.ClusterState = rc.GetName(), state
			byCluster[key] = owner
			byUID[rc.GetUID()] = owner
			continue
		}
		w := &Workload{Kind: "RayCluster", Namespace: rc.GetNamespace(), Name: rc.GetName(), State: state,
			Kubectl: kubectlGet("raycluster", rc.GetNamespace(), rc.GetName())}
		add(w, rc.GetUID())
		byCluster[key] = w
	}
	clusterQueueOf := map[string]string{} // ns/LocalQueue
	for _, lq := range in.LocalQueues {
		cq, _, _ := unstructured.NestedString(lq.Object, "spec", "clusterQueue")
		clusterQueueOf[lq.GetNamespace()+"/"+lq.GetName()] = cq
	}
	byOwnerUID := map[types.UID]*Workload{} // the Kueue-queued object's UID: its pods are its own
	for _, kw := range in.KueueWorkloads {
		ks := kueueStatus(kw, clusterQueueOf)
		owner := metav1.GetControllerOf(kw)
		if owner == nil && len(kw.GetOwnerReferences()) > 0 {
			owner = &kw.GetOwnerReferences()[0]
		}
		if owner != nil {
			if w := byUID[owner.UID]; w != nil {
				w.Kueue = ks
				continue
			}
		}
		w := &Workload{Kind: "Workload", Namespace: kw.GetNamespace(), Name: kw.GetName(), Kueue: ks}
		if owner != nil {
			w.Kind, w.Name = owner.Kind, owner.Name
			w.Kubectl = kubectlGet(strings.ToLower(owner.Kind), kw.GetNamespace(), owner.Name)
			byOwnerUID[owner.UID] = w
		}
		add(w, "")
	}
	if len(out) == 0 {
		return nil
	}
	for _, p := range pods {
		var w *Workload
		if c := p.Labels[rayClusterLabel]; c != "" {
			w = byCluster[p.Namespace+"/"+c]
		}
		if w == nil {
			for _, o := range p.OwnerReferences {
				if w = byOwnerUID[o.UID]; w != nil {
					break
				}
			}
		}
		if w == nil || w.Namespace != p.Namespace {
			continue
		}
		wp := WorkloadPod{Name: p.Name, Role: p.Labels[rayNodeTypeLabel], Group: p.Labels[rayGroupLabel], Node: p.Spec.NodeName, Phase: string(p.Status.Phase)}
		for _, s := range p.Status.ResourceClaimStatuses {
			if s.ResourceClaimName == nil {
				continue
			}
			wc := WorkloadClaim{Name: *s.ResourceClaimName}
			if c := claims[p.Namespace+"/"+wc.Name]; c != nil && c.Status.Allocation != nil {
				for _, r := range c.Status.Allocation.Devices.Results {
					wc.Devices = append(wc.Devices, r.Pool+"/"+r.Device)
				}
			}
			wp.Claims = append(wp.Claims, wc)
		}
		w.Pods = append(w.Pods, wp)
	}
	res := make([]Workload, 0, len(out))
	for _, w := range out {
		slices.SortFunc(w.Pods, func(a, b WorkloadPod) int {
			return cmp.Or(cmp.Compare(roleRank(a.Role), roleRank(b.Role)), cmp.Compare(a.Name, b.Name))
		})
		if w.Pods == nil {
			w.Pods = []WorkloadPod{}
		}
		res = append(res, *w)
	}
	slices.SortFunc(res, func(a, b Workload) int {
		return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Name, b.Name), cmp.Compare(a.Kind, b.Kind))
	})
	return res
}

func roleRank(role string) int {
	if role == "head" {
		return 0
	}
	return 1
}

// kueueStatus reads a Kueue Workload's state from its conditions: the
// admission Kueue gave it, or why not.
func kueueStatus(kw *unstructured.Unstructured, clusterQueueOf map[string]string) *KueueStatus {
	return &KueueStatus{Status: kueue.StatusOf(kw, clusterQueueOf), Kubectl: kubectlGet("workloads.kueue.x-k8s.io", kw.GetNamespace(), kw.GetName())}
}
