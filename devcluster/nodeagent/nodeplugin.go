package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"

	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/devcluster/noderuntime"
	"github.com/gpudra/gpudra/pkg/deviceplugin"
	"github.com/gpudra/gpudra/pkg/plugin"
)

// A node's kubelet plugin in this process: its instances (a plugin pod
// each), started, stopped, rolled and killed as the chart's DaemonSet and
// a node's crashes would.

// PluginInstance is one running plugin pod of a node.
type PluginInstance struct {
	Plugin *plugin.Plugin
	PodUID string
	// ContainerID marks every process the instance starts (see
	// noderuntime.ContainerMarker): PodUID and the cluster's boot id, since plugin pod
	// UIDs repeat across devclusters on one machine.
	ContainerID string
	cancel      context.CancelCauseFunc
}

// DRASocket is the instance's DRA gRPC socket, where the kubelet calls it.
func (i *PluginInstance) DRASocket() string { return i.Plugin.Sockets[0] }

// Stop stops the instance as its pod's termination would.
func (i *PluginInstance) Stop() {
	i.Plugin.Stop()
	i.cancel(errors.New("plugin pod terminated"))
}

// KillContainer stops the instance and kills every process it started, as
// the end of its container (its PID namespace) does on a real node: MPS
// daemons it ran as children go, MPS server pods do not. It returns how
// many processes were killed.
func (i *PluginInstance) KillContainer() (int, error) {
	i.Stop()
	killed, err := noderuntime.KillContainerProcesses(i.ContainerID)
	if err != nil {
		return killed, fmt.Errorf("plugin pod %s: %w", i.PodUID, err)
	}
	return killed, nil
}

// Plugin is the node's running plugin, nil while stopped.
func (n *Node) Plugin() *plugin.Plugin {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.current == nil {
		return nil
	}
	return n.current.Plugin
}

// PluginInstance is the node's running plugin instance, nil while stopped.
func (n *Node) PluginInstance() *PluginInstance {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.current
}

// StartPlugin starts the node's kubelet plugin (again, after StopPlugin).
func (n *Node) StartPlugin() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.fromImage {
		return fmt.Errorf("node %s: its plugin is the chart's pod run from the image, not one of this process", n.Name)
	}
	if n.mode == ModeDevicePlugin {
		return n.startDevicePluginLocked()
	}
	if n.current != nil {
		return fmt.Errorf("node %s: plugin is running", n.Name)
	}
	// As the node agent does: never while the kubelet's pod-resources API
	// lists pods holding GPUs through a device plugin here (a node
	// switched from device-plugin mode).
	if err := deviceplugin.CheckDevicePluginDrained(n.ctx, deviceplugin.DeviceHolders{PodResourcesSocket: n.PodResourcesSocket(),
		KubeletCheckpoint: filepath.Join(n.DevicePluginDir(), filepath.Base(deviceplugin.DefaultKubeletCheckpoint))},
		deviceplugin.OurResourceNames(n.dpOpts.GPUResourceName, n.dpOpts.Config)); err != nil {
		return fmt.Errorf("node %s: %w", n.Name, err)
	}
	if err := deviceplugin.RemoveCDISpecs(n.ctx, n.CDIDir()); err != nil {
		return fmt.Errorf("node %s: %w", n.Name, err)
	}
	inst, err := n.startInstanceLocked()
	if err != nil {
		return err
	}
	n.current = inst
	n.attachClaimsLocked(inst)
	return nil
}

func (n *Node) startInstanceLocked() (*PluginInstance, error) {
	n.starts++
	cfg := n.pluginCfg
	cfg.PodUID = fmt.Sprintf("%s-plugin-%d", n.Name, n.starts)
	containerID := cfg.PodUID + "@" + n.bootID
	// Every process the plugin starts goes through DriverTools and so
	// carries the marker of this instance's container.
	cfg.DriverTools.Env = append(slices.Clip(cfg.DriverTools.Env), noderuntime.ContainerMarker(containerID))
	ctx, cancel := context.WithCancelCause(klog.NewContext(n.ctx, klog.LoggerWithValues(klog.FromContext(n.ctx), "pluginPod", cfg.PodUID)))
	p, err := plugin.Start(ctx, cfg, cancel)
	if err != nil {
		cancel(err)
		return nil, fmt.Errorf("node %s: start plugin: %w", n.Name, err)
	}
	return &PluginInstance{Plugin: p, PodUID: cfg.PodUID, ContainerID: containerID, cancel: cancel}, nil
}

// StartRollingUpdate starts a new plugin instance beside the running one, as
// the DaemonSet's surge does during an upgrade: both serve the node, over
// the same directories, until the caller stops the old one, which is
// returned. The new one becomes the node's Plugin.
func (n *Node) StartRollingUpdate() (*PluginInstance, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.current == nil {
		return nil, fmt.Errorf("node %s: no plugin is running", n.Name)
	}
	old := n.current
	inst, err := n.startInstanceLocked()
	if err != nil {
		return nil, err
	}
	n.current = inst
	n.attachClaimsLocked(inst)
	return old, nil
}

// StopPlugin stops the node's plugin as a crash or an upgrade would: its
// sockets go away, its checkpoint and CDI specs stay.
func (n *Node) StopPlugin() {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.stopDevicePluginLocked()
	if n.current == nil {
		return
	}
	n.current.Plugin.Stop()
	n.current.cancel(errors.New("plugin stopped"))
	n.current = nil
	n.attachClaimsLocked(nil)
}

// SwitchMode stops the node's agent and starts it in mode (ModeDRA or
// ModeDevicePlugin), as labelling the node gpu.gpudra.dev/mode does with
// the chart (the DaemonSet of the old mode leaves the node, the other's
// starts there). The new mode refuses to start, with the agent's error,
// while the old one still has GPUs handed out on the node; the node is
// then left without an agent (the DaemonSet's pod would crash-loop) until
// SwitchMode is called again. The node's kubelet runs both the DRA and the
// device manager, as a real one does, so either way works once drained.
func (n *Node) SwitchMode(mode string) error {
	if mode != ModeDRA && mode != ModeDevicePlugin {
		return fmt.Errorf("node %s: unknown mode %q, want %s or %s", n.Name, mode, ModeDRA, ModeDevicePlugin)
	}
	n.StopPlugin()
	n.mu.Lock()
	n.mode = mode
	n.mu.Unlock()
	return n.StartPlugin()
}

// RestartPlugin stops and starts the plugin over the same directories.
func (n *Node) RestartPlugin() error {
	n.StopPlugin()
	return n.StartPlugin()
}

// KillPluginContainer stops the plugin as StopPlugin does and kills every
// process its container started (see PluginInstance.KillContainer): the
// end of the plugin's container on a real node. It returns how many
// processes were killed; with no plugin running it does nothing.
func (n *Node) KillPluginContainer() (int, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.current == nil {
		return 0, nil
	}
	inst := n.current
	n.current = nil
	n.attachClaimsLocked(nil)
	killed, err := inst.KillContainer()
	if err != nil {
		return killed, fmt.Errorf("node %s: %w", n.Name, err)
	}
	return killed, nil
}

// RestartPluginContainer is KillPluginContainer, then StartPlugin: a
// container restart. It returns how many processes the kill killed.
func (n *Node) RestartPluginContainer() (int, error) {
	killed, err := n.KillPluginContainer()
	if err != nil {
		return killed, err
	}
	return killed, n.StartPlugin()
}
