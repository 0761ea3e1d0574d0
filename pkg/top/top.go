// Package top is gpudra top: a view of one node's GPUs and MIG devices,
// who holds each and what runs on it, read either from a kubelet plugin's
// /metrics (FromMetrics) or from this machine directly, through the GPU
// backend's telemetry and gpudra local's state (FromMachine). Both give a
// Snapshot; Table and JSON render one. Everything here is a pure function
// of what was read, so that the command only reads, renders and sleeps.
//
// A reading that could not be told is nil (JSON: absent; table: "-"),
// never 0: an idle GPU and a GPU whose utilization NVML did not give must
// not look alike.
package top

import "time"

// Snapshot is one refresh of one node.
type Snapshot struct {
	// Node is the node's name ("" when the source does not say).
	Node string `json:"node,omitempty"`
	// Source is where it was read: the endpoint's URL, or "nvml" / "sim".
	Source string    `json:"source"`
	At     time.Time `json:"at"`
	// Devices are the node's GPUs, each followed by its MIG devices, in
	// device name order.
	Devices []Device `json:"devices"`
	// Waiting are gpudra local's requests waiting for devices (local mode
	// only).
	Waiting []LocalWaiter `json:"waiting,omitempty"`
	// Notes say what could not be read (attribution off, the local state
	// unreadable, processes whose container could not be told).
	Notes []string `json:"notes,omitempty"`
}

// Device is one GPU or MIG device.
type Device struct {
	// Name is the device's name in the node's pool (gpu-0,
	// gpu-0-mig-1g-10gb-6).
	Name string `json:"name"`
	// UUID is the GPU's; for a MIG device its own, where known.
	UUID string `json:"uuid,omitempty"`
	// GPU is a MIG device's parent GPU's UUID.
	GPU     string `json:"gpu,omitempty"`
	Profile string `json:"profile,omitempty"`
	Model   string `json:"model,omitempty"`
	// Free is whether no claim holds the device; nil: not known (device
	// plugin mode, or a source without claims).
	Free *bool `json:"free,omitempty"`
	// Holders are the claims (DRA mode) or the local allocations on it.
	Holders []Holder `json:"holders,omitempty"`

	// Utilization is the GPU's (fraction of time a kernel ran); SMActive
	// the GPM SM activity (GPUs and MIG devices, where GPM reads).
	Utilization *float64 `json:"utilization,omitempty"`
	SMActive    *float64 `json:"smActive,omitempty"`
	// Memory is framebuffer memory, bytes.
	MemoryUsedBytes  *float64 `json:"memoryUsedBytes,omitempty"`
	MemoryTotalBytes *float64 `json:"memoryTotalBytes,omitempty"`
	PowerWatts       *float64 `json:"powerWatts,omitempty"`
	TemperatureC     *float64 `json:"temperatureCelsius,omitempty"`

	// ProcessesRead says whether Processes is the whole list: false means
	// nothing can be said about what runs on it.
	ProcessesRead bool      `json:"processesRead"`
	Processes     []Process `json:"processes,omitempty"`
}

// Holder is one claim or local allocation on a device.
type Holder struct {
	// Claim is "namespace/name" of a ResourceClaim (DRA mode).
	Claim string `json:"claim,omitempty"`
	// Pods are the "namespace/pod/container"s the kubelet lists on the
	// device for it.
	Pods []string `json:"pods,omitempty"`
	// Local is a gpudra local allocation's name, User who holds it.
	Local string `json:"local,omitempty"`
	User  string `json:"user,omitempty"`
	PID   int    `json:"pid,omitempty"`
}

// Process is what runs on a device: one process (read from the machine),
// or one container's processes summed (read from an endpoint, which
// exports them per container), or those in no container that holds the
// device (Unattributed).
type Process struct {
	// PID is the process's (0 for a container's sum).
	PID int `json:"pid,omitempty"`
	// User owns /proc/<pid> ("" when it could not be read).
	User string `json:"user,omitempty"`
	// Container is "namespace/pod/container" of a container's sum.
	Container string `json:"container,omitempty"`
	// Unattributed: processes in no container that holds the device.
	Unattributed bool `json:"unattributed,omitempty"`
	// Count is how many processes a sum is of.
	Count         *float64 `json:"count,omitempty"`
	MemoryBytes   *float64 `json:"memoryBytes,omitempty"`
	SMUtilization *float64 `json:"smUtilization,omitempty"`
}

// LocalWaiter is a gpudra local request that waits.
type LocalWaiter struct {
	Name     string    `json:"name"`
	User     string    `json:"user"`
	QueuedAt time.Time `json:"queuedAt"`
	Error    string    `json:"error,omitempty"`
}

func ptr(v float64) *float64 { return &v }
