// Package cdi writes the per-claim transient CDI specs that inject a claim's
// GPUs into its containers: the device nodes (with type, major and minor, so
// specs can be written and injected where /dev/nvidia* does not exist) and
// the environment naming the claim's devices. A container gets the claim's
// devices only.
package cdi

import (
	"fmt"
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
	// Env is added to every container of the claim (sharing settings).
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

// BuildSpec is the pure step: the spec for one claim. Every CDI device
// carries the control nodes, its own nodes, and the environment naming all
// of the claim's devices, so a container given any subset of the claim sees
// the same list (CDI merges duplicate nodes).
func BuildSpec(c Claim, m Majors) (*cdispec.Spec, error) {
	if c.UID == "" {
		return nil, fmt.Errorf("claim UID is empty")
	}
	uuids := make([]string, 0, len(c.Devices))
	for _, d := range c.Devices {
		if d.UUID == "" {
			return nil, fmt.Errorf("claim %s: device %s has no UUID", c.UID, d.Device)
		}
		uuids = append(uuids, d.UUID)
	}
	env := []string{
		"NVIDIA_VISIBLE_DEVICES=" + strings.Join(uuids, ","),
		"CUDA_VISIBLE_DEVICES=" + strings.Join(uuids, ","),
	}
	keys := make([]string, 0, len(c.Env))
	for k := range c.Env {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		env = append(env, k+"="+c.Env[k])
	}
	spec := &cdispec.Spec{Kind: Vendor + "/" + Class}
	for _, d := range c.Devices {
		var nodes []*cdispec.DeviceNode
		for _, n := range append(ControlNodes(m), d.Nodes...) {
			nodes = append(nodes, &cdispec.DeviceNode{Path: n.Path, Type: "c", Major: n.Major, Minor: n.Minor})
		}
		spec.Devices = append(spec.Devices, cdispec.Device{
			Name:           DeviceName(c.UID, d.Device),
			ContainerEdits: cdispec.ContainerEdits{DeviceNodes: nodes, Env: env},
		})
	}
	// Claim-wide edits apply once, whichever of the claim's devices a
	// container gets.
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
