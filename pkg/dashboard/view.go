// Package dashboard is gpudra dashboard: a read-only web page of the fleet
// (nodes by NVLink domain, each GPU with its MIG layout and its holders),
// the devices' live usage, the queues and the allocation over time, for a
// cluster (informers on the user's own credentials) or for one machine
// (gpudra local's state and the GPU backend).
//
// The server does the work and the page only draws: a Source keeps the
// latest View, rebuilt by a pure function (Build, BuildLocal) after each
// change, debounced; the Server encodes and gzips each revision once,
// whatever the number of viewers, and tells the viewers of a new revision
// by server-sent events. The page fetches the View and renders only the
// rows in view, so that 1,000 nodes of 8 GPUs stay usable.
package dashboard

import "time"

// View is everything the page shows, at one revision. It is the JSON of
// GET /api/view. A value the source could not tell is absent (nil), never
// 0: an idle GPU and a GPU whose utilization was not read must not look
// alike.
type View struct {
	// Revision grows by one for every rebuilt View (SSE sends it).
	Revision uint64    `json:"revision"`
	At       time.Time `json:"at"`
	// Mode is "cluster" or "local".
	Mode string `json:"mode"`
	// Context names what is shown: the kubeconfig context and user, or the
	// machine's host name in local mode.
	Context string  `json:"context,omitempty"`
	Summary Summary `json:"summary"`
	// Domains are the nodes grouped by NVLink domain, in name order; nodes
	// whose GPUs are in no domain come last, in a Domain with Name "".
	Domains []Domain `json:"domains"`
	// Queues are the GpuQueues (and the queues named by waiting items that
	// have no GpuQueue object), in name order; local mode has one.
	Queues []Queue `json:"queues"`
	// Workloads are Ray clusters, RayJobs and Kueue's workloads with their
	// pods and claims, where those APIs are served and readable (none in
	// local mode), by namespace and name.
	Workloads []Workload `json:"workloads,omitempty"`
	// Allocation is the devices allocated and used per namespace (local:
	// per user) over time, oldest first.
	Allocation Allocation `json:"allocation"`
	// Filters are the values the page offers in its filter menus.
	Filters Filters `json:"filters"`
	// Notes say what could not be read and what that hides: "ResourceSlices:
	// forbidden (you see only the devices of your claims)", "usage:
	// pods/proxy forbidden in namespace gpudra". Never silently absent.
	Notes []string `json:"notes,omitempty"`
}

// Summary counts devices at a glance.
type Summary struct {
	Nodes int `json:"nodes"`
	// GPUs are physical GPUs; Allocated those with any claim (or local
	// allocation) on the GPU or on one of its MIG devices.
	GPUs      int `json:"gpus"`
	Allocated int `json:"allocated"`
	Free      int `json:"free"`
	Unhealthy int `json:"unhealthy"`
	// Unknown are GPUs whose claims the viewer cannot all read
	// (StateUnknown).
	Unknown     int `json:"unknown,omitempty"`
	IdleClaimed int `json:"idleClaimed"`
	// Waiting are the queued gangs, reservations and local waiters.
	Waiting int `json:"waiting"`
}

// Domain is one NVLink domain (clique) and its nodes.
type Domain struct {
	Name  string `json:"name"`
	Nodes []Node `json:"nodes"`
}

// Node is one node (or the machine, in local mode).
type Node struct {
	Name string `json:"name"`
	// Mode is "dra" or "device-plugin" where known.
	Mode string `json:"mode,omitempty"`
	GPUs []GPU  `json:"gpus"`
	// UsageSource says where the usage figures come from ("plugin",
	// "prometheus", "nvml", "sim"); "" when none was read for this node.
	UsageSource string `json:"usageSource,omitempty"`
	// Kubectl shows the node's devices.
	Kubectl string `json:"kubectl,omitempty"`
}

// Device states.
const (
	StateFree      = "free"
	StateAllocated = "allocated"
	// StatePartial: a GPU in MIG mode with some MIG devices allocated.
	StatePartial = "partial"
	// StateBlocked: a MIG placement that overlaps an allocated one, or a
	// whole GPU whose MIG devices are allocated.
	StateBlocked   = "blocked"
	StateUnhealthy = "unhealthy"
	// StateUnknown: no holder the viewer can see, but the claims of some
	// namespaces were not read (forbidden, or --namespace): the device may
	// be free or held by a claim the viewer cannot read. Never "free".
	StateUnknown = "unknown"
)

// GPU is one physical GPU: a card on the page.
type GPU struct {
	// Name is the device's name in the node's pool (gpu-0).
	Name        string `json:"name"`
	UUID        string `json:"uuid,omitempty"`
	Model       string `json:"model,omitempty"`
	MemoryBytes int64  `json:"memoryBytes,omitempty"`
	// State is one of the State constants.
	State string `json:"state"`
	// Health is "" when healthy, else why not (a taint's key and value, an
	// XID).
	Health string `json:"health,omitempty"`
	// Classes are the DeviceClasses the GPU's devices belong to, where the
	// source tells (cluster: the classes whose driver publishes it).
	Classes []string `json:"classes,omitempty"`
	// MIG is whether the GPU is in MIG mode; MemorySlices its memory slices
	// (8 on an H100) and Placements its MIG devices on them.
	MIG          bool        `json:"mig,omitempty"`
	MemorySlices int         `json:"memorySlices,omitempty"`
	Placements   []Placement `json:"placements,omitempty"`
	// Holders hold the whole GPU (or a share of it).
	Holders []Holder `json:"holders,omitempty"`
	Usage   *Usage   `json:"usage,omitempty"`
	// IdleClaimed: allocated and its usage read, with no kernel running
	// (utilization 0) for the whole window the source can tell.
	IdleClaimed bool `json:"idleClaimed,omitempty"`
}

// Placement is one MIG device: a profile on memory slices [Start,
// Start+Size).
type Placement struct {
	Name    string `json:"name"`
	Profile string `json:"profile"`
	Start   int    `json:"start"`
	Size    int    `json:"size"`
	// State is free, allocated or blocked (overlaps an allocated one).
	State   string   `json:"state"`
	Holders []Holder `json:"holders,omitempty"`
	Usage   *Usage   `json:"usage,omitempty"`
}

// Holder is who holds a device: a claim and its pods, or a local
// allocation and its user.
type Holder struct {
	// Namespace and Claim name a ResourceClaim (cluster mode).
	Namespace string `json:"namespace,omitempty"`
	Claim     string `json:"claim,omitempty"`
	// Pods are the pods the claim is reserved for, by name (same namespace).
	Pods []string `json:"pods,omitempty"`
	// Reservation names the GpuReservation holding the claim, Gang the
	// gang of its pods.
	Reservation string `json:"reservation,omitempty"`
	Gang        string `json:"gang,omitempty"`
	// Shared: the claim's devices are shared (time-slicing, MPS, a
	// fractional device, admin access).
	Shared bool `json:"shared,omitempty"`
	// Local and User name a gpudra local allocation and who holds it; PID
	// its holder process.
	Local string `json:"local,omitempty"`
	User  string `json:"user,omitempty"`
	PID   int    `json:"pid,omitempty"`
	// Kubectl shows the claim.
	Kubectl string `json:"kubectl,omitempty"`
}

// Usage is a device's live usage. Absent fields were not read.
type Usage struct {
	Utilization      *float64 `json:"utilization,omitempty"`
	SMActive         *float64 `json:"smActive,omitempty"`
	MemoryUsedBytes  *float64 `json:"memoryUsedBytes,omitempty"`
	MemoryTotalBytes *float64 `json:"memoryTotalBytes,omitempty"`
	PowerWatts       *float64 `json:"powerWatts,omitempty"`
	// Spark is the utilization of the last minutes, oldest first, one
	// point per usage read (at most SparkPoints); a point not read is null.
	Spark []*float64 `json:"spark,omitempty"`
}

// SparkPoints is the length of a sparkline.
const SparkPoints = 30

// Queue is one queue and its waiting items, in queue order.
type Queue struct {
	Name string `json:"name"`
	// Policy is the GpuQueue's (FCFS when it has none).
	Policy string `json:"policy"`
	// Exists is false for a queue named by items with no GpuQueue object.
	Exists bool        `json:"exists"`
	Items  []QueueItem `json:"items"`
	// Kubectl shows the queue.
	Kubectl string `json:"kubectl,omitempty"`
}

// QueueItem is one waiting (or, in local mode, holding) gang, reservation,
// pending pod or local request.
type QueueItem struct {
	// Kind is "Gang", "GpuReservation", "Pod" (a pending pod with claims,
	// in no gang) or "Local".
	Kind      string `json:"kind"`
	Namespace string `json:"namespace,omitempty"`
	Name      string `json:"name"`
	// User is a local request's.
	User string `json:"user,omitempty"`
	// Position is 1 for the head; 0 when the source gives none.
	Position int `json:"position,omitempty"`
	// Holding: a local allocation that holds its devices (local mode);
	// waiting items are not holding.
	Holding bool `json:"holding,omitempty"`
	// Reason and Message say why it waits: the gpudra condition's, a
	// reservation's status, or the scheduler's for a pending pod.
	Reason  string `json:"reason,omitempty"`
	Message string `json:"message,omitempty"`
	// Devices is how many devices it asks for, where known.
	Devices int64 `json:"devices,omitempty"`
	// Since is when it started to wait (or to hold).
	Since *time.Time `json:"since,omitempty"`
	// Duration is what it declared (gpudra.dev/duration, spec.duration).
	Duration string `json:"duration,omitempty"`
	// EstimatedStart is when it would start if everything ahead of it ran
	// for its declared duration, one after another from now; absent when
	// anything ahead declares none.
	EstimatedStart *time.Time `json:"estimatedStart,omitempty"`
	Kubectl        string     `json:"kubectl,omitempty"`
}

// Allocation is the devices allocated and used per owner over time.
type Allocation struct {
	// Source is "prometheus" or "seen" (what this server saw since it
	// started).
	Source string `json:"source"`
	// Step is the time between points.
	StepSeconds int `json:"stepSeconds"`
	// Series are per namespace (cluster) or per user (local), in name
	// order.
	Series []AllocationSeries `json:"series"`
}

// AllocationSeries is one owner's devices over time.
type AllocationSeries struct {
	Owner string `json:"owner"`
	// Points are oldest first.
	Points []AllocationPoint `json:"points"`
}

// AllocationPoint is one time: devices allocated and, where usage was
// read, how many of them were in use (utilization above 0).
type AllocationPoint struct {
	At        time.Time `json:"at"`
	Allocated float64   `json:"allocated"`
	Used      *float64  `json:"used,omitempty"`
}

// Filters are the values of the page's filter menus.
type Filters struct {
	Nodes      []string `json:"nodes,omitempty"`
	Classes    []string `json:"classes,omitempty"`
	Namespaces []string `json:"namespaces,omitempty"`
	States     []string `json:"states"`
}
