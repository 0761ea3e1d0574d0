// Package nodeagent is a simulated GPU node's agent: what the kubelet and
// the chart's plugin DaemonSet pod do on a real node. Its kubelet is built
// on the kubelet's own code where it matters: the plugin manager registers
// DRA plugins from the registry directory, the DRA manager prepares and
// unprepares claims over dra/v1, the device manager serves device plugins,
// and the pod-resources server is the kubelet's. Devcluster's own part is
// the pod lifecycle around them (kubelet.go, containers.go: syncing pods,
// starting their containers in the node's runtime, package noderuntime;
// process pods, processpods.go) and the node's status. Beside the kubelet
// it runs the real gpudra kubelet plugin (nodeplugin.go: instances, rolling
// updates, kills) or the classic device plugin (deviceplugin.go), the
// node's telemetry (telemetry.go) and a metrics pod that stands in for the
// plugin's pod (metricspod.go). What is simulated is the GPUs: a
// sim.Machine with its driver root and real device nodes (nodedriver.go),
// or a real backend's for gpu-smoke.
package nodeagent

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	restclient "k8s.io/client-go/rest"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/devcluster/noderuntime"
	"github.com/gpudra/gpudra/pkg/deviceplugin"
	"github.com/gpudra/gpudra/pkg/kubeclient"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/plugin"
	"github.com/gpudra/gpudra/pkg/sharing"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
	"github.com/gpudra/gpudra/pkg/telemetry"
)

// NodeOptions describe a simulated GPU node.
type NodeOptions struct {
	Name string
	// Machine is a builtin simulated machine (dgx-h100, h100-pcie, ...) or
	// the path of a machine spec YAML file. Default dgx-h100.
	Machine string
	// Labels and Annotations are added to the Node.
	Labels      map[string]string
	Annotations map[string]string
	// Taints are set on the Node.
	Taints []v1.Taint
	// ProviderID is the Node's spec.providerID: the cloud's machine
	// (devcluster/cloud) an autoscaler matches it with. Empty: none.
	ProviderID string
	// UnhealthyTaintEffect is the plugin's --unhealthy-taint-effect
	// (default NoSchedule).
	UnhealthyTaintEffect resourceapi.DeviceTaintEffect
	// FractionalGPUs runs the plugin with --fractional-gpus: whole GPUs
	// with MIG off are shared by several claims (consumable capacity).
	FractionalGPUs bool
	// Mode is the node agent's mode: ModeDRA (empty) runs the DRA kubelet
	// plugin, ModeDevicePlugin runs the classic device plugin
	// (pkg/deviceplugin) and the kubelet's real device manager
	// (deviceplugin.go); DevicePluginConfig and GPUResourceName are its
	// config file and whole-GPU resource name (nil, empty: defaults).
	Mode               string
	DevicePluginConfig *deviceplugin.Config
	GPUResourceName    string
	// MaxPods is the Node's pod capacity, as the kubelet's --max-pods
	// sets it; 0: 110, the kubelet's default.
	MaxPods int
	// Runtime runs the node's pods' containers as real containers (runc,
	// with the probe as their process; process pods excepted). nil: their
	// OCI specs are only resolved. Where it cannot run here (not root),
	// the node says so in one line and only resolves.
	Runtime *noderuntime.OCIRuntime
	// Backend, when set, is the node's GPUs instead of a simulated machine
	// (Machine is then unused and Node.Machine nil): NVML on a real GPU,
	// for make gpu-smoke. DriverRoot is then where its driver is installed
	// ("/" when empty), and the node's device nodes are the host's /dev.
	Backend    nvdevice.Interface
	DriverRoot string
	// DriverStandIns put working stand-ins for libcuda and nvidia-smi into
	// a simulated machine's driver root (gpu-smoke --simulated); the zero
	// value leaves them empty files.
	DriverStandIns sim.DriverStandIns
	// MigDevices is the plugin's MIG policy; nil: every placement
	// (devcluster creates MIG instances on demand), as the demo needs.
	MigDevices *slicebuilder.MigPolicy
}

// A simulated node's capacity besides its GPUs: a DGX H100's.
const (
	NodeCPU              = "224"
	NodeMemory           = "2Ti"
	NodeEphemeralStorage = "30Ti"
)

// Node is a simulated GPU node: a Node object, the simulated machine, the
// real gpudra kubelet plugin over it, and the devcluster kubelet.
type Node struct {
	Name string
	// Machine is the simulated machine; nil on a node with a real
	// Backend (NodeOptions.Backend).
	Machine *sim.Machine
	// backend is the node's GPUs: Machine, or NodeOptions.Backend.
	backend nvdevice.Interface
	// driverRoot is the host directory the plugin's driver root is.
	driverRoot string
	// Dir holds the node's registry, plugin, CDI and kubelet directories.
	Dir string

	ctx context.Context
	// stop ends the node's own context: its kubelet, pods and plugin
	// (Stop), as a machine's shutdown does.
	stop       context.CancelFunc
	client     kubernetes.Interface
	pluginCfg  plugin.Config
	bootID     string
	kubeletEnd <-chan struct{}
	// mode is ModeDRA or ModeDevicePlugin; dpOpts are the device plugin's
	// resource options and dp its running instance (device-plugin mode).
	mode          string
	dpOpts        deviceplugin.ResourceOptions
	kubeletClient kubernetes.Interface

	mu sync.Mutex
	// fromImage: the node's plugin is the chart's pod run from the image
	// (imagemode.Options), not an instance in this process.
	fromImage bool
	// current is the running plugin instance, nil while stopped.
	current *PluginInstance
	// starts counts plugin starts: each start is a new plugin pod, with its
	// own pod UID (and sockets), as in the chart's DaemonSet.
	starts int
	dp     *devicePluginInstance
	// metrics, telemetry and health are the node's telemetry
	// (telemetry.go), in either mode.
	metrics   *prometheus.Registry
	telemetry *telemetry.Collector
	health    *telemetry.HealthMetrics
}

// KubeletDone is closed once the node's kubelet has stopped (the
// cluster's context ended, or Stop).
func (n *Node) KubeletDone() <-chan struct{} { return n.kubeletEnd }

// RegistryDir is the kubelet's plugin registry, where plugins put their
// registration sockets: <kubeletDir>/plugins_registry, as the chart mounts
// it, with the node's directory as the kubelet's.
func (n *Node) RegistryDir() string { return filepath.Join(n.Dir, "plugins_registry") }

// CDIDir is where the node's plugin writes CDI specs.
func (n *Node) CDIDir() string { return filepath.Join(n.Dir, "cdi") }

// ContainerLogDir is the node's /var/log/containers: the kubelet's links
// <pod>_<namespace>_<container>-<container id>.log to its containers' logs
// (below the node's var/log/pods), for as long as each container runs.
func (n *Node) ContainerLogDir() string { return filepath.Join(n.Dir, "var", "log", "containers") }

// DevDir is the simulated machine's /dev (sim.Machine.WriteDevNodes):
// real character devices with NVIDIA's majors and minors, where mknod is
// allowed.
func (n *Node) DevDir() string { return filepath.Join(n.Dir, "dev") }

// DriverRoot is the node's fake driver root (sim.WriteDriverRoot).
func (n *Node) DriverRoot() string { return filepath.Join(n.Dir, "driver") }

// SharingOptions are where and how the node's agent runs its MPS servers
// (plugin.Config.SharingOptions): server pods made as the plugin makes them.
func (n *Node) SharingOptions() sharing.Options { return n.pluginCfg.SharingOptions() }

// Backend is the node's GPUs: its simulated Machine, or
// NodeOptions.Backend.
func (n *Node) Backend() nvdevice.Interface { return n.backend }

// PluginDataDir is the plugin's socket and checkpoint directory.
// It is where the chart puts it below the kubelet's directory
// (<kubeletDir>/plugins/gpu.gpudra.dev) with the node's directory as the
// kubelet's, as devcluster renders the chart (chart.Render): its admission
// policy pins the same paths.
func (n *Node) PluginDataDir() string { return filepath.Join(n.Dir, "plugins", "gpu.gpudra.dev") }

// Cluster is what a node needs of the cluster it joins, at the points of
// its start where a kubelet and the chart's DaemonSet reach the cluster.
type Cluster interface {
	// CreateNode creates the Node object, Ready, with the options'
	// labels, annotations, taints and pod capacity.
	CreateNode(ctx context.Context, opts NodeOptions) error
	// KubeletClient is the node's kubelet client: the kubelet's own
	// identity (system:node:<node>).
	KubeletClient(node string) (kubernetes.Interface, error)
	// NodeComponentConfig is the client configuration of a component of
	// the node: the chart's ServiceAccount sa with a token bound to the
	// Node named node.
	NodeComponentConfig(ctx context.Context, sa, userAgent, node string) (*restclient.Config, error)
	// RunPluginPod runs the chart's plugin pod for the node from the
	// image (Env.Image).
	RunPluginPod(ctx context.Context, n *Node) error
}

// Env is what every node of a cluster shares.
type Env struct {
	Cluster Cluster
	// Ctx is the cluster's: the node's kubelet, plugin and telemetry run
	// until it ends.
	Ctx context.Context
	// Dir is the cluster's directory; a node's is Dir/nodes/<name>.
	Dir    string
	BootID string
	// Admin is the harness's client, for what devcluster records and no
	// kubelet writes (the containers a pod got, the metrics pod).
	Admin kubernetes.Interface
	// MPSControlBinary is the nvidia-cuda-mps-control stand-in
	// (devcluster.Options.MPSControlBinary); empty: no MPS.
	MPSControlBinary string
	// Runtime is the nodes' default container runtime
	// (NodeOptions.Runtime overrides it); nil: specs are only resolved.
	Runtime *noderuntime.OCIRuntime
	// Image: the node's plugin is the chart's pod run from the image
	// (Cluster.RunPluginPod), not an instance in this process.
	Image bool
	// PodNetwork gives the pods served in this process (the metrics pod)
	// their address; nil: the machine's own (ProxyableHostIP).
	PodNetwork PodNetwork
	// PluginPodOwner owns the node's plugin pod (the metrics pod): the
	// chart's DaemonSet; nil: none.
	PluginPodOwner *metav1.OwnerReference
}

// PodNetwork is where devcluster's in-process pods listen
// (devcluster/podnetwork).
type PodNetwork interface {
	Listen() (net.Listener, error)
}

// Start lays out the node's directories and driver, creates the Node
// object, and starts the kubelet, then the plugin (or the device plugin)
// over the simulated machine or the node's real backend. opts has its
// defaults (Machine, Mode) filled in.
func Start(ctx context.Context, env Env, opts NodeOptions) (*Node, error) {
	n := &Node{Name: opts.Name, Dir: filepath.Join(env.Dir, "nodes", opts.Name), ctx: env.Ctx, bootID: env.BootID,
		mode: opts.Mode, dpOpts: deviceplugin.ResourceOptions{GPUResourceName: opts.GPUResourceName, Config: opts.DevicePluginConfig}}
	var machine *sim.Machine
	if opts.Backend != nil {
		n.backend, n.driverRoot = opts.Backend, opts.DriverRoot
		if n.driverRoot == "" {
			n.driverRoot = "/"
		}
	} else {
		m, err := sim.NewBuiltin(opts.Machine, opts.Name)
		if err != nil {
			return nil, fmt.Errorf("node %s: %w", opts.Name, err)
		}
		machine, n.Machine, n.backend, n.driverRoot = m, m, m, n.DriverRoot()
	}
	for _, d := range []string{n.CDIDir(), n.PluginDataDir(), n.RegistryDir(), filepath.Join(n.Dir, "kubelet"), n.DevicePluginDir()} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return nil, err
		}
	}
	drv, err := setUpDriver(ctx, n, machine, opts, env.MPSControlBinary)
	if err != nil {
		return nil, fmt.Errorf("node %s: %w", opts.Name, err)
	}
	mpsControl, hostDriverRoot := drv.mpsControl, drv.hostDriverRoot
	if err := env.Cluster.CreateNode(ctx, opts); err != nil {
		return nil, err
	}

	// The kubelet first, as on a real node: the plugin registers with it.
	// Everything of the node lives in a context of its own, so that the
	// node can go away alone (Stop: a cloud's machine terminated).
	runCtx, stop := context.WithCancel(env.Ctx)
	n.stop = stop
	logger := klog.LoggerWithValues(klog.FromContext(env.Ctx), "node", opts.Name)
	nodeCtx := klog.NewContext(runCtx, logger)
	kubeletClient, err := env.Cluster.KubeletClient(opts.Name)
	if err != nil {
		return nil, err
	}
	dirs := kubeletDirs{
		Registry: n.RegistryDir(), State: filepath.Join(n.Dir, "kubelet"), CDI: n.CDIDir(),
		Devices: drv.devices, HostDevices: drv.hostDevices, DevRoot: drv.devRoot}
	// A kubelet has a device manager and serves its pod-resources API
	// whatever the node's mode, so that a node can switch modes
	// (SwitchMode).
	dirs.DevicePlugins, dirs.PodResources = n.DevicePluginDir(), n.PodResourcesSocket()
	dirs.Logs = filepath.Dir(n.ContainerLogDir())
	// Containers' declared loads go to the node's GPUs where they are
	// simulated (a Machine, or a Backend that is one).
	if sims, ok := n.backend.(simProcesses); ok {
		dirs.Processes = sims
	}
	if opts.Runtime == nil {
		opts.Runtime = env.Runtime
	}
	if opts.Runtime != nil {
		if err := opts.Runtime.Usable(); err != nil {
			klog.FromContext(ctx).Info("Containers are not run, their OCI specs only resolved", "node", opts.Name, "reason", err.Error())
		} else {
			rt := *opts.Runtime
			if rt.Root == "" {
				rt.Root = filepath.Join(n.Dir, "runc")
			}
			dirs.Runtime = &rt
		}
	}
	_, n.kubeletEnd, err = startKubelet(nodeCtx, opts.Name, kubeletClient, env.Admin, dirs)
	if err != nil {
		return nil, err
	}
	n.kubeletClient = kubeletClient

	// The plugin's own client (core and resource groups only), as the
	// binary builds it, so that a call to any other group fails here; as
	// the chart's ServiceAccount with a token bound to this Node, as the
	// DaemonSet's pod has one.
	pluginCfg, err := env.Cluster.NodeComponentConfig(ctx, chart.PluginServiceAccount, "gpudra-kubelet-plugin/"+opts.Name, opts.Name)
	if err != nil {
		return nil, err
	}
	pluginCfg.QPS, pluginCfg.Burst = 100, 300
	pluginClient, err := kubeclient.NewForConfig(pluginCfg)
	if err != nil {
		return nil, err
	}
	n.client = pluginClient
	n.ctx = nodeCtx
	n.pluginCfg = plugin.Config{
		NodeName: opts.Name, Backend: n.backend, Client: pluginClient,
		RegistrarDir: n.RegistryDir(), PluginDataDir: n.PluginDataDir(), CDIDir: n.CDIDir(),
		// The machine is also the node's host: device majors, capability
		// minors and the time slicer come from its Host.
		BootID: env.BootID, FractionalGPUs: opts.FractionalGPUs, MPSControlBinary: mpsControl,
		UnhealthyTaintEffect: opts.UnhealthyTaintEffect,
		// MPS servers run as pods, which the devcluster kubelet runs
		// (processpods.go), so that they outlive the plugin's container.
		Namespace: chart.PluginNamespace, MPSServerImage: chart.MPSServerImage, MPSServerServiceAccount: chart.MPSServerServiceAccount,
		HostDriverRoot: hostDriverRoot,
		// Every MIG placement, created at prepare (the demo and the MIG
		// examples create instances on demand), where the chart's default
		// is existing (docs/scale.md); a Node annotation still overrides it.
		MigDevices: slicebuilder.MigPolicy{},
	}
	if opts.MigDevices != nil {
		n.pluginCfg.MigDevices = *opts.MigDevices
	}
	if err := n.startTelemetry(ctx); err != nil {
		return nil, err
	}
	if env.Image {
		// The chart's own plugin pod, from the image, in place of the
		// in-process plugin and its metrics pod.
		n.fromImage = true
		if err := env.Cluster.RunPluginPod(nodeCtx, n); err != nil {
			return nil, fmt.Errorf("node %s: %w", opts.Name, err)
		}
	} else {
		// Without it only the dashboard's usage through the pods proxy is
		// missing (TestPluginMetricsThroughTheAPIServerProxy says so): not a
		// reason to refuse the node, on a machine with no global address.
		if err := n.serveMetricsPod(ctx, env.Admin, env.PodNetwork, pluginCfg, env.PluginPodOwner); err != nil {
			klog.FromContext(ctx).Error(err, "No metrics pod: the node's telemetry is not reachable through the API server's pods proxy", "node", n.Name)
		}
		if err := n.StartPlugin(); err != nil {
			return nil, err
		}
	}
	return n, nil
}

// WaitForSlices waits until the API server holds every ResourceSlice the
// node's plugin means to publish.
//
// In device-plugin mode it waits for the device plugin's resources
// instead (WaitForDevicePlugin).
func (n *Node) WaitForSlices(ctx context.Context) error {
	if n.Mode() == ModeDevicePlugin {
		return n.WaitForDevicePlugin(ctx)
	}
	if n.fromImage {
		return n.waitForPublishedPool(ctx)
	}
	p := n.Plugin()
	if p == nil {
		return fmt.Errorf("node %s: plugin is not running", n.Name)
	}
	res, _, err := p.Driver.Resources(ctx)
	if err != nil {
		return fmt.Errorf("node %s: %w", n.Name, err)
	}
	want := 0
	for _, pool := range res.Pools {
		want += len(pool.Slices)
	}
	return wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		slices, err := n.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		got := 0
		for _, s := range slices.Items {
			if s.Spec.Pool.Name == n.Name && s.Spec.Driver == slicebuilder.DriverName {
				got++
			}
		}
		return got == want, nil
	})
}

// waitForPublishedPool waits until the node's pool is published whole,
// as many slices of its newest generation as each of them counts: what
// the plugin run from the image published (it is not in this process to
// ask what it will publish).
func (n *Node) waitForPublishedPool(ctx context.Context) error {
	var last string
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 120*time.Second, true, func(ctx context.Context) (bool, error) {
		slices, err := n.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil {
			last = err.Error()
			return false, nil
		}
		var gen int64
		byGen := map[int64]int64{}
		want := map[int64]int64{}
		for _, s := range slices.Items {
			if s.Spec.Pool.Name != n.Name || s.Spec.Driver != slicebuilder.DriverName {
				continue
			}
			byGen[s.Spec.Pool.Generation]++
			want[s.Spec.Pool.Generation] = s.Spec.Pool.ResourceSliceCount
			gen = max(gen, s.Spec.Pool.Generation)
		}
		last = fmt.Sprintf("generation %d: %d of %d slices", gen, byGen[gen], want[gen])
		return byGen[gen] > 0 && byGen[gen] == want[gen], nil
	})
	if err != nil {
		return fmt.Errorf("node %s: the plugin's pool is not published (%s): %w", n.Name, last, err)
	}
	return nil
}

// FractionalNode describes a node whose plugin runs with --fractional-gpus,
// labelled gpu.gpudra.dev/fractional=true and tainted so that only pods
// that ask for a share (and tolerate the taint) land there.
func FractionalNode(name, machine string) NodeOptions {
	return NodeOptions{Name: name, Machine: machine, FractionalGPUs: true,
		Labels: map[string]string{"gpu.gpudra.dev/fractional": "true"},
		Taints: []v1.Taint{{Key: "gpu.gpudra.dev/fractional", Value: "true", Effect: v1.TaintEffectNoSchedule}}}
}

// Stop shuts the node down as a terminated machine goes: its plugin, then
// its kubelet, which stops the node's containers and processes. The Node
// object, its pods and claims stay in the API, for whoever manages the
// node (an autoscaler, an admin) to remove. It waits up to 30 s for the
// kubelet; a second Stop does nothing more.
func (n *Node) Stop() {
	n.StopPlugin()
	if n.stop == nil {
		return
	}
	n.stop()
	if n.kubeletEnd == nil {
		return
	}
	select {
	case <-n.kubeletEnd:
	case <-time.After(30 * time.Second):
		klog.FromContext(n.ctx).Info("The node's kubelet did not stop within 30 s", "node", n.Name)
	}
}
