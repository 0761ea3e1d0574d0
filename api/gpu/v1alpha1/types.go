// Package v1alpha1 is gpudra's opaque per-claim device configuration,
// apiVersion gpu.gpudra.dev/v1alpha1, kind GpuConfig. The kubelet plugin
// decodes it strictly at prepare (and the admission webhook, later, at
// admission): unknown fields, wrong kinds and impossible values are errors
// that name the field.
package v1alpha1

import (
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

// SharingStrategy names a sharing mode.
type SharingStrategy string

const (
	// Exclusive: one claim, its devices; nothing else runs on them. What is
	// enforced: the container sees only its claim's devices (CDI).
	Exclusive SharingStrategy = "Exclusive"
	// TimeSlicing and MPS are reserved names; they are accepted by a later
	// version of the plugin and refused by this one.
	TimeSlicing SharingStrategy = "TimeSlicing"
	MPS         SharingStrategy = "MPS"
)

// Sharing is the sharing configuration.
type Sharing struct {
	Strategy SharingStrategy `json:"strategy"`
}

// DefaultConfig is what a claim without config gets.
func DefaultConfig() *GpuConfig {
	return &GpuConfig{
		TypeMeta: metav1.TypeMeta{APIVersion: APIVersion, Kind: Kind},
		Sharing:  &Sharing{Strategy: Exclusive},
	}
}
