package telemetry

import (
	"slices"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// Label names. Where dcgm-exporter has a label for the same thing (its
// DRA labels, and namespace, pod and container), gpudra's series carry
// that label under dcgm-exporter's name, so that a dashboard or an alert
// written against dcgm-exporter's labels reads gpudra's series: the DRA
// names of the device, its driver and pool, a MIG device's profile and
// UUID, and the claim that holds it. docs/metrics.md says why they were
// renamed rather than added.
const (
	labelGPU        = "gpu"  // the physical GPU's UUID (dcgm-exporter's UUID label)
	labelNode       = "node" // the node (dcgm-exporter's Hostname)
	labelModel      = "model"
	labelDevice     = "dra_device_name"     // the device's name in the node's ResourceSlice
	labelDriver     = "dra_driver_name"     // gpu.gpudra.dev
	labelPool       = "dra_pool_name"       // the node's pool: the node name
	labelMigProfile = "dra_mig_profile"     // a MIG device's profile (3g.40gb); empty on a GPU
	labelMigUUID    = "dra_mig_device_uuid" // a MIG device's own UUID; empty on a GPU
	labelClaimName  = "dra_claim_name"
	labelClaimNS    = "dra_claim_namespace"
	labelNamespace  = "namespace"
	labelPod        = "pod"
	labelContainer  = "container"
	labelClaimUID   = "claim_uid" // dcgm-exporter has none
)

var (
	// deviceLabels name a device as the DRA plugin publishes it, in both
	// modes: in device plugin mode the names are those the DRA plugin
	// would publish on the node.
	deviceLabels = []string{labelGPU, labelDevice, labelNode, labelDriver, labelPool}
	// gpuLabels are a GPU's telemetry and health series'.
	gpuLabels = append(slices.Clone(deviceLabels), labelModel)
	// migLabels are a MIG device's telemetry series'.
	migLabels = append(slices.Clone(deviceLabels), labelModel, labelMigProfile, labelMigUUID)
	// heldLabels are those of the series of any device's claims, pods,
	// containers and unattributed processes: a GPU's MIG labels are empty
	// (Prometheus stores no empty label).
	heldLabels = append(slices.Clone(deviceLabels), labelMigProfile, labelMigUUID)
	// containerLabels are the per-container series'.
	containerLabels = append(slices.Clone(heldLabels), labelNamespace, labelPod, labelContainer)
)

// deviceValues are deviceLabels' values for a device of the node.
func deviceValues(node, gpu, device string) []string {
	return []string{gpu, device, node, slicebuilder.DriverName, node}
}

// heldDevice is a device as heldLabels name it.
type heldDevice struct {
	GPU, Device, MigProfile, MigUUID string
}

// heldDeviceOf is the sample's device.
func heldDeviceOf(s *nvdevice.TelemetrySample) heldDevice {
	d := heldDevice{GPU: s.GPUUUID(), Device: DeviceName(s)}
	if s.IsMIG() {
		d.MigProfile, d.MigUUID = s.MigProfile, s.UUID
	}
	return d
}

// values are heldLabels' values for the device on node, then extra.
func (d heldDevice) values(node string, extra ...string) []string {
	return append(append(deviceValues(node, d.GPU, d.Device), d.MigProfile, d.MigUUID), extra...)
}
