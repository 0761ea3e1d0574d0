// Package cloudapi is the wire contract of devcluster's cloud: the machine
// API devcluster serves on a unix socket (devcluster/cloud) and an
// autoscaler's cloud provider calls (devcluster/karpenter), as a real
// provider calls its cloud's API.
//
// It is a module of its own with no dependencies: the provider is compiled
// into Karpenter's binary, on Karpenter's Kubernetes libraries, and
// devcluster is on its own; both speak this JSON.
package cloudapi

import (
	"encoding/json"
	"time"
)

// SocketEnv names the environment variable that carries the cloud's
// socket path to a provider.
const SocketEnv = "DEVCLUSTER_CLOUD_SOCKET"

// ProviderIDPrefix starts every machine's provider ID (Node.spec.providerID).
const ProviderIDPrefix = "devcluster://"

// Paths of the API. A machine is at MachinesPath + "/" + its name.
const (
	InstanceTypesPath = "/v1/instancetypes"
	MachinesPath      = "/v1/machines"
)

// Zone and Region are the one zone and region of devcluster's cloud, and
// of every devcluster node.
const (
	Zone   = "devcluster-a"
	Region = "devcluster"
)

// Configuration is how a machine's GPUs are set up at boot: MIG mode, the
// plugin's MIG publishing policy, fractional sharing. It is what a
// provider's NodeClass says; the templates of a type depend on it.
type Configuration struct {
	// MIGMode turns MIG mode on on every GPU.
	MIGMode bool `json:"migMode,omitempty"`
	// MIGDevices is the plugin's --mig-devices policy: existing, all, or
	// profiles=<p>[,<p>...]. Empty: all.
	MIGDevices string `json:"migDevices,omitempty"`
	// FractionalGPUs runs the plugin with --fractional-gpus.
	FractionalGPUs bool `json:"fractionalGPUs,omitempty"`
}

// InstanceType is a machine type on sale, under one Configuration.
type InstanceType struct {
	Name       string `json:"name"`
	GPUs       int    `json:"gpus"`
	GPUProduct string `json:"gpuProduct"`
	// CPU, Memory, Pods and EphemeralStorage are the Node's capacity, as
	// resource quantities ("224", "2Ti").
	CPU              string `json:"cpu"`
	Memory           string `json:"memory"`
	Pods             string `json:"pods"`
	EphemeralStorage string `json:"ephemeralStorage"`
	// PricePerHour orders the types for an autoscaler (US dollars, on
	// demand, in the one zone).
	PricePerHour float64 `json:"pricePerHour"`
	// Templates is what `gpudra slices -o karpenter` prints for the type
	// under the Configuration (machinetype.Templates): the ResourceSlices a
	// fresh node of the type publishes.
	Templates json.RawMessage `json:"templates"`
}

// Taint is a taint the machine's kubelet registers its Node with.
type Taint struct {
	Key    string `json:"key"`
	Value  string `json:"value,omitempty"`
	Effect string `json:"effect"`
}

// MachineRequest asks for a machine.
type MachineRequest struct {
	// Name is the machine's, and its Node's, name.
	Name          string        `json:"name"`
	InstanceType  string        `json:"instanceType"`
	Configuration Configuration `json:"configuration"`
	// Labels and Taints are the kubelet's --node-labels and
	// --register-with-taints.
	Labels map[string]string `json:"labels,omitempty"`
	Taints []Taint           `json:"taints,omitempty"`
}

// Machine is a machine the cloud runs.
type Machine struct {
	MachineRequest
	ProviderID string    `json:"providerID"`
	Created    time.Time `json:"created"`
	// Ready is when its node first published all of its ResourceSlices;
	// zero before.
	Ready time.Time `json:"ready,omitzero"`
}

// Error is the body of every error answer.
type Error struct {
	Message string `json:"message"`
}
