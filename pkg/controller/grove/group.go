package grove

import (
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// Labels Grove puts on the ResourceClaims it creates for resourceSharing
// (github.com/ai-dynamo/grove operator/api/common/labels.go). The level of a
// claim is told by which of the per-level keys is present, its scope by the
// index key: the claim's name alone is ambiguous ("-all-" can be part of a
// user's name).
const (
	LabelManagedBy = "app.kubernetes.io/managed-by"
	LabelComponent = "app.kubernetes.io/component"
	LabelPartOf    = "app.kubernetes.io/part-of"

	ManagedByGrove         = "grove-operator"
	ComponentResourceClaim = "resource-claim"

	LabelPodCliqueSetReplica = "grove.io/podcliqueset-replica-index"
	LabelScalingGroup        = "grove.io/podcliquescalinggroup"
	LabelScalingGroupReplica = "grove.io/podcliquescalinggroup-replica-index"
	LabelPodClique           = "grove.io/podclique"
	LabelPodCliquePodIndex   = "grove.io/podclique-pod-index"

	// GroveAPIGroup is the API group of the owners of Grove's claims.
	GroveAPIGroup = "grove.io"
)

// Level is the Grove object whose resourceSharing made the claim; the
// values are the owners' kinds.
type Level string

const (
	LevelPodCliqueSet Level = "PodCliqueSet"
	LevelScalingGroup Level = "PodCliqueScalingGroup"
	LevelPodClique    Level = "PodClique"
)

// Scope is Grove's ResourceSharingScope: one claim for all replicas of the
// owner, or one per replica (per pod at the PodClique level).
type Scope string

const (
	ScopeAllReplicas Scope = "AllReplicas"
	ScopePerReplica  Scope = "PerReplica"
)

// Group is one Grove sharing group: a claim Grove made and the pods that
// reference it. It is what Analyze returns, what the controller reports
// from, and what `gpudra groups -o json|yaml` prints.
type Group struct {
	Namespace string    `json:"namespace"`
	Claim     string    `json:"claim"`
	ClaimUID  types.UID `json:"claimUID,omitempty"`
	Level     Level     `json:"level"`
	Scope     Scope     `json:"scope"`
	// PodCliqueSet is the set the claim belongs to (label part-of).
	PodCliqueSet string `json:"podCliqueSet,omitempty"`
	// Replica is the replica (the pod index at the PodClique level) of a
	// PerReplica claim.
	Replica *int `json:"replica,omitempty"`
	// Owner is the claim's controller owner, a grove.io object.
	Owner *Owner `json:"owner,omitempty"`
	// Allocated: the scheduler allocated the claim.
	Allocated bool `json:"allocated"`
	// Node is the node the allocation is bound to; empty when it is not
	// allocated, not node-local, or no known node matches.
	Node string `json:"node,omitempty"`
	// Devices are the allocated devices of this driver.
	Devices []Device `json:"devices,omitempty"`
	// Sharing is the claim's sharing config for this driver, defaulted;
	// nil when it does not decode.
	Sharing   *gpuapi.Sharing `json:"sharing,omitempty"`
	Consumers []Consumer      `json:"consumers"`
	// ReservedFor counts the claim's status.reservedFor entries.
	ReservedFor int       `json:"reservedFor"`
	Problems    []Problem `json:"problems,omitempty"`
}

// Owner names the claim's Grove owner.
type Owner struct {
	APIVersion string    `json:"apiVersion"`
	Kind       string    `json:"kind"`
	Name       string    `json:"name"`
	UID        types.UID `json:"uid,omitempty"`
}

// Device is one allocated device; UUID is filled by callers that know it
// (the CLI reads it from the ResourceSlices).
type Device struct {
	Request string `json:"request"`
	Pool    string `json:"pool"`
	Device  string `json:"device"`
	UUID    string `json:"uuid,omitempty"`
}

// Consumer is a pod that references the claim.
type Consumer struct {
	Name     string          `json:"name"`
	UID      types.UID       `json:"uid,omitempty"`
	Node     string          `json:"node,omitempty"`
	Phase    corev1.PodPhase `json:"phase,omitempty"`
	Reserved bool            `json:"reserved"`
}

// Problem is one reason the group cannot work as meant. Reason is stable
// (it is the Event's reason and a metric label); Message names the pods,
// nodes and fields involved.
type Problem struct {
	Reason  string `json:"reason"`
	Message string `json:"message"`
	// Pods are the consumers concerned, if the problem is about some.
	Pods []string `json:"pods,omitempty"`
}

// identity is what makes a problem "the same" as one reported before: the
// pods concerned, not the wording (a scheduler message changes with every
// attempt), or the message when no pods are concerned.
func (p Problem) identity() string {
	if len(p.Pods) > 0 {
		return p.Reason + "\x00" + strings.Join(p.Pods, ",")
	}
	return p.Reason + "\x00" + p.Message
}

// SharingMode is how the group's devices are shared, for a column:
// the strategy, "+IPC" when consumers share an IPC directory.
func (g *Group) SharingMode() string {
	if g.Sharing == nil {
		return "<invalid>"
	}
	s := string(g.Sharing.Strategy)
	if g.Sharing.IPC {
		s += "+IPC"
	}
	return s
}

// IsGroveClaim says whether Grove made the claim for resourceSharing.
func IsGroveClaim(claim *resourceapi.ResourceClaim) bool {
	return claim.Labels[LabelManagedBy] == ManagedByGrove && claim.Labels[LabelComponent] == ComponentResourceClaim
}

// IsOurs says whether the claim is gpudra's: its allocation has a device of
// our driver, or, not allocated yet, one of its requests asks for a
// DeviceClass of ours (named *.gpudra.dev, as every class the chart ships)
// or it carries opaque config for our driver. DeviceClasses are not read:
// a class of another name that selects our devices is found once the
// claim is allocated.
func IsOurs(claim *resourceapi.ResourceClaim) bool {
	if a := claim.Status.Allocation; a != nil {
		for _, r := range a.Devices.Results {
			if r.Driver == slicebuilder.DriverName {
				return true
			}
		}
		return false
	}
	for _, r := range claim.Spec.Devices.Requests {
		if r.Exactly != nil && ourClass(r.Exactly.DeviceClassName) {
			return true
		}
		for _, s := range r.FirstAvailable {
			if ourClass(s.DeviceClassName) {
				return true
			}
		}
	}
	for _, c := range claim.Spec.Devices.Config {
		if c.Opaque != nil && c.Opaque.Driver == slicebuilder.DriverName {
			return true
		}
	}
	return false
}

func ourClass(name string) bool {
	return name == slicebuilder.DriverName || strings.HasSuffix(name, ".gpudra.dev")
}

// describe fills what the claim's labels and owner say about the group.
func describe(claim *resourceapi.ResourceClaim) Group {
	g := Group{
		Namespace:    claim.Namespace,
		Claim:        claim.Name,
		ClaimUID:     claim.UID,
		Level:        LevelPodCliqueSet,
		Scope:        ScopeAllReplicas,
		PodCliqueSet: claim.Labels[LabelPartOf],
		Consumers:    []Consumer{},
		ReservedFor:  len(claim.Status.ReservedFor),
	}
	indexKey := LabelPodCliqueSetReplica
	switch {
	case claim.Labels[LabelPodClique] != "":
		g.Level, indexKey = LevelPodClique, LabelPodCliquePodIndex
	case claim.Labels[LabelScalingGroup] != "":
		g.Level, indexKey = LevelScalingGroup, LabelScalingGroupReplica
	}
	if v, ok := claim.Labels[indexKey]; ok {
		g.Scope = ScopePerReplica
		if i, err := strconv.Atoi(v); err == nil {
			g.Replica = &i
		}
	}
	if ref := metav1.GetControllerOfNoCopy(claim); ref != nil && strings.HasPrefix(ref.APIVersion, GroveAPIGroup+"/") {
		g.Owner = &Owner{APIVersion: ref.APIVersion, Kind: ref.Kind, Name: ref.Name, UID: ref.UID}
	}
	return g
}

// References says whether the pod uses the claim by name, as Grove injects
// it (resourceClaimName, not a template).
func References(pod *corev1.Pod, claim string) bool {
	return podClaimEntry(pod, claim) != ""
}

// podClaimEntry is the name of the pod's resourceClaims entry for the claim.
func podClaimEntry(pod *corev1.Pod, claim string) string {
	for _, rc := range pod.Spec.ResourceClaims {
		if rc.ResourceClaimName != nil && *rc.ResourceClaimName == claim {
			return rc.Name
		}
	}
	return ""
}
