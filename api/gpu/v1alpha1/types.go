// Package v1alpha1 is gpudra's opaque per-claim device configuration,
// apiVersion gpu.gpudra.dev/v1alpha1, kind GpuConfig. The kubelet plugin
// decodes it strictly at prepare (and the admission webhook, later, at
// admission): unknown fields, wrong kinds and impossible values are errors
// that name the field.
package v1alpha1

import (
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Group, version and kind of the opaque config.
const (
	GroupName  = "gpu.gpudra.dev"
	Version    = "v1alpha1"
	APIVersion = GroupName + "/" + Version
	Kind       = "GpuConfig"
)

// GpuConfig configures the devices of a claim (or of one request of it).
type GpuConfig struct {
	metav1.TypeMeta `json:",inline"`
	// Sharing says how the claim's GPUs are shared. Absent: exclusive.
	Sharing *Sharing `json:"sharing,omitempty"`
}

// SharingStrategy names a sharing mode. What each one enforces, honestly:
//
//	Exclusive    the claim's containers see only its devices; nothing else
//	             runs on them (unless the claim itself is shared by pods).
//	TimeSlicing  several processes take turns on the GPU; only the length of
//	             a turn is set. No memory limit, no isolation, no fault
//	             isolation.
//	MPS          one MPS server per GPU (or device set), shared by every MPS
//	             claim on it; clients run concurrently with a compute share
//	             (active thread percentage) and a pinned device memory limit
//	             set in each client's environment, which bind cooperating
//	             clients only (docs/sharing.md).
//	             No fault isolation: one client's fatal error hits all.
//
// Several pods using one claim share its devices in every mode; the claim
// says how. Memory and compute isolation in hardware is MIG.
type SharingStrategy string

const (
	Exclusive   SharingStrategy = "Exclusive"
	TimeSlicing SharingStrategy = "TimeSlicing"
	MPS         SharingStrategy = "MPS"
)

// Sharing is the sharing configuration of a claim's devices.
type Sharing struct {
	// Strategy is Exclusive (default), TimeSlicing or MPS.
	Strategy SharingStrategy `json:"strategy"`
	// TimeSlicing configures the TimeSlicing strategy; only with it.
	TimeSlicing *TimeSlicingConfig `json:"timeSlicing,omitempty"`
	// MPS configures the MPS strategy; only with it.
	MPS *MPSConfig `json:"mps,omitempty"`
	// IPC gives every consumer of the claim the same directory, mounted at
	// IPCDirectory, so that pods sharing a claim (a primary and its shadow)
	// can hand over CUDA IPC handles. Any strategy.
	IPC bool `json:"ipc,omitempty"`
}

// IPCDirectory is where the claim's IPC directory appears in containers;
// GPUDRA_IPC_DIR names it too.
const IPCDirectory = "/var/run/gpudra/ipc"

// TimeSliceInterval is the length of a time slice, as nvidia-smi
// compute-policy --set-timeslice knows it.
type TimeSliceInterval string

const (
	DefaultTimeSlice TimeSliceInterval = "Default"
	ShortTimeSlice   TimeSliceInterval = "Short"
	MediumTimeSlice  TimeSliceInterval = "Medium"
	LongTimeSlice    TimeSliceInterval = "Long"
)

// TimeSliceIntervals are the accepted intervals, in nvidia-smi's order
// (--set-timeslice 0..3).
var TimeSliceIntervals = []TimeSliceInterval{DefaultTimeSlice, ShortTimeSlice, MediumTimeSlice, LongTimeSlice}

// TimeSlicingConfig sets the time slice of the claim's GPUs. It is a
// property of the GPU: it is restored to Default when the last claim that
// set it is unprepared.
type TimeSlicingConfig struct {
	// Interval is Default, Short, Medium or Long. Default when empty.
	Interval TimeSliceInterval `json:"interval,omitempty"`
}

// MPSConfig sets the limits of the claim's MPS clients (set in each client's
// environment, not as daemon defaults: the GPU's one server serves other
// claims too).
type MPSConfig struct {
	// ActiveThreadPercentage caps the share of the GPU's SMs a client may
	// use, 1 to 100.
	ActiveThreadPercentage *int32 `json:"activeThreadPercentage,omitempty"`
	// PinnedMemoryLimit caps the device memory a client may pin on each of
	// the claim's devices (for example 40Gi). It may not exceed the
	// device's memory.
	PinnedMemoryLimit *resource.Quantity `json:"pinnedMemoryLimit,omitempty"`
}

// DefaultConfig is what a claim without config gets.
func DefaultConfig() *GpuConfig {
	return &GpuConfig{
		TypeMeta: metav1.TypeMeta{APIVersion: APIVersion, Kind: Kind},
		Sharing:  &Sharing{Strategy: Exclusive},
	}
}
