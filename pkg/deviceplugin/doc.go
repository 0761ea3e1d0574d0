// Package deviceplugin is gpudra's classic kubelet device-plugin front
// (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1), for clusters without DRA.
// It is built on the same GPU model (pkg/nvdevice), CDI specs (pkg/cdi) and
// health events as the DRA plugin; a node runs one of the two, never both.
//
//   - Resources (pure): by NVIDIA's MIG strategies (flags.migStrategy,
//     migstrategy.go): none (the default) advertises every GPU whole under a
//     configurable name (nvidia.com/gpu), single the MIG devices under that
//     name (a node with mixed MIG modes or profiles is an error naming its
//     GPUs), mixed one resource per profile (nvidia.com/mig-1g.10gb); MIG
//     devices are the ones configured, never created. Then time-slicing or
//     MPS replicas ("<uuid>::<n>") from a config file in NVIDIA's shape
//     (ParseConfig).
//   - Plugin: one DevicePluginServer per resource, registered with the
//     kubelet and re-registered when the kubelet restarts; ListAndWatch
//     follows health; GetPreferredAllocation keeps a request in one NVLink
//     domain and packs (PreferredAllocation, pure); Allocate answers by
//     NVIDIA's device list strategies (flags.plugin.deviceListStrategy,
//     allocate.go): NVIDIA_VISIBLE_DEVICES (envvar, the default),
//     volume-mount markers, CDI annotations or CdiDevices, naming the
//     devices of the node-wide CDI spec BuildCDISpec builds with
//     cdi.BuildSpec, so containers see what a DRA claim's containers see.
//     With envvar and volume-mounts it also passes those CDI devices' edits
//     as DeviceSpecs, Mounts and Envs (cdiview.go), resolved by the CDI
//     library, so that a container gets its GPUs on a runtime without CDI
//     or NVIDIA's runtime.
//   - Serve: the whole mode for the node agent.
//
// Differences from NVIDIA's k8s-device-plugin config (docs/device-plugin.md
// lists each with its reason): the fields of NVIDIA's README examples are
// known (version, flags.migStrategy, failOnInitError (true only),
// nvidiaDriverRoot and nvidiaDevRoot (the host root of the device nodes),
// flags.plugin passDeviceSpecs (either value), deviceListStrategy,
// deviceIDStrategy (index for whole GPUs only), cdiAnnotationPrefix) and
// sharing (timeSlicing, mps: renameByDefault, failRequestsGreaterThanOne,
// resources[].name/rename/devices/replicas); every other field is an
// error. devices takes "all" or a list of GPU indexes or UUIDs (no count);
// MPS cannot replicate MIG devices or GPUs in MIG mode and always refuses
// requests of more than one replica.
package deviceplugin
