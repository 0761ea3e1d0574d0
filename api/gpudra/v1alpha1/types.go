// Package v1alpha1 holds gpudra's custom resources, group gpudra.dev,
// version v1alpha1: GpuReservation (GPUs held ahead of time for a planned
// scale-up) and GpuQueue (how waiting reservations and gangs are ordered).
// The CRDs in crds/ (copied into the chart) are written to match these
// types; crds_test.go checks that they do.
package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// Group and version of the CRDs.
const (
	GroupName  = "gpudra.dev"
	Version    = "v1alpha1"
	APIVersion = GroupName + "/" + Version

	KindGpuReservation = "GpuReservation"
	KindGpuQueue       = "GpuQueue"
)

// The resources, for dynamic clients and RBAC.
var (
	SchemeGroupVersion = schema.GroupVersion{Group: GroupName, Version: Version}
	GpuReservations    = SchemeGroupVersion.WithResource("gpureservations")
	GpuQueues          = SchemeGroupVersion.WithResource("gpuqueues")
)

// Labels and annotations that gpudra reads on pods and writes on the claims
// it holds.
const (
	// LabelGang names the gang a plain pod belongs to (in the style of
	// Kueue's pod groups); the gang is the pods of one namespace with the
	// same value.
	LabelGang = GroupName + "/gang"
	// AnnotationGangSize is how many pods the gang has: its devices are
	// planned once that many pods (and their claims) exist.
	AnnotationGangSize = GroupName + "/gang-size"
	// AnnotationQueue names the GpuQueue a gang waits in (default
	// DefaultQueue); on pods, read from the gang's first pod.
	AnnotationQueue = GroupName + "/queue"
	// LabelKueueQueue is Kueue's label naming the LocalQueue of a job
	// (and of a pod): a gang whose pods carry it is Kueue's to admit and
	// waits in no GpuQueue; gpudra only places it (docs/queues.md).
	LabelKueueQueue = "kueue.x-k8s.io/queue-name"
	// AnnotationDuration declares how long a gang will run, a Go duration
	// ("30m"); the ShortestJobFirst policy orders by it.
	AnnotationDuration = GroupName + "/duration"
	// SchedulingGate is the gate the admission webhook adds to a gang's
	// pods at creation; the controller lifts it once the gang's devices
	// are allocated.
	SchedulingGate = GroupName + "/gang"
	// LabelReservation is set on the ResourceClaims that hold a
	// reservation's devices.
	LabelReservation = GroupName + "/reservation"
	// AnnotationAllocatedFor and AnnotationAllocatedAt are set by the
	// controller on every claim whose allocation it writes, before the
	// allocation: the item it was planned for ("Gang/<namespace>/<name>" or
	// "GpuReservation/<namespace>/<name>") and the allocation's timestamp
	// (RFC 3339, status.allocation.allocationTimestamp to the second). They
	// are the controller's memory of its writes, in the API, so that a new
	// leader knows them: an allocation whose timestamp differs is not the
	// one the annotations speak of (cleared, or written by kube-scheduler
	// since).
	AnnotationAllocatedFor = GroupName + "/allocated-for"
	AnnotationAllocatedAt  = GroupName + "/allocated-at"
)

// DefaultQueue is the queue of reservations and gangs that name none. It
// need not exist as an object: absent, it is FCFS.
const DefaultQueue = "default"

// GpuReservation holds devices for a planned scale-up: the controller plans
// them (all or nothing, NVLink-aware) and holds them as ResourceClaims that
// it creates and allocates itself, named <reservation>-<index>, owned by the
// reservation and reserved for no pod. A pod consumes held devices by naming
// such a claim in spec.resourceClaims[].resourceClaimName; it lands on the
// claim's node.
type GpuReservation struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   GpuReservationSpec   `json:"spec"`
	Status GpuReservationStatus `json:"status,omitempty"`
}

// GpuReservationSpec says what to hold, for how long and in which queue.
// It is immutable once created (the webhook refuses changes): a different
// reservation is a new object.
type GpuReservationSpec struct {
	// DeviceClassName is the class of the held devices (for example
	// gpu.gpudra.dev for whole GPUs).
	DeviceClassName string `json:"deviceClassName"`
	// Claims is how many ResourceClaims hold the devices (each lives on one
	// node); default 1.
	Claims int32 `json:"claims,omitempty"`
	// Count is the number of devices each claim holds; default 1.
	Count int64 `json:"count,omitempty"`
	// Selectors are CEL expressions every held device must satisfy, as in
	// a ResourceClaim's device request.
	Selectors []string `json:"selectors,omitempty"`
	// SameNVLinkDomain requires every held device, across all claims, to
	// be in one NVLink domain. Without it the planner still packs the
	// devices into as few domains as it can.
	SameNVLinkDomain bool `json:"sameNVLinkDomain,omitempty"`
	// TTL is how long held devices stay held from the moment they are
	// held; claims no pod uses by then are released. Required.
	TTL metav1.Duration `json:"ttl"`
	// Priority orders reservations in a queue with the Priority policy
	// (higher first).
	Priority int32 `json:"priority,omitempty"`
	// Queue is the GpuQueue it waits in; default "default".
	Queue string `json:"queue,omitempty"`
	// Duration is how long the work that consumes it is expected to run;
	// the ShortestJobFirst policy orders by it (absent: last).
	Duration *metav1.Duration `json:"duration,omitempty"`
}

// ReservationPhase is where a reservation is in its life.
type ReservationPhase string

const (
	// ReservationQueued: waiting in its queue; Reason says why.
	ReservationQueued ReservationPhase = "Queued"
	// ReservationHeld: its claims are allocated and no pod uses them yet.
	ReservationHeld ReservationPhase = "Held"
	// ReservationConsumed: at least one pod uses one of its claims.
	ReservationConsumed ReservationPhase = "Consumed"
	// ReservationExpired: the TTL passed; unused claims were released.
	ReservationExpired ReservationPhase = "Expired"
	// ReservationFailed: it can never be held as asked (Reason says why);
	// it is not retried.
	ReservationFailed ReservationPhase = "Failed"
)

// Reasons in status.reason.
const (
	// ReasonWaitingForDevices: it would fit on the cluster's devices but
	// not on the free ones now.
	ReasonWaitingForDevices = "WaitingForDevices"
	// ReasonBehindInQueue: an item ahead of it in its queue waits too.
	ReasonBehindInQueue = "BehindInQueue"
	// ReasonUnsatisfiable: it would not fit even on an empty cluster.
	ReasonUnsatisfiable = "Unsatisfiable"
	// ReasonInvalid: the spec cannot be turned into claims.
	ReasonInvalid = "Invalid"
	// ReasonAllocated: held.
	ReasonAllocated = "Allocated"
	// ReasonTTLExpired: released at its TTL.
	ReasonTTLExpired = "TTLExpired"
)

// GpuReservationStatus is written by the controller only.
type GpuReservationStatus struct {
	// Phase: Queued, Held, Consumed, Expired or Failed.
	Phase ReservationPhase `json:"phase,omitempty"`
	// Reason is a CamelCase word for the phase (the constants above);
	// Message says it for a person: what is missing, for how many devices.
	Reason  string `json:"reason,omitempty"`
	Message string `json:"message,omitempty"`
	// QueuePosition is its place among the waiting items of its queue,
	// from 1; 0 when not waiting.
	QueuePosition int32 `json:"queuePosition,omitempty"`
	// Claims are the held claims.
	Claims []HeldClaim `json:"claims,omitempty"`
	// Devices is the number of devices held.
	Devices int32 `json:"devices,omitempty"`
	// Nodes and NVLinkDomains of the held devices, sorted.
	Nodes         []string `json:"nodes,omitempty"`
	NVLinkDomains []string `json:"nvlinkDomains,omitempty"`
	// QueuedAt is when it started waiting; HeldAt when its devices were
	// allocated; ExpiresAt is HeldAt plus the TTL.
	QueuedAt  *metav1.Time `json:"queuedAt,omitempty"`
	HeldAt    *metav1.Time `json:"heldAt,omitempty"`
	ExpiresAt *metav1.Time `json:"expiresAt,omitempty"`
	// ObservedGeneration is the generation the status describes.
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
}

// HeldClaim is one claim holding a reservation's devices.
type HeldClaim struct {
	// Name of the ResourceClaim, in the reservation's namespace.
	Name string `json:"name"`
	// Node its devices are on.
	Node string `json:"node"`
	// Devices are the allocated devices, as <pool>/<device>.
	Devices []string `json:"devices,omitempty"`
	// InUse: a pod has it reserved.
	InUse bool `json:"inUse,omitempty"`
}

// GpuReservationList is a list of GpuReservations.
type GpuReservationList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []GpuReservation `json:"items"`
}

// QueuePolicy orders a queue's waiting items.
type QueuePolicy string

const (
	// FCFS: first come, first served (by the time it started waiting).
	FCFS QueuePolicy = "FCFS"
	// Priority: higher priority first; a waiting item gains AgingPerMinute
	// points each minute so that low priority does not starve.
	Priority QueuePolicy = "Priority"
	// FairShare: the namespace with the fewest held devices for its share
	// first (held devices divided by the namespace's share weight).
	FairShare QueuePolicy = "FairShare"
	// ShortestJobFirst: the shortest declared duration first; items that
	// declare none go last.
	ShortestJobFirst QueuePolicy = "ShortestJobFirst"
)

// GpuQueue (cluster-scoped) sets the ordering policy of the queue of its
// name. Items are planned strictly in queue order: an item that would fit
// on the cluster but not on the free devices now holds back the items
// behind it, so that small items do not starve big ones; an item that could
// never fit is marked and does not hold anything back.
type GpuQueue struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   GpuQueueSpec   `json:"spec"`
	Status GpuQueueStatus `json:"status,omitempty"`
}

// GpuQueueSpec is a queue's policy.
type GpuQueueSpec struct {
	// Policy: FCFS (default), Priority, FairShare or ShortestJobFirst.
	Policy QueuePolicy `json:"policy,omitempty"`
	// AgingPerMinute is the priority a waiting item gains per minute
	// waited (Priority policy); absent: 1; 0 turns aging off.
	AgingPerMinute *int32 `json:"agingPerMinute,omitempty"`
	// Shares are the namespaces' share weights (FairShare policy);
	// namespaces not listed have DefaultShare.
	Shares map[string]int32 `json:"shares,omitempty"`
	// DefaultShare is the weight of namespaces not in Shares; default 1.
	DefaultShare int32 `json:"defaultShare,omitempty"`
}

// GpuQueueStatus is written by the controller only.
type GpuQueueStatus struct {
	// Waiting is the number of items waiting.
	Waiting int32 `json:"waiting,omitempty"`
	// WaitingDevices is the number of devices they ask for.
	WaitingDevices int64 `json:"waitingDevices,omitempty"`
	// Head names the item at the head of the queue
	// (<kind>/<namespace>/<name>) and HeadReason why it waits.
	Head       string `json:"head,omitempty"`
	HeadReason string `json:"headReason,omitempty"`
}

// GpuQueueList is a list of GpuQueues.
type GpuQueueList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []GpuQueue `json:"items"`
}
