// Package deviceplugin is gpudra's classic kubelet device-plugin front
// (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1), for clusters without DRA.
// It is built on the same GPU model (pkg/nvdevice), CDI specs (pkg/cdi) and
// health events as the DRA plugin; a node runs one of the two, never both.
//
//   - Resources (pure): whole GPUs not in MIG mode under a configurable name
//     (nvidia.com/gpu), the MIG devices configured on GPUs in MIG mode under
//     one resource per profile (nvidia.com/mig-1g.10gb, NVIDIA's "mixed"
//     strategy; nothing is created), and time-slicing or MPS replicas
//     ("<uuid>::<n>") from a config file in NVIDIA's shape (ParseConfig).
//   - Plugin: one DevicePluginServer per resource, registered with the
//     kubelet and re-registered when the kubelet restarts; ListAndWatch
//     follows health; GetPreferredAllocation keeps a request in one NVLink
//     domain and packs (PreferredAllocation, pure); Allocate answers with
//     CDI names from the node-wide spec BuildCDISpec builds with
//     cdi.BuildSpec, so containers see what a DRA claim's containers see.
//   - Serve: the whole mode for the node agent.
//
// Differences from NVIDIA's k8s-device-plugin config: only version,
// flags.migStrategy (none|mixed; "single" is refused) and sharing
// (timeSlicing, mps: renameByDefault, failRequestsGreaterThanOne,
// resources[].name/rename/devices/replicas) are known, every other field is
// an error; devices takes "all" or a list of GPU indexes or UUIDs (no
// count); MPS cannot replicate MIG devices and always refuses requests of
// more than one replica.
package deviceplugin
