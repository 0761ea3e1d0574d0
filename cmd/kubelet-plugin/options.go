package main

import (
	"errors"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/spf13/pflag"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/component-base/featuregate"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	"github.com/gpudra/gpudra/pkg/component"
	"github.com/gpudra/gpudra/pkg/deviceplugin"
	"github.com/gpudra/gpudra/pkg/drivertools"
	"github.com/gpudra/gpudra/pkg/local"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/nvml"
	"github.com/gpudra/gpudra/pkg/plugin"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
	"github.com/gpudra/gpudra/pkg/telemetry"
)

// options are the plugin's flags. Each has an environment variable (the
// chart sets those); the command line wins over it.
type options struct {
	nodeName, kubeconfig, driverRoot, cdiDir, pluginDataDir, registrarDir                     string
	backend, machine, procRoot, podUID, metricsAddr                                           string
	mpsControl, mpsServerImage, mpsServerServiceAccount, namespace, hostDriverRoot, nvidiaSMI string
	cdiHook                                                                                   string
	mode, devicePluginConfig, gpuResourceName, devicePluginDir                                string
	kubeletDeviceCheckpoint, podResourcesSocket                                               string
	containerLogDir                                                                           string
	telemetryProcesses                                                                        bool
	metricsAuth, metricsTLS                                                                   bool
	localStateDir                                                                             string
	taintEffect, migDevices                                                                   string
	fractional                                                                                bool
	dcgmExporterAttributes                                                                    bool
	qps                                                                                       float64
	burst                                                                                     int
	telemetryInterval                                                                         time.Duration
	healthIgnoredXIDs                                                                         []uint64
}

// addFlags registers the plugin's flags and their environment variables.
func addFlags(fs *pflag.FlagSet) *options {
	o := &options{}
	env := func(flag, env string) { component.EnvVar(fs, flag, env) }
	fs.StringVar(&o.nodeName, "node-name", "", "this node's name")
	env("node-name", "NODE_NAME")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig; in-cluster config when empty")
	env("kubeconfig", "KUBECONFIG")
	fs.StringVar(&o.driverRoot, "driver-root", nvml.DefaultDriverRoot, "where the NVIDIA driver is installed")
	env("driver-root", "DRIVER_ROOT")
	fs.StringVar(&o.cdiDir, "cdi-dir", "/var/run/cdi", "where CDI specs are written")
	env("cdi-dir", "CDI_DIR")
	fs.StringVar(&o.pluginDataDir, "plugin-data-dir", filepath.Join(kubeletplugin.KubeletPluginsDir, slicebuilder.DriverName), "DRA socket and checkpoint")
	env("plugin-data-dir", "PLUGIN_DATA_DIR")
	fs.StringVar(&o.registrarDir, "registrar-dir", kubeletplugin.KubeletRegistryDir, "kubelet plugin registry")
	env("registrar-dir", "REGISTRAR_DIR")
	fs.StringVar(&o.backend, "backend", "nvml", "nvml or sim")
	env("backend", "BACKEND")
	fs.StringVar(&o.machine, "sim-machine", "dgx-h100", "simulated machine for --backend sim: built-in name or YAML file")
	env("sim-machine", "SIM_MACHINE")
	fs.StringVar(&o.procRoot, "proc-root", "/proc", "host /proc, for boot id, device majors and MIG minors, and the GPU processes' cgroups (--telemetry-processes; the plugin then runs with hostPID)")
	env("proc-root", "PROC_ROOT")
	fs.StringVar(&o.podUID, "pod-uid", "", "this pod's UID, from the downward API: enables rolling updates")
	env("pod-uid", "POD_UID")
	fs.StringVar(&o.metricsAddr, "metrics-address", ":9477", "serves /metrics and /healthz (the liveness probe dials the plugin's sockets); empty disables")
	env("metrics-address", "METRICS_ADDRESS")
	fs.BoolVar(&o.metricsAuth, "metrics-auth", true, "serve /metrics (claims, pods and containers by name) only to callers whose bearer token the API server accepts (TokenReview) and whom RBAC lets get the non-resource URL /metrics (SubjectAccessReview); needs create on tokenreviews and subjectaccessreviews; /healthz stays open to the probes; false: anyone who reaches the port reads who runs what")
	env("metrics-auth", "METRICS_AUTH")
	fs.BoolVar(&o.metricsTLS, "metrics-tls", true, "serve --metrics-address over HTTPS, with a self-signed certificate made at start in memory (scrape with insecureSkipVerify): bearer tokens are not readable on the pod network; false: plain HTTP")
	env("metrics-tls", "METRICS_TLS")
	fs.Float64Var(&o.qps, "kube-api-qps", 100, "API client QPS: a prepare makes one request (the claim read), two for a shared device; client-go's default of 5 would queue prepares")
	env("kube-api-qps", "KUBE_API_QPS")
	fs.IntVar(&o.burst, "kube-api-burst", 300, "API client burst: covers a whole node's pods (110, two requests each) starting at once")
	env("kube-api-burst", "KUBE_API_BURST")
	fs.StringVar(&o.migDevices, "mig-devices", slicebuilder.MigPolicyExisting, "which MIG devices a GPU in MIG mode publishes: existing (only MIG devices that exist, made with nvidia-smi or a MIG manager), profiles=<profile>,... (those profiles' placements, created at prepare, plus what exists), or all (every placement of every profile, created at prepare); see docs/scale.md for what each costs kube-scheduler")
	env("mig-devices", "MIG_DEVICES")
	fs.BoolVar(&o.fractional, "fractional-gpus", false, "publish whole GPUs with MIG off as shareable by several claims (consumable capacity), each share capped with MPS; needs the FractionalGPUs and MPSSharing feature gates")
	env("fractional-gpus", "FRACTIONAL_GPUS")
	fs.BoolVar(&o.dcgmExporterAttributes, "dcgm-exporter-attributes", false, "publish on each MIG device the attribute dcgm-exporter reads (profile) as well; it makes a MIG device's attributes outgrow a small map in kube-scheduler, which costs about 60% more slice memory at 1,000 nodes in MIG mode (docs/scale.md)")
	env("dcgm-exporter-attributes", "DCGM_EXPORTER_ATTRIBUTES")
	fs.StringVar(&o.mpsControl, "mps-control-binary", "", "nvidia-cuda-mps-control: a path under the driver root, or an absolute path outside it; default: nvidia-cuda-mps-control looked for under the driver root in "+strings.Join(drivertools.ToolDirs, ", ")+" (the first binary, else the first script), if it is there")
	env("mps-control-binary", "MPS_CONTROL_BINARY")
	fs.StringVar(&o.mpsServerImage, "mps-server-image", "", "the gpudra image, for MPS server pods (one per GPU with MPS claims, independent of this container); empty: MPS servers run in this container and die with it")
	env("mps-server-image", "MPS_SERVER_IMAGE")
	fs.StringVar(&o.mpsServerServiceAccount, "mps-server-service-account", "", "the ServiceAccount of MPS server pods: one without permissions (the chart's <release>-mps-server); required with --mps-server-image")
	env("mps-server-service-account", "MPS_SERVER_SERVICE_ACCOUNT")
	fs.StringVar(&o.namespace, "namespace", "", "this pod's namespace, where MPS server pods run")
	env("namespace", "POD_NAMESPACE")
	fs.StringVar(&o.hostDriverRoot, "host-driver-root", "/", "the driver root on the host (what --driver-root is a mount of), mounted into MPS server pods")
	env("host-driver-root", "HOST_DRIVER_ROOT")
	fs.StringVar(&o.cdiHook, "nvidia-cdi-hook", "", "the NVIDIA container toolkit's nvidia-cdi-hook on the host: the driver's CDI spec then updates the container's ld cache and makes the driver's symlinks; empty: no hooks, the libraries are mounted under their sonames too")
	env("nvidia-cdi-hook", "NVIDIA_CDI_HOOK")
	fs.StringVar(&o.nvidiaSMI, "nvidia-smi", "", "nvidia-smi, for time slices: a path under the driver root, or an absolute path outside it; default: nvidia-smi looked for under the driver root as --mps-control-binary's default is")
	env("nvidia-smi", "NVIDIA_SMI")
	fs.StringVar(&o.taintEffect, "unhealthy-taint-effect", "NoSchedule", "taint on the devices of an unhealthy GPU: NoSchedule keeps new claims off, NoExecute also evicts the pods using them")
	env("unhealthy-taint-effect", "UNHEALTHY_TAINT_EFFECT")
	component.Uint64ListVar(fs, &o.healthIgnoredXIDs, "health-ignored-xids", slices.Sorted(maps.Keys(nvdevice.ApplicationXIDs)),
		"XIDs that never make a GPU unhealthy (errors of the application, not of the GPU), comma-separated; --health-ignored-xids= (empty) ignores none")
	env("health-ignored-xids", "HEALTH_IGNORED_XIDS")
	fs.DurationVar(&o.telemetryInterval, "telemetry-interval", telemetry.DefaultInterval, "how often the devices' telemetry (gpudra_gpu_* on /metrics) is read through the backend, one pass over every device; scrapes get the last pass and never read NVML; 0 disables telemetry")
	env("telemetry-interval", "TELEMETRY_INTERVAL")
	fs.BoolVar(&o.telemetryProcesses, "telemetry-processes", true, "attribute the devices' GPU processes to the pods' containers that hold the devices (gpudra_device_pod_info, gpudra_container_gpu_*; docs/metrics.md), both modes: reads the kubelet's pod-resources API (--pod-resources-socket), the processes' cgroups under --proc-root (the host's PID namespace: hostPID) and the link names in --container-log-dir; false: no pod or container series")
	env("telemetry-processes", "TELEMETRY_PROCESSES")
	fs.StringVar(&o.containerLogDir, "container-log-dir", "/var/log/containers", "the kubelet's container log links (<pod>_<namespace>_<container>-<id>.log), whose names tell which container ID is which pod's container (--telemetry-processes); only the names are read")
	env("container-log-dir", "CONTAINER_LOG_DIR")
	fs.StringVar(&o.mode, "mode", modeDRA, "dra: the DRA kubelet plugin; device-plugin: the classic device plugin (nvidia.com/gpu, MIG and shared resources) for clusters without DRA. A node runs one mode: each refuses to start while the other still has GPUs handed out on the node")
	env("mode", "MODE")
	fs.StringVar(&o.devicePluginConfig, "device-plugin-config", "", "device plugin mode: a config file in the shape of NVIDIA's k8s-device-plugin config (version v1: flags.migStrategy, flags.plugin.deviceListStrategy and deviceIDStrategy, sharing.timeSlicing, sharing.mps; docs/device-plugin.md); empty: NVIDIA's defaults (migStrategy none: every GPU whole, MIG mode or not; deviceListStrategy envvar: NVIDIA_VISIBLE_DEVICES plus the device nodes, mounts and variables of the CDI specs), no sharing")
	env("device-plugin-config", "DEVICE_PLUGIN_CONFIG")
	fs.StringVar(&o.gpuResourceName, "gpu-resource-name", deviceplugin.DefaultGPUResourceName, "device plugin mode: the extended resource of whole GPUs")
	env("gpu-resource-name", "GPU_RESOURCE_NAME")
	fs.StringVar(&o.devicePluginDir, "device-plugin-dir", "/var/lib/kubelet/device-plugins", "device plugin mode: the kubelet's device plugin directory (its socket and ours)")
	env("device-plugin-dir", "DEVICE_PLUGIN_DIR")
	fs.StringVar(&o.localStateDir, "local-state-dir", local.DefaultStateDir, "gpudra local's state on this machine: the plugin refuses to start while it holds or queues allocations there")
	fs.StringVar(&o.podResourcesSocket, "pod-resources-socket", deviceplugin.DefaultPodResourcesSocket, "the kubelet's pod-resources API: which pods hold GPUs through a device plugin (DRA mode refuses to start while any does; device plugin mode keeps the MPS servers of replicas in use), where it does not exist, --kubelet-device-checkpoint is read instead; and which containers hold which device, for --telemetry-processes")
	env("pod-resources-socket", "POD_RESOURCES_SOCKET")
	env("local-state-dir", "LOCAL_STATE_DIR")
	fs.StringVar(&o.kubeletDeviceCheckpoint, "kubelet-device-checkpoint", deviceplugin.DefaultKubeletCheckpoint, "the kubelet device manager's checkpoint, read only where --pod-resources-socket does not exist (it keeps a deleted pod's devices until the kubelet's next device plugin allocation)")
	env("kubelet-device-checkpoint", "KUBELET_DEVICE_CHECKPOINT")
	return o
}

// The node agent's modes (--mode).
const (
	modeDRA          = "dra"
	modeDevicePlugin = "device-plugin"
)

// validate checks what the flag parser cannot: required values, values
// that depend on each other, and the feature gates the flags need.
func (o *options) validate(gates featuregate.FeatureGate) error {
	var errs []error
	if o.nodeName == "" {
		errs = append(errs, errors.New("--node-name (env NODE_NAME) is required"))
	}
	if o.mpsServerImage != "" && o.namespace == "" {
		errs = append(errs, errors.New("--mps-server-image needs --namespace (env POD_NAMESPACE): the namespace of the MPS server pods"))
	}
	if o.mpsServerImage != "" && o.mpsServerServiceAccount == "" {
		errs = append(errs, errors.New("--mps-server-image needs --mps-server-service-account (env MPS_SERVER_SERVICE_ACCOUNT): the ServiceAccount, without permissions, that MPS server pods run as"))
	}
	if e := resourceapi.DeviceTaintEffect(o.taintEffect); e != resourceapi.DeviceTaintEffectNoSchedule && e != resourceapi.DeviceTaintEffectNoExecute {
		errs = append(errs, fmt.Errorf("--unhealthy-taint-effect: %q is not NoSchedule or NoExecute", o.taintEffect))
	}
	if o.backend != "nvml" && o.backend != "sim" {
		errs = append(errs, fmt.Errorf("--backend: unknown backend %q, want nvml or sim", o.backend))
	}
	switch o.mode {
	case modeDRA, modeDevicePlugin:
	default:
		errs = append(errs, fmt.Errorf("--mode (env MODE): unknown mode %q, want %s or %s", o.mode, modeDRA, modeDevicePlugin))
	}
	if err := deviceplugin.ValidResourceName(o.gpuResourceName); err != nil {
		errs = append(errs, fmt.Errorf("--gpu-resource-name (env GPU_RESOURCE_NAME): %w", err))
	}
	if o.mode == modeDevicePlugin && o.devicePluginDir == "" {
		errs = append(errs, errors.New("--device-plugin-dir (env DEVICE_PLUGIN_DIR) is required in device plugin mode"))
	}
	if o.telemetryInterval < 0 {
		errs = append(errs, fmt.Errorf("--telemetry-interval (env TELEMETRY_INTERVAL): %v is negative (0 disables telemetry)", o.telemetryInterval))
	}
	if o.telemetryInterval > 0 && o.telemetryProcesses {
		for _, p := range []struct{ flag, env, value string }{
			{"pod-resources-socket", "POD_RESOURCES_SOCKET", o.podResourcesSocket},
			{"proc-root", "PROC_ROOT", o.procRoot},
			{"container-log-dir", "CONTAINER_LOG_DIR", o.containerLogDir},
		} {
			if !filepath.IsAbs(p.value) {
				errs = append(errs, fmt.Errorf("--%s (env %s): %q is not an absolute path; --telemetry-processes (on) needs it to attribute GPU processes to containers (--telemetry-processes=false turns that off)", p.flag, p.env, p.value))
			}
		}
	}
	if _, err := slicebuilder.ParseMigPolicy(o.migDevices); err != nil {
		errs = append(errs, fmt.Errorf("--mig-devices (env MIG_DEVICES): %w", err))
	}
	if err := (plugin.Config{FractionalGPUs: o.fractional, FeatureGates: gates}).CheckFeatures(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// attribution is the telemetry's process attribution config (SetAttribution),
// nil when --telemetry-processes is off.
func (o *options) attribution() *telemetry.AttributionConfig {
	if !o.telemetryProcesses {
		return nil
	}
	return &telemetry.AttributionConfig{PodResourcesSocket: o.podResourcesSocket, ProcRoot: o.procRoot, ContainerLogDir: o.containerLogDir}
}

// startAttribution turns on c's process attribution where the flags ask
// for it; c may be nil (no telemetry).
func (o *options) startAttribution(c *telemetry.Collector) {
	if a := o.attribution(); c != nil && a != nil {
		c.SetAttribution(*a)
	}
}
