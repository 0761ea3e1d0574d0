// Package prepared is what the kubelet plugin prepared for a claim: one
// type per concept, shared by the plan's result, the checkpoint, the sharing
// strategies and the CDI spec, so that a prepared device is never copied
// between near-identical structs.
//
// The JSON form is the checkpoint's. Fields the checkpoint must not carry
// (host facts that are read again after a restart) are tagged "-". Adding a
// field to the JSON form is a format change: release N-1 refuses fields it
// does not know, so see pkg/plugin/checkpoint before adding one.
package prepared

import (
	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
)

// ClaimState is where a claim is in its two-phase prepare.
type ClaimState string

const (
	// PrepareStarted: side effects (MIG instances, sharing, CDI spec) may
	// exist in part; they are rolled back after a restart.
	PrepareStarted ClaimState = "PrepareStarted"
	// PrepareCompleted: everything was done and returned to the kubelet.
	PrepareCompleted ClaimState = "PrepareCompleted"
)

// Claim is one claim's record.
type Claim struct {
	// UID is the claim's UID; the checkpoint keys its map by it.
	UID       string     `json:"-"`
	Namespace string     `json:"namespace"`
	Name      string     `json:"name"`
	State     ClaimState `json:"state"`
	Devices   []Device   `json:"devices"`
	// Sharing is the claim's sharing configuration, kept so that what it
	// set up (an MPS server's client, a time slice, an IPC directory) can
	// be found and undone after a restart. Absent: exclusive.
	Sharing *gpuapi.Sharing `json:"sharing,omitempty"`
}

// Strategy is the claim's sharing strategy, Exclusive when none is set.
func (c *Claim) Strategy() gpuapi.SharingStrategy {
	if c.Sharing == nil || c.Sharing.Strategy == "" {
		return gpuapi.Exclusive
	}
	return c.Sharing.Strategy
}

// SharingConfig is the claim's sharing configuration, never nil.
func (c *Claim) SharingConfig() gpuapi.Sharing {
	if c.Sharing == nil {
		return gpuapi.Sharing{Strategy: gpuapi.Exclusive}
	}
	return *c.Sharing
}

// Ref names the claim in logs and errors.
func (c *Claim) Ref() string { return c.Namespace + "/" + c.Name }

// GPUs lists the physical GPUs of the claim's devices, once each, in order.
func (c *Claim) GPUs() []string {
	var out []string
	seen := map[string]bool{}
	for _, d := range c.Devices {
		g := d.PhysicalGPU()
		if !seen[g] {
			seen[g] = true
			out = append(out, g)
		}
	}
	return out
}

// CreatesMig says whether the claim's record names a MIG device that the
// plugin created (and must destroy).
func (c *Claim) CreatesMig() bool {
	for _, d := range c.Devices {
		if d.CreatedMig != nil {
			return true
		}
	}
	return false
}

// Device is one device prepared for a claim.
type Device struct {
	Requests []string `json:"requests"`
	Pool     string   `json:"pool"`
	// Device is the DRA device name ("gpu-3", "gpu-0-mig-3g-40gb-4").
	Device string `json:"device"`
	// UUID is what the container sees (the GPU's or the MIG device's).
	UUID         string   `json:"uuid,omitempty"`
	CDIDeviceIDs []string `json:"cdiDeviceIDs,omitempty"`
	// CreatedMig records a MIG device the plugin created for the claim:
	// its ids and UUID are not deterministic, so they are kept here to
	// destroy exactly that instance later.
	CreatedMig *CreatedMig `json:"createdMig,omitempty"`
	// GPUUUID is the physical GPU (the parent of a MIG device).
	GPUUUID string `json:"gpuUUID,omitempty"`
	// Mig says the device is a MIG device.
	Mig bool `json:"mig,omitempty"`
	// MemoryBytes and Multiprocessors are the device's, or its share's.
	MemoryBytes     int64 `json:"memoryBytes,omitempty"`
	Multiprocessors int64 `json:"multiprocessors,omitempty"`
	// Share is set for a consumable-capacity share of a GPU.
	Share *Share `json:"share,omitempty"`
	// AdminAccess marks a device given with admin access: not a use of
	// the device (no conflict with the claim that uses it, no MIG instance,
	// no sharing), only its monitoring view. Added after release N-1, whose
	// reader refuses unknown fields: it rebuilds a checkpoint holding such
	// a device from the API (omitted otherwise, so nothing changes for
	// nodes without admin-access claims).
	AdminAccess bool `json:"adminAccess,omitempty"`

	// CDIDevice is the device's CDI device name in the claim's spec when
	// it differs from Device (two shares of one GPU in one claim). Only
	// needed while the spec is written: not checkpointed.
	CDIDevice string `json:"-"`

	// Nodes are the device's own character devices (/dev/nvidia<minor>
	// and, for MIG, its two capability nodes). Host facts: not
	// checkpointed, resolved again when a spec is written.
	Nodes []DeviceNode `json:"-"`
}

// CDIName is the device's name in its claim's CDI spec.
func (d *Device) CDIName() string {
	if d.CDIDevice != "" {
		return d.CDIDevice
	}
	return d.Device
}

// PhysicalGPU is the UUID of the GPU the device is on.
func (d *Device) PhysicalGPU() string {
	if d.GPUUUID != "" {
		return d.GPUUUID
	}
	return d.UUID // records written before GPUUUID existed
}

// Share is what a claim consumes of a GPU that several claims share.
type Share struct {
	ID              string `json:"id"`
	MemoryBytes     int64  `json:"memoryBytes"`
	Multiprocessors int64  `json:"multiprocessors"`
	// GPUMultiprocessors is the whole GPU's count, to turn the share into a
	// percentage.
	GPUMultiprocessors int64 `json:"gpuMultiprocessors"`
}

// CreatedMig identifies a MIG device the plugin created. Profile, parent and
// placement are recorded before the creation, the ids and UUID after it.
type CreatedMig struct {
	ParentUUID        string `json:"parentUUID"`
	Profile           string `json:"profile"`
	Start             int    `json:"start"`
	GPUInstanceID     int    `json:"gpuInstanceID"`
	ComputeInstanceID int    `json:"computeInstanceID"`
	UUID              string `json:"uuid"`
}

// UnknownInstance marks instance ids that are not known yet (recorded
// before the creation).
const UnknownInstance = -1

// DeviceNode is one character device a container needs.
type DeviceNode struct {
	Path  string
	Major int64
	Minor int64
}
