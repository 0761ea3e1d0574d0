package nodeagent

// Device plugin mode: a node whose agent runs gpudra's classic device
// plugin (pkg/deviceplugin.Serve) instead of the DRA plugin, and whose
// kubelet runs the kubelet's real device manager
// (k8s.io/kubernetes/pkg/kubelet/cm/devicemanager): registration over the
// kubelet socket, ListAndWatch, GetPreferredAllocation, Allocate, its
// checkpoint, and the extended resources it reports for the Node's
// capacity and allocatable. The stand-in runtime resolves the CDI devices
// the device manager hands a container as it resolves DRA's.

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"time"
	_ "unsafe" // go:linkname

	cadvisorapi "github.com/google/cadvisor/lib/model"
	v1 "k8s.io/api/core/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/util/retry"
	"k8s.io/klog/v2"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	"k8s.io/kubernetes/pkg/kubelet/cm/containermap"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager"
	"k8s.io/kubernetes/pkg/kubelet/config"
	"k8s.io/kubernetes/pkg/kubelet/lifecycle"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/gpudra/gpudra/devcluster/noderuntime"
	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/deviceplugin"
	"github.com/gpudra/gpudra/pkg/sharing"
)

// Node agent modes (NodeOptions.Mode).
const (
	ModeDRA          = "dra"
	ModeDevicePlugin = "device-plugin"
)

// DevicePluginModeLabel is set on every node in device-plugin mode, with
// value ModeDevicePlugin; DevicePluginTaintKey is the taint
// DevicePluginNode puts on such a node so that only pods meant for it land
// there.
const (
	DevicePluginModeLabel = "gpu.gpudra.dev/mode"
	DevicePluginTaintKey  = "gpu.gpudra.dev/device-plugin"
)

// nodeStatusInterval is how often the kubelet compares the device
// manager's capacity with the Node's (the real kubelet: every 10 s).
const nodeStatusInterval = 200 * time.Millisecond

// DevicePluginNode describes a node in device-plugin mode, labelled
// gpu.gpudra.dev/mode=device-plugin and tainted so that only pods that
// tolerate DevicePluginTaintKey land there. config may be nil (defaults:
// nvidia.com/gpu, MIG devices per profile, no sharing).
func DevicePluginNode(name, machine string, config *deviceplugin.Config) NodeOptions {
	return NodeOptions{Name: name, Machine: machine, Mode: ModeDevicePlugin, DevicePluginConfig: config,
		Labels: map[string]string{DevicePluginModeLabel: ModeDevicePlugin},
		Taints: []v1.Taint{{Key: DevicePluginTaintKey, Value: "true", Effect: v1.TaintEffectNoSchedule}}}
}

// DevicePluginDir is where the node's kubelet serves its device plugin
// registration socket and the plugins theirs (the node's
// /var/lib/kubelet/device-plugins).
func (n *Node) DevicePluginDir() string { return filepath.Join(n.Dir, "device-plugins") }

// Mode is the node's agent mode: ModeDRA or ModeDevicePlugin.
func (n *Node) Mode() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.mode
}

// newDeviceManager is the device manager's constructor with the
// registration socket as a parameter: the exported NewManagerImpl fixes it
// at /var/lib/kubelet/device-plugins/kubelet.sock (and cleans that
// directory), where nodes of one process would collide. The linker does
// not check the signature: it must match k8s.io/kubernetes v1.37.1's
// (re-check on every k8s.io/kubernetes bump; the e2e suite exercises it).
//
//go:linkname newDeviceManager k8s.io/kubernetes/pkg/kubelet/cm/devicemanager.newManagerImpl
func newDeviceManager(logger klog.Logger, socketPath string, topology []cadvisorapi.Node, store topologymanager.Store) (*devicemanager.ManagerImpl, error)

// noTopology is the topology manager's store under the "none" policy: no
// NUMA affinity for any container, so the device manager filters nothing.
type noTopology struct{}

func (noTopology) GetAffinity(klog.Logger, string, string) topologymanager.TopologyHint {
	return topologymanager.TopologyHint{}
}
func (noTopology) GetPolicy() topologymanager.Policy { return topologymanager.NewNonePolicy() }
func (noTopology) Name() string                      { return "none" }

// deviceManager is the kubelet's device manager with the lock its callers
// hold: the real kubelet admits pods (and so calls Allocate) one at a time.
type deviceManager struct {
	mu sync.Mutex
	m  *devicemanager.ManagerImpl
}

// startDeviceManager creates and starts the device manager as the
// kubelet's container manager does, its registration socket in dir.
func startDeviceManager(logger klog.Logger, dir string, activePods func() []*v1.Pod, sourcesReady config.SourcesReady) (*deviceManager, error) {
	m, err := newDeviceManager(logger, filepath.Join(dir, filepath.Base(pluginapi.KubeletSocket)), nil, noTopology{})
	if err != nil {
		return nil, fmt.Errorf("device manager: %w", err)
	}
	if err := m.Start(logger, devicemanager.ActivePodsFunc(activePods), sourcesReady, containermap.NewContainerMap(), sets.New[string]()); err != nil {
		return nil, fmt.Errorf("start device manager: %w", err)
	}
	return &deviceManager{m: m}, nil
}

// runtimeEdits allocates the container's device plugin resources (the
// kubelet's admission does so for init containers first, then the app
// containers, which containerViews keeps) and returns what the plugins
// answered as the kubelet hands it to the runtime: CDI devices (CdiDevices,
// and the cdi.k8s.io annotations a CDI-enabled containerd reads), device
// nodes, mounts and variables.
func (d *deviceManager) runtimeEdits(ctx context.Context, pod *v1.Pod, c *v1.Container) (noderuntime.RuntimeEdits, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.m.Allocate(ctx, pod, c, lifecycle.AddOperation); err != nil {
		return noderuntime.RuntimeEdits{}, fmt.Errorf("device plugin allocation: %w", err)
	}
	opts, err := d.m.GetDeviceRunContainerOptions(ctx, pod, c)
	if err != nil {
		return noderuntime.RuntimeEdits{}, fmt.Errorf("device plugin container options: %w", err)
	}
	if opts == nil {
		return noderuntime.RuntimeEdits{}, nil
	}
	edits := noderuntime.RuntimeEdits{Devices: opts.Devices, Mounts: opts.Mounts, Envs: opts.Envs}
	for _, dev := range opts.CDIDevices {
		edits.CDIDevices = append(edits.CDIDevices, dev.Name)
	}
	annotations := map[string]string{}
	for _, a := range opts.Annotations {
		annotations[a.Name] = a.Value
	}
	_, names, err := cdiapi.ParseAnnotations(annotations)
	if err != nil {
		return noderuntime.RuntimeEdits{}, fmt.Errorf("device plugin CDI annotations: %w", err)
	}
	edits.CDIDevices = append(edits.CDIDevices, names...)
	return edits, nil
}

// syncNodeStatus keeps the Node's capacity and allocatable in step with the
// device manager's extended resources (kubelet's node status setter for
// device plugin resources) until ctx ends.
func (k *kubelet) syncNodeStatus(ctx context.Context) {
	logger := klog.FromContext(ctx)
	var last, lastAlloc v1.ResourceList
	var lastDeleted []string
	_ = wait.PollUntilContextCancel(ctx, nodeStatusInterval, true, func(ctx context.Context) (bool, error) {
		capacity, allocatable, deleted := k.dm.m.GetCapacity(logger)
		// deleted is reported once: keep it until it is written.
		deleted = append(deleted, lastDeleted...)
		if len(deleted) == 0 && apiequality.Semantic.DeepEqual(capacity, last) && apiequality.Semantic.DeepEqual(allocatable, lastAlloc) {
			return false, nil
		}
		err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
			node, err := k.client.CoreV1().Nodes().Get(ctx, k.node, metav1.GetOptions{})
			if err != nil {
				return err
			}
			node = node.DeepCopy()
			if node.Status.Capacity == nil {
				node.Status.Capacity = v1.ResourceList{}
			}
			if node.Status.Allocatable == nil {
				node.Status.Allocatable = v1.ResourceList{}
			}
			for _, name := range deleted {
				delete(node.Status.Capacity, v1.ResourceName(name))
				delete(node.Status.Allocatable, v1.ResourceName(name))
			}
			for name, q := range capacity {
				node.Status.Capacity[name] = q
				// A resource whose devices are all unhealthy has capacity
				// but no allocatable entry: allocatable is then zero.
				a, ok := allocatable[name]
				if !ok {
					a = *resource.NewQuantity(0, resource.DecimalSI)
				}
				node.Status.Allocatable[name] = a
			}
			_, err = k.client.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{})
			return err
		})
		if err != nil {
			if ctx.Err() == nil {
				logger.Error(err, "Update the Node's device plugin resources")
			}
			lastDeleted = deleted
			return false, nil
		}
		last, lastAlloc, lastDeleted = capacity, allocatable, nil
		logger.V(2).Info("Node device plugin resources updated", "capacity", capacity, "allocatable", allocatable, "removed", deleted)
		return false, nil
	})
}

// devicePluginInstance is the device plugin mode's running agent.
type devicePluginInstance struct {
	cancel context.CancelFunc
	done   chan struct{}
	err    error
}

// startDevicePluginLocked runs deviceplugin.Serve over the node's machine,
// as the node agent's device plugin mode does: the node-wide CDI spec and
// the driver's common spec in the node's CDI directory, one plugin per
// resource registered with the node's kubelet. Like the agent, it refuses
// to start while the node's DRA checkpoint holds prepared claims.
func (n *Node) startDevicePluginLocked() error {
	if n.dp != nil {
		return fmt.Errorf("node %s: device plugin is running", n.Name)
	}
	// As the node agent does: never while DRA claims are prepared here.
	if err := deviceplugin.CheckDRADrained(n.PluginDataDir()); err != nil {
		return fmt.Errorf("node %s: %w", n.Name, err)
	}
	writer, err := cdi.NewWriter(n.CDIDir())
	if err != nil {
		return fmt.Errorf("node %s: %w", n.Name, err)
	}
	files, err := n.backend.DriverFiles(n.ctx)
	if err != nil {
		return fmt.Errorf("node %s: driver files: %w", n.Name, err)
	}
	spec, err := cdi.BuildDriverSpec(files, cdi.DriverOptions{})
	if err != nil {
		return fmt.Errorf("node %s: driver spec: %w", n.Name, err)
	}
	if err := writer.WriteDriver(spec); err != nil {
		return fmt.Errorf("node %s: driver spec: %w", n.Name, err)
	}
	n.starts++
	ctx, cancel := context.WithCancel(klog.NewContext(n.ctx,
		klog.LoggerWithValues(klog.FromContext(n.ctx), "pluginPod", fmt.Sprintf("%s-device-plugin-%d", n.Name, n.starts))))
	inst := &devicePluginInstance{cancel: cancel, done: make(chan struct{})}
	mps, err := n.devicePluginMPS()
	if err != nil {
		cancel()
		return fmt.Errorf("node %s: %w", n.Name, err)
	}
	if err := n.followHealthLocked(ctx); err != nil {
		cancel()
		return err
	}
	opts := deviceplugin.ServeOptions{
		Backend:         n.backend,
		Resources:       deviceplugin.ResourceOptions{GPUResourceName: n.dpOpts.GPUResourceName, Config: n.dpOpts.Config},
		CDI:             writer,
		PluginDir:       n.DevicePluginDir(),
		ExtraCDIDevices: []string{cdi.DriverDeviceID},
		PollInterval:    100 * time.Millisecond,
		MPS:             mps,
	}
	go func() {
		defer close(inst.done)
		inst.err = deviceplugin.Serve(ctx, opts)
		if inst.err != nil && ctx.Err() == nil {
			klog.FromContext(ctx).Error(inst.err, "Device plugin stopped")
		}
	}()
	n.dp = inst
	return nil
}

// devicePluginMPS runs the MPS replicas' servers as the node agent does in
// the chart: server pods (which this node's kubelet runs as processes,
// processpods.go) under the plugin data directory, the fake
// nvidia-cuda-mps-control as the daemon.
func (n *Node) devicePluginMPS() (deviceplugin.MPSOptions, error) {
	opts := deviceplugin.MPSOptions{PodResourcesSocket: n.PodResourcesSocket(),
		KubeletCheckpoint: filepath.Join(n.DevicePluginDir(), filepath.Base(deviceplugin.DefaultKubeletCheckpoint)),
		SuperviseEvery:    time.Second}
	so := n.pluginCfg.SharingOptions()
	if so.MPSControl == nil {
		return opts, nil
	}
	m, err := sharing.NewManager(so)
	if err != nil {
		return opts, err
	}
	opts.MPS = m.MPS()
	return opts, nil
}

// stopDevicePluginLocked stops the device plugin and waits for it.
func (n *Node) stopDevicePluginLocked() {
	if n.dp == nil {
		return
	}
	n.dp.cancel()
	<-n.dp.done
	n.dp = nil
}

// DevicePluginResources are the resources the node's device plugin
// advertises and how many devices each has, healthy or not.
func (n *Node) DevicePluginResources(ctx context.Context) (map[string]int, error) {
	if n.Mode() != ModeDevicePlugin {
		return nil, fmt.Errorf("node %s: not in device-plugin mode", n.Name)
	}
	inv, err := n.backend.Inventory(ctx)
	if err != nil {
		return nil, err
	}
	res, err := deviceplugin.Resources(inv, deviceplugin.ResourceOptions{GPUResourceName: n.dpOpts.GPUResourceName, Config: n.dpOpts.Config})
	if err != nil {
		return nil, err
	}
	out := map[string]int{}
	for _, r := range res {
		out[r.Name] = len(r.Devices)
	}
	return out, nil
}

// WaitForDevicePlugin waits until the Node's allocatable holds every
// resource the node's device plugin advertises, with all its devices: the
// plugins registered with the kubelet's device manager and the kubelet
// reported them.
func (n *Node) WaitForDevicePlugin(ctx context.Context) error {
	want, err := n.DevicePluginResources(ctx)
	if err != nil {
		return err
	}
	var got v1.ResourceList
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		n.mu.Lock()
		dp := n.dp
		n.mu.Unlock()
		if dp != nil {
			select {
			case <-dp.done:
				if dp.err != nil {
					return false, fmt.Errorf("device plugin stopped: %w", dp.err)
				}
				return false, errors.New("device plugin stopped")
			default:
			}
		}
		node, err := n.kubeletClient.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		got = node.Status.Allocatable
		for name, count := range want {
			q, ok := got[v1.ResourceName(name)]
			if !ok || q.Value() != int64(count) {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		return fmt.Errorf("node %s: device plugin resources %v not allocatable (allocatable %v): %w", n.Name, want, got, err)
	}
	return nil
}
