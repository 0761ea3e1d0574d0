// Package cdi writes the per-claim transient CDI specs that inject a claim's
// GPUs into its containers: the device nodes (with type, major and minor, so
// specs can be written and injected where /dev/nvidia* does not exist) and
// each device's identity. A container gets the claim's devices only.
//
// Visibility is decided by device nodes alone, so that a container with
// several claims (or several devices of one claim) sees the union of them
// whatever order the runtime applies the claims' edits in: nothing one
// device's edits set can be overwritten by another's.
//   - NVIDIA_VISIBLE_DEVICES=void in every device's edits: the same value in
//     every spec, so order cannot matter, and an NVIDIA toolkit hook, where
//     one still runs, adds no device of its own.
//   - No CUDA_VISIBLE_DEVICES: CUDA enumerates the device nodes the container
//     has (for MIG: the parent GPU's node plus the instance's capability
//     nodes).
//   - Each device's identity in variables of its own, named from its CDI
//     device name (unique per claim and device), which no other device sets:
//     GPUDRA_DEVICE_<NAME>_UUID=<GPU or MIG UUID>, where <NAME> is the CDI
//     device name upper-cased with every character other than A-Z and 0-9
//     replaced by "_" (DeviceEnvPrefix).
//
// Sharing settings (MPS pipe directory and limits, the IPC directory) belong
// to the claim: they are claim-wide edits of the claim's spec, applied once
// when any of its devices is injected. Two claims would set them differently
// (two pipe or IPC directories at one path, two sets of limits), and a CUDA
// process that finds an MPS daemon sees only that server's GPUs, so a
// container with an MPS claim takes no other GPU claim and a container takes
// at most one IPC claim (docs/security.md; not refused: the plugin does not
// see containers).
package cdi

import (
	"fmt"
	"slices"
	"sort"
	"strings"

	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
	"tags.cncf.io/container-device-interface/pkg/parser"
	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/prepared"
)

// Vendor and Class make the CDI kind "gpu.gpudra.dev/claim".
const (
	Vendor = "gpu.gpudra.dev"
	Class  = "claim"
)

// Majors are the major numbers of the NVIDIA character devices, as the
// backend's nvdevice.Host gives them.
type Majors = nvdevice.DeviceMajors

// Claim is what one claim's spec is built from.
type Claim struct {
	UID string
	// Devices are the claim's prepared devices: their names, the UUIDs the
	// container sees and their own device nodes.
	Devices []prepared.Device
	// Env is added to every container of the claim (sharing settings):
	// claim-wide, set once whichever of the claim's devices a container
	// gets. It may not set the variables BuildSpec owns.
	Env map[string]string
	// Mounts are host directories every container of the claim gets (the
	// MPS pipe directory, the IPC directory).
	Mounts []Mount
}

// Mount is a host directory bind-mounted into the claim's containers.
type Mount struct {
	HostPath      string
	ContainerPath string
}

// ControlNodes are the nodes every GPU container needs.
func ControlNodes(m Majors) []prepared.DeviceNode {
	return []prepared.DeviceNode{
		{Path: "/dev/nvidiactl", Major: m.NVIDIA, Minor: 255},
		{Path: "/dev/nvidia-uvm", Major: m.UVM, Minor: 0},
		{Path: "/dev/nvidia-uvm-tools", Major: m.UVM, Minor: 1},
	}
}

// GPUNode is /dev/nvidia<minor>.
func GPUNode(m Majors, minor int) prepared.DeviceNode {
	return prepared.DeviceNode{Path: fmt.Sprintf("/dev/nvidia%d", minor), Major: m.NVIDIA, Minor: int64(minor)}
}

// CapNode is /dev/nvidia-caps/nvidia-cap<minor>.
func CapNode(m Majors, minor int) prepared.DeviceNode {
	return prepared.DeviceNode{Path: fmt.Sprintf("/dev/nvidia-caps/nvidia-cap%d", minor), Major: m.Caps, Minor: int64(minor)}
}

// SpecName is the transient spec's name for a claim; unique per claim UID so
// that a runtime's cache never confuses two claims.
func SpecName(claimUID string) string {
	return cdiapi.GenerateTransientSpecName(Vendor, Class, claimUID)
}

// DeviceName is the CDI device name of one DRA device of a claim.
func DeviceName(claimUID, device string) string { return claimUID + "-" + device }

// QualifiedName is the CDI id the kubelet hands to the runtime.
func QualifiedName(claimUID, device string) string {
	return parser.QualifiedName(Vendor, Class, DeviceName(claimUID, device))
}

// VisibleDevicesVoid is NVIDIA_VISIBLE_DEVICES in every spec: no device from
// the NVIDIA toolkit, the device nodes decide.
const VisibleDevicesVoid = "NVIDIA_VISIBLE_DEVICES=void"

// DeviceEnvPrefix is the prefix of a device's own variables:
// DeviceEnvPrefix + <sanitized CDI device name> + "_UUID".
const DeviceEnvPrefix = "GPUDRA_DEVICE_"

// DeviceUUIDEnv is the name of the variable holding the UUID of the CDI
// device cdiName (DeviceName(claimUID, device)).
func DeviceUUIDEnv(cdiName string) string {
	b := []byte(strings.ToUpper(cdiName))
	for i, c := range b {
		if (c < 'A' || c > 'Z') && (c < '0' || c > '9') {
			b[i] = '_'
		}
	}
	return DeviceEnvPrefix + string(b) + "_UUID"
}

// ownedEnv are the variables BuildSpec sets or must never set.
var ownedEnv = []string{"NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"}

// BuildSpec is the pure step: the spec for one claim. Every CDI device
// carries the control nodes, its own nodes, NVIDIA_VISIBLE_DEVICES=void and
// its own identity, nothing naming another device; a container given any
// subset of the claim's devices, beside any other claims' devices, sees
// exactly the union (CDI merges duplicate nodes).
func BuildSpec(c Claim, m Majors) (*cdispec.Spec, error) {
	if c.UID == "" {
		return nil, fmt.Errorf("claim UID is empty")
	}
	seen := map[string]string{}
	for _, d := range c.Devices {
		if d.UUID == "" {
			return nil, fmt.Errorf("claim %s: device %s has no UUID", c.UID, d.Device)
		}
		env := DeviceUUIDEnv(DeviceName(c.UID, d.CDIName()))
		if other, ok := seen[env]; ok {
			return nil, fmt.Errorf("claim %s: devices %s and %s would share the variable %s", c.UID, other, d.Device, env)
		}
		seen[env] = d.Device
	}
	keys := make([]string, 0, len(c.Env))
	for k := range c.Env {
		if slices.Contains(ownedEnv, k) || strings.HasPrefix(k, DeviceEnvPrefix) {
			return nil, fmt.Errorf("claim %s: sharing may not set %s: the device nodes decide what a container sees", c.UID, k)
		}
		keys = append(keys, k)
	}
	sort.Strings(keys)
	spec := &cdispec.Spec{Kind: Vendor + "/" + Class}
	for _, d := range c.Devices {
		var nodes []*cdispec.DeviceNode
		for _, n := range append(ControlNodes(m), d.Nodes...) {
			nodes = append(nodes, &cdispec.DeviceNode{Path: n.Path, Type: "c", Major: n.Major, Minor: n.Minor})
		}
		name := DeviceName(c.UID, d.CDIName())
		spec.Devices = append(spec.Devices, cdispec.Device{
			Name: name,
			ContainerEdits: cdispec.ContainerEdits{DeviceNodes: nodes,
				Env: []string{VisibleDevicesVoid, DeviceUUIDEnv(name) + "=" + d.UUID}},
		})
	}
	// Claim-wide edits apply once, whichever of the claim's devices a
	// container gets.
	for _, k := range keys {
		spec.ContainerEdits.Env = append(spec.ContainerEdits.Env, k+"="+c.Env[k])
	}
	for _, m := range c.Mounts {
		spec.ContainerEdits.Mounts = append(spec.ContainerEdits.Mounts, &cdispec.Mount{
			HostPath: m.HostPath, ContainerPath: m.ContainerPath, Options: []string{"rbind", "rw", "nosuid", "nodev"}})
	}
	version, err := cdiapi.MinimumRequiredVersion(spec)
	if err != nil {
		return nil, fmt.Errorf("claim %s: CDI version: %w", c.UID, err)
	}
	spec.Version = version
	return spec, nil
}
