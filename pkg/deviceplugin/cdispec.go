package deviceplugin

import (
	"fmt"

	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/prepared"
)

// The DRA side writes CDI specs per claim only (kind gpu.gpudra.dev/claim,
// one transient spec per claim UID, device names "<claimUID>-<device>").
// The device plugin has no claims, and the kubelet's Allocate must answer
// with CDI names that already resolve, so the device plugin keeps one
// node-wide spec of the same kind, written with the same writer
// (cdi.Writer.Write) under the fixed pseudo-claim UID SpecUID and built by
// the same cdi.BuildSpec: every advertised GPU and MIG device is a CDI
// device "device-plugin-<DRA device name>" with exactly the container
// edits a DRA claim's device gets (control nodes, its own nodes with type,
// major and minor, NVIDIA_VISIBLE_DEVICES=void, its GPUDRA_DEVICE_*_UUID).
// A container therefore sees the same thing in both modes. Allocate names
// these CDI devices (the CDI device list strategies) or passes their edits
// (cdiview.go), or both.

// SpecUID is the pseudo-claim UID of the device plugin's node-wide CDI spec.
const SpecUID = "device-plugin"

// CDIDeviceName is the fully qualified CDI name of a device in the device
// plugin's spec: "gpu.gpudra.dev/claim=device-plugin-gpu-3".
func CDIDeviceName(deviceName string) string { return cdi.QualifiedName(SpecUID, deviceName) }

// BuildCDISpec is the pure step: the node-wide spec with one CDI device per
// GPU (in MIG mode or not: the none strategy advertises both as whole GPUs)
// and per existing MIG device: all the devices any MIG strategy can
// advertise.
func BuildCDISpec(inv *nvdevice.Inventory, host nvdevice.Host) (*cdispec.Spec, error) {
	devices, err := specDevices(inv, host)
	if err != nil {
		return nil, err
	}
	return cdi.BuildSpec(cdi.Claim{UID: SpecUID, Devices: devices}, host.Majors)
}

// specDevices are the devices of the node-wide spec, each with its own
// device nodes: every GPU, then its MIG devices.
func specDevices(inv *nvdevice.Inventory, host nvdevice.Host) ([]prepared.Device, error) {
	var devices []prepared.Device
	for i := range inv.GPUs {
		g := &inv.GPUs[i]
		gpuNode := cdi.GPUNode(host.Majors, g.Minor)
		devices = append(devices, prepared.Device{Device: devName(g, nil), UUID: g.UUID,
			GPUUUID: g.UUID, Nodes: []prepared.DeviceNode{gpuNode}})
		for j := range g.MIG.Devices {
			m := &g.MIG.Devices[j]
			if host.CapMinors == nil {
				return nil, fmt.Errorf("MIG device %s: the host gives no capability minors", m.UUID)
			}
			gi, ci, err := host.CapMinors(g.Minor, m.GPUInstanceID, m.ComputeInstanceID)
			if err != nil {
				return nil, fmt.Errorf("MIG device %s: %w", m.UUID, err)
			}
			devices = append(devices, prepared.Device{Device: devName(g, m), UUID: m.UUID, GPUUUID: g.UUID, Mig: true,
				Nodes: []prepared.DeviceNode{gpuNode, cdi.CapNode(host.Majors, gi), cdi.CapNode(host.Majors, ci)}})
		}
	}
	return devices, nil
}

// WriteCDISpec builds the node-wide spec and writes it with the DRA side's
// writer, replacing an earlier one. Call it at start and whenever the
// inventory changes, before serving the resources.
func WriteCDISpec(w *cdi.Writer, inv *nvdevice.Inventory, host nvdevice.Host) error {
	spec, err := BuildCDISpec(inv, host)
	if err != nil {
		return fmt.Errorf("device plugin CDI spec: %w", err)
	}
	return w.Write(SpecUID, spec)
}
