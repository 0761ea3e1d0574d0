package gang

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// Scale-up demand for an autoscaler (docs/autoscaling.md, "Scale-up: how
// Karpenter sees gpudra's demand"). A gang held back by gpudra (gated, or
// with no PodGroup yet) and a queued reservation's claims are invisible to
// Karpenter and Cluster Autoscaler: they provision only for pods the
// scheduler marked Unschedulable. So for each item that waits because its
// devices do not fit in the cluster now, the controller publishes its demand
// as CapacityBuffers (autoscaling.x-k8s.io/v1beta1, the API both share):
// per pod of the gang, or per claim of the reservation, one PodTemplate and
// one buffer of one replica, whose virtual pod asks for the same devices by
// claim name. This file decides which objects should exist (pure);
// autoscalerwrite.go writes them and takes them back.

// CapacityBuffers is the resource of the autoscalers' buffer API. gpudra
// writes it as unstructured objects: its module does not import an
// autoscaler's.
var CapacityBuffers = schema.GroupVersionResource{Group: "autoscaling.x-k8s.io", Version: "v1beta1", Resource: "capacitybuffers"}

// Labels and names of the demand objects.
const (
	// LabelDemandFor names the item (gang or reservation, in the object's
	// namespace) an object publishes demand for; every demand object
	// carries it, and the controller's informers select on it.
	LabelDemandFor = "gpudra.dev/demand-for"
	// LabelDemandKind says which kind of item: gang or reservation.
	LabelDemandKind = "gpudra.dev/demand-kind"
	// ActiveProvisioningStrategy is the buffer strategy that makes the
	// autoscaler provision capacity for the buffer's virtual pods.
	ActiveProvisioningStrategy = "buffer.x-k8s.io/active-capacity"
	// demandPrefix starts every demand object's name.
	demandPrefix = "gpudra-demand-"
	// demandPauseImage is the image of a reservation's demand template:
	// a virtual pod never runs.
	demandPauseImage = "registry.k8s.io/pause:3.10"
)

// Demand kinds (LabelDemandKind).
const (
	demandKindGang        = "gang"
	demandKindReservation = "reservation"
)

// demandUnit is one virtual pod's worth of demand: a PodTemplate, the
// CapacityBuffer of one replica that names it, and the standalone demand
// claims its pod spec names where the real claims do not exist.
type demandUnit struct {
	template *corev1.PodTemplate
	buffer   *unstructured.Unstructured
	claims   []*resourceapi.ResourceClaim
}

// demandItemLabels are the labels of an item's demand objects. A label
// value holds 63 characters; a longer item name is shortened with a hash.
func demandItemLabels(kind, name string) map[string]string {
	v := name
	if len(validation.IsValidLabelValue(v)) > 0 {
		sum := sha256.Sum256([]byte(name))
		v = strings.Trim(name[:min(len(name), 50)], "-_.") + "-" + hex.EncodeToString(sum[:])[:10]
	}
	return map[string]string{LabelDemandFor: v, LabelDemandKind: kind}
}

// demandName is a demand object's name: the prefix and what it stands for,
// shortened with a hash past the 253 characters of a name.
func demandName(what string) string {
	n := demandPrefix + what
	if len(n) <= validation.DNS1123SubdomainMaxLength {
		return n
	}
	sum := sha256.Sum256([]byte(what))
	return n[:validation.DNS1123SubdomainMaxLength-11] + "-" + hex.EncodeToString(sum[:])[:10]
}

// gangDemand is the demand of a gang waiting for devices: one unit per pod.
// The pod's spec becomes the template (without what ties it to gpudra's
// hand-off: the scheduling gate, the node, the scheduling group; without
// its priority, which the autoscaler sets for virtual pods, and without
// ephemeral containers, which a PodTemplate may not have), each
// of its claims named by resourceClaimName:
//   - a claim the pod names, as it is;
//   - a claim made from a template (the gate path): the claim the claim
//     controller made, from the pod's status. A virtual pod has no status,
//     and Karpenter resolves a template's claim only from it;
//   - a claim not made yet (the Workload API path: the claim controller
//     waits for the pod's PodGroup, which gpudra creates only once the gang
//     fits): a standalone demand claim of the template's spec, made and
//     deleted with the buffer. No other claim can stand in: naming the
//     future claim fails Karpenter's lookup (it defers the pod), and making
//     the real claim ahead of the claim controller would race it. Nobody
//     allocates a demand claim: no real pod names it.
//
// template looks up a ResourceClaimTemplate (nil when absent: the gang is
// not published, as it could not be planned either).
func gangDemand(g *Gang, template func(namespace, name string) *resourceapi.ResourceClaimTemplate) ([]*demandUnit, error) {
	labels := demandItemLabels(demandKindGang, g.Name)
	units := make([]*demandUnit, 0, len(g.Pods))
	for _, p := range g.Pods {
		owner := metav1.OwnerReference{APIVersion: "v1", Kind: "Pod", Name: p.Name, UID: p.UID}
		name := demandName("pod-" + p.Name)
		u := &demandUnit{}
		spec := p.Spec.DeepCopy()
		spec.SchedulingGates, spec.NodeName, spec.SchedulingGroup, spec.Priority = nil, "", nil, nil
		spec.EphemeralContainers = nil
		// The informers keep a pod's containers' names and resources only
		// (dropUnread): what sizes and places the virtual pod. A template
		// must name an image; the virtual pod never runs it.
		for _, cs := range [][]corev1.Container{spec.InitContainers, spec.Containers} {
			for i := range cs {
				if cs[i].Image == "" {
					cs[i].Image = demandPauseImage
				}
			}
		}
		made := map[string]*string{}
		for _, st := range p.Status.ResourceClaimStatuses {
			made[st.Name] = st.ResourceClaimName
		}
		for i := range spec.ResourceClaims {
			rc := &spec.ResourceClaims[i]
			if rc.ResourceClaimTemplateName == nil {
				continue
			}
			claimName, ok := made[rc.Name]
			switch {
			case ok && claimName == nil:
				continue // not needed: the autoscaler skips it too
			case ok:
				rc.ResourceClaimName, rc.ResourceClaimTemplateName = claimName, nil
				continue
			}
			t := template(p.Namespace, *rc.ResourceClaimTemplateName)
			if t == nil {
				return nil, fmt.Errorf("the ResourceClaimTemplate %s of pod %s", *rc.ResourceClaimTemplateName, p.Name)
			}
			// A pod's claim name is a DNS label (no dot): the dot keeps
			// pod a's claim b-c apart from pod a-b's claim c.
			cl := &resourceapi.ResourceClaim{
				ObjectMeta: demandMeta(demandName("pod-"+p.Name+"."+rc.Name), p.Namespace, labels, owner),
				Spec:       *t.Spec.Spec.DeepCopy(),
			}
			u.claims = append(u.claims, cl)
			rc.ResourceClaimName, rc.ResourceClaimTemplateName = ptr.To(cl.Name), nil
		}
		u.template = &corev1.PodTemplate{
			ObjectMeta: demandMeta(name, p.Namespace, labels, owner),
			Template:   corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: p.Labels}, Spec: *spec},
		}
		u.buffer = demandBuffer(name, p.Namespace, labels, owner)
		units = append(units, u)
	}
	return units, nil
}

// reservationDemand is the demand of a queued reservation waiting for
// devices: one unit per claim still to allocate. Its claims are created
// only when it is held (a claim that existed unallocated would let a pod
// naming it have the scheduler allocate it past the queue), so each unit
// names a standalone demand claim of the claim's spec. The virtual pod
// tolerates every taint: the reservation is planned on any node, whatever
// taints a NodePool puts on its GPU nodes.
func reservationDemand(r *gpudrav1.GpuReservation, claims []*resourceapi.ResourceClaim) []*demandUnit {
	labels := demandItemLabels(demandKindReservation, r.Name)
	owner := metav1.OwnerReference{APIVersion: gpudrav1.APIVersion, Kind: gpudrav1.KindGpuReservation, Name: r.Name, UID: r.UID}
	units := make([]*demandUnit, 0, len(claims))
	for _, c := range claims {
		if c.Status.Allocation != nil {
			continue
		}
		name := demandName("res-" + c.Name)
		cl := &resourceapi.ResourceClaim{ObjectMeta: demandMeta(name, r.Namespace, labels, owner), Spec: *c.Spec.DeepCopy()}
		spec := corev1.PodSpec{
			Containers: []corev1.Container{{Name: "demand", Image: demandPauseImage,
				Resources: corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: "devices"}}}}},
			ResourceClaims: []corev1.PodResourceClaim{{Name: "devices", ResourceClaimName: ptr.To(name)}},
			Tolerations:    []corev1.Toleration{{Operator: corev1.TolerationOpExists}},
		}
		units = append(units, &demandUnit{
			template: &corev1.PodTemplate{ObjectMeta: demandMeta(name, r.Namespace, labels, owner), Template: corev1.PodTemplateSpec{Spec: spec}},
			buffer:   demandBuffer(name, r.Namespace, labels, owner),
			claims:   []*resourceapi.ResourceClaim{cl},
		})
	}
	return units
}

// demandMeta is a demand object's metadata. Owned by the pod or the
// reservation (not as its controller: the claim controller reads a claim's
// controller), garbage collection removes it with them, whoever leads.
func demandMeta(name, namespace string, labels map[string]string, owner metav1.OwnerReference) metav1.ObjectMeta {
	l := make(map[string]string, len(labels))
	for k, v := range labels {
		l[k] = v
	}
	return metav1.ObjectMeta{Name: name, Namespace: namespace, Labels: l, OwnerReferences: []metav1.OwnerReference{owner}}
}

// demandBuffer is a CapacityBuffer of one replica of the PodTemplate of
// the same name. Its status is the autoscaler's: its buffer controller
// resolves the template and sets ReadyForProvisioning and replicas.
func demandBuffer(name, namespace string, labels map[string]string, owner metav1.OwnerReference) *unstructured.Unstructured {
	meta := demandMeta(name, namespace, labels, owner)
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": CapacityBuffers.GroupVersion().String(),
		"kind":       "CapacityBuffer",
		"spec": map[string]any{
			"provisioningStrategy": ActiveProvisioningStrategy,
			"podTemplateRef":       map[string]any{"name": name},
			"replicas":             int64(1),
		},
	}}
	u.SetName(meta.Name)
	u.SetNamespace(meta.Namespace)
	u.SetLabels(meta.Labels)
	u.SetOwnerReferences(meta.OwnerReferences)
	return u
}

// wantedDemand is the demand of the round's items that wait for devices,
// by object (demandKey of each template, buffer and claim). An item whose
// demand cannot be built (a claim template gone) is left out and named in
// the errors.
func wantedDemand(items []*item, template func(namespace, name string) *resourceapi.ResourceClaimTemplate) (map[string]*demandUnit, []error) {
	out := map[string]*demandUnit{}
	var errs []error
	for _, it := range items {
		var units []*demandUnit
		switch it.kind {
		case KindGang:
			var err error
			if units, err = gangDemand(it.gang, template); err != nil {
				errs = append(errs, fmt.Errorf("demand of %s: %w", it.Key, err))
				continue
			}
		case KindReservation:
			units = reservationDemand(it.res, it.claims)
		}
		for _, u := range units {
			out[objectKey(resourcePodTemplates, u.template.Namespace, u.template.Name)] = u
		}
	}
	return out, errs
}

// Resources of the demand objects, in objectKey.
const (
	resourcePodTemplates    = "podtemplates"
	resourceCapacityBuffers = "capacitybuffers"
	resourceClaims          = "resourceclaims"
)

// objectKey names one demand object: resource, namespace and name.
func objectKey(resource, namespace, name string) string {
	return resource + "/" + namespace + "/" + name
}

// demandObject is a demand object that exists, as the informers show it.
type demandObject struct {
	resource, namespace, name string
	uid                       types.UID
	owner                     types.UID
	labels                    map[string]string
}

// demandChanges compares the demand objects that exist with those wanted:
// those to delete (not wanted, or wanted for another owner: a pod or
// reservation made again under its name) and the units with something to
// create. Pure.
func demandChanges(existing []demandObject, wanted map[string]*demandUnit) (remove []demandObject, create []*demandUnit) {
	want := map[string]types.UID{}
	for _, u := range wanted {
		owner := u.template.OwnerReferences[0].UID
		want[objectKey(resourcePodTemplates, u.template.Namespace, u.template.Name)] = owner
		want[objectKey(resourceCapacityBuffers, u.buffer.GetNamespace(), u.buffer.GetName())] = owner
		for _, c := range u.claims {
			want[objectKey(resourceClaims, c.Namespace, c.Name)] = owner
		}
	}
	have := map[string]bool{}
	for _, o := range existing {
		k := objectKey(o.resource, o.namespace, o.name)
		if owner, ok := want[k]; ok && owner == o.owner {
			have[k] = true
			continue
		}
		remove = append(remove, o)
	}
	for _, k := range sortedKeys(wanted) {
		u := wanted[k]
		missing := !have[objectKey(resourcePodTemplates, u.template.Namespace, u.template.Name)] ||
			!have[objectKey(resourceCapacityBuffers, u.buffer.GetNamespace(), u.buffer.GetName())]
		for _, c := range u.claims {
			missing = missing || !have[objectKey(resourceClaims, c.Namespace, c.Name)]
		}
		if missing {
			create = append(create, u)
		}
	}
	return remove, create
}
