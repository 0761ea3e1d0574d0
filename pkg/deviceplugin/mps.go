package deviceplugin

// MPS replicas (sharing.mps) in the device plugin mode, as NVIDIA's plugin
// serves them: one MPS control daemon per GPU whose replicas are MPS
// clients, running for as long as the node is in this mode rather than per
// pod (the device plugin API says nothing when a container ends), with the
// daemon-wide defaults set to one replica's share
// (set_default_active_thread_percentage 100/replicas,
// set_default_device_pinned_mem_limit 0 <memory/replicas>M) and the same
// figures in every client's environment. The daemons are the DRA side's MPS
// servers (pkg/sharing: pods of their own in the chart, so they outlive
// the agent's container), one per GPU under the same key, so a node that
// switches modes never runs two daemons on one GPU.
//
// A replica's container gets the daemon through a CDI spec of its GPU
// ("device-plugin-mps-gpu-3": the GPU's device nodes plus the pipe
// directory, /dev/shm and the limits), so Allocate still answers with CDI
// names only and a container sees what a DRA MPS claim's container sees.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"k8s.io/klog/v2"
	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/prepared"
	"github.com/gpudra/gpudra/pkg/sharing"
)

// MPSGPU is one GPU whose device IDs are MPS replicas.
type MPSGPU struct {
	// Name is the GPU's DRA device name ("gpu-3").
	Name      string
	UUID      string
	Replicas  int
	MemoryMiB uint64
}

// MPSGPUs are the GPUs the resources replicate with MPS, in device order.
// Pure.
func MPSGPUs(resources []Resource) []MPSGPU {
	var out []MPSGPU
	seen := map[string]bool{}
	for _, r := range resources {
		for _, d := range r.Devices {
			if d.Sharing != MPS || seen[d.GPUUUID] {
				continue
			}
			seen[d.GPUUUID] = true
			out = append(out, MPSGPU{Name: d.Name, UUID: d.GPUUUID, Replicas: d.Replicas, MemoryMiB: d.MemoryMiB})
		}
	}
	return out
}

// Limits are one replica's share: 100/replicas percent of the SMs and
// memory/replicas of pinned device memory.
func (g MPSGPU) Limits() sharing.MPSLimits {
	return sharing.MPSLimits{ThreadPercentage: int64(100 / g.Replicas), PinnedMiB: []int64{int64(g.MemoryMiB) / int64(g.Replicas)}}
}

// Commands set the daemon-wide defaults to one replica's share, so that a
// client that drops the variables from its environment still gets them.
// The daemon serves this GPU only: it is device 0.
func (g MPSGPU) Commands() []string {
	l := g.Limits()
	return []string{
		fmt.Sprintf("set_default_active_thread_percentage %d", l.ThreadPercentage),
		fmt.Sprintf("set_default_device_pinned_mem_limit 0 %dM", l.PinnedMiB[0]),
	}
}

// mpsSpecPrefix starts the pseudo-claim UID of every MPS GPU's CDI spec.
const mpsSpecPrefix = SpecUID + "-mps-"

// MPSSpecUID is the pseudo-claim UID of an MPS GPU's CDI spec.
func MPSSpecUID(deviceName string) string { return mpsSpecPrefix + deviceName }

// MPSCDIDeviceName is the CDI name Allocate answers for an MPS replica of
// the GPU deviceName: "gpu.gpudra.dev/claim=device-plugin-mps-gpu-3-gpu-3".
func MPSCDIDeviceName(deviceName string) string {
	return cdi.QualifiedName(MPSSpecUID(deviceName), deviceName)
}

// BuildMPSCDISpec is the spec of one MPS GPU: its device, as in the
// node-wide spec, plus the clients' edits of its server. Pure.
func BuildMPSCDISpec(dev prepared.Device, edits sharing.Edits, majors cdi.Majors) (*cdispec.Spec, error) {
	claim := cdi.Claim{UID: MPSSpecUID(dev.Device), Devices: []prepared.Device{dev}, Env: edits.Env}
	for _, m := range edits.Mounts {
		claim.Mounts = append(claim.Mounts, cdi.Mount{HostPath: m.HostPath, ContainerPath: m.ContainerPath})
	}
	return cdi.BuildSpec(claim, majors)
}

// MPSOptions run the MPS replicas of the device plugin mode.
type MPSOptions struct {
	// MPS runs the servers (sharing.Manager's MPS); nil: a config with
	// MPS replicas is refused.
	MPS *sharing.MPS
	// PodResourcesSocket is the kubelet's pod-resources socket: a server
	// no longer wanted is stopped only when no container holds a replica
	// of its GPU (DeviceHolders). KubeletCheckpoint, the kubelet's device
	// manager checkpoint, is read instead where the socket does not exist.
	// Both empty: such servers are left running.
	PodResourcesSocket string
	KubeletCheckpoint  string
	// SuperviseEvery spaces the checks that every server still runs; 0:
	// 5 s.
	SuperviseEvery time.Duration
	// OnRestart is told when a server was gone and was started again (or
	// could not be).
	OnRestart func(g MPSGPU, err error)
}

// mpsReplicas is the running MPS side of the device plugin mode.
type mpsReplicas struct {
	opts MPSOptions
	gpus []MPSGPU
}

// startMPS starts (or adopts) the server of every MPS GPU and configures
// it, writes each GPU's CDI spec, removes the specs of GPUs no longer
// shared with MPS, and stops the servers no longer wanted unless a
// container still holds one of their replicas. Nothing is advertised
// before it returns.
func startMPS(ctx context.Context, o MPSOptions, w *cdi.Writer, inv *nvdevice.Inventory, host nvdevice.Host, resources []Resource) (*mpsReplicas, error) {
	logger := klog.FromContext(ctx)
	gpus := MPSGPUs(resources)
	if len(gpus) > 0 && o.MPS == nil {
		return nil, errors.New("sharing.mps: this node has no MPS control binary (--mps-control-binary, or nvidia-cuda-mps-control under the driver root)")
	}
	byName := map[string]prepared.Device{}
	if len(gpus) > 0 {
		// Only then: it reads the MIG capability minors again.
		devices, err := specDevices(inv, host)
		if err != nil {
			return nil, fmt.Errorf("MPS CDI specs: %w", err)
		}
		for _, d := range devices {
			byName[d.Device] = d
		}
	}
	wanted := map[string]bool{}
	for _, g := range gpus {
		s := o.MPS.ServerFor([]string{g.UUID})
		wanted[s.Key] = true
		if _, err := o.MPS.EnsureServer(ctx, s, g.Commands(), true); err != nil {
			return nil, fmt.Errorf("sharing.mps: GPU %s (%s): %w", g.Name, g.UUID, err)
		}
		spec, err := BuildMPSCDISpec(byName[g.Name], o.MPS.ClientEdits(s, g.Limits()), host.Majors)
		if err != nil {
			return nil, fmt.Errorf("sharing.mps: GPU %s: CDI spec: %w", g.Name, err)
		}
		if err := w.Write(MPSSpecUID(g.Name), spec); err != nil {
			return nil, err
		}
		logger.Info("MPS server ready", "gpu", g.Name, "uuid", g.UUID, "replicas", g.Replicas, "server", s.Key, "defaults", g.Commands())
	}
	if err := removeStaleMPSSpecs(w, gpus); err != nil {
		return nil, err
	}
	if o.MPS != nil {
		stopUnwantedMPSServers(ctx, o, wanted)
	}
	return &mpsReplicas{opts: o, gpus: gpus}, nil
}

// removeStaleMPSSpecs removes the MPS specs of GPUs not in gpus (the
// config changed since the last start).
func removeStaleMPSSpecs(w *cdi.Writer, gpus []MPSGPU) error {
	uids, err := w.ClaimUIDs()
	if err != nil {
		return err
	}
	keep := map[string]bool{}
	for _, g := range gpus {
		keep[MPSSpecUID(g.Name)] = true
	}
	var errs []error
	for _, uid := range uids {
		if strings.HasPrefix(uid, mpsSpecPrefix) && !keep[uid] {
			errs = append(errs, w.Remove(uid))
		}
	}
	return errors.Join(errs...)
}

// stopUnwantedMPSServers stops the node's servers that no MPS GPU of this
// config uses (the config changed, or a drained DRA node left one), unless
// the kubelet says a container still holds a replica of one of their GPUs
// (DeviceHolders): stopping a daemon kills its clients' work.
func stopUnwantedMPSServers(ctx context.Context, o MPSOptions, wanted map[string]bool) {
	logger := klog.FromContext(ctx)
	servers, err := o.MPS.Servers(ctx)
	if err != nil {
		logger.Error(err, "List the node's MPS servers; none is stopped")
		return
	}
	holders := DeviceHolders{PodResourcesSocket: o.PodResourcesSocket, KubeletCheckpoint: o.KubeletCheckpoint}
	var held []DevicePluginAllocation
	if holders.Known() {
		held, err = holders.List(ctx, []string{"*"})
		if err != nil {
			logger.Error(err, "Ask the kubelet which containers hold devices; MPS servers no longer wanted are left running")
			return
		}
	}
	for _, s := range servers {
		if wanted[s.Key] {
			continue
		}
		if !holders.Known() {
			logger.Info("MPS server no longer wanted is left running (no kubelet pod-resources socket or checkpoint to tell whether clients remain)", "server", s.Key, "devices", s.Devices)
			continue
		}
		if pod := holder(held, s.Devices); pod != "" {
			logger.Info("MPS server no longer wanted is left running: a container still holds one of its replicas; restart the agent once it has ended",
				"server", s.Key, "devices", s.Devices, "pod", pod)
			continue
		}
		if err := o.MPS.StopServer(ctx, s); err != nil {
			logger.Error(err, "Stop an MPS server no longer wanted", "server", s.Key, "devices", s.Devices)
			continue
		}
		logger.Info("Stopped an MPS server no longer wanted", "server", s.Key, "devices", s.Devices)
	}
}

// holder is the pod holding a replica of one of the devices, or "".
func holder(allocs []DevicePluginAllocation, uuids []string) string {
	for _, a := range allocs {
		for _, id := range a.DeviceIDs {
			for _, u := range uuids {
				if strings.HasPrefix(id, u+ReplicaSeparator) {
					return a.Pod
				}
			}
		}
	}
	return ""
}

// supervise starts again every server that is gone (a daemon that died, a
// server pod someone deleted) and configures it, until ctx is done.
// Clients of a restarted daemon must reconnect, as in DRA mode. A server
// started but not configured (it did not answer in time, or refused a
// command) is configured again at each check until that succeeds: the
// next check finds it running, and a daemon left with no defaults would
// give a client that drops the variables from its environment the whole
// GPU.
func (m *mpsReplicas) supervise(ctx context.Context) {
	if len(m.gpus) == 0 {
		return
	}
	every := m.opts.SuperviseEvery
	if every <= 0 {
		every = 5 * time.Second
	}
	logger := klog.FromContext(ctx)
	t := time.NewTicker(every)
	defer t.Stop()
	// unconfigured are the GPUs whose server's last start or configuration
	// failed, by UUID.
	unconfigured := map[string]bool{}
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for _, g := range m.gpus {
			started, err := m.opts.MPS.EnsureServer(ctx, m.opts.MPS.ServerFor([]string{g.UUID}), g.Commands(), unconfigured[g.UUID])
			if ctx.Err() != nil {
				return
			}
			retried := unconfigured[g.UUID]
			if err != nil {
				unconfigured[g.UUID] = true
			} else {
				delete(unconfigured, g.UUID)
			}
			if !started && err == nil {
				if retried {
					logger.Info("MPS server is configured", "gpu", g.Name, "uuid", g.UUID, "defaults", g.Commands())
				}
				continue
			}
			if err != nil {
				logger.Error(err, "MPS server is gone and could not be started again", "gpu", g.Name, "uuid", g.UUID)
			} else {
				logger.Info("MPS server was gone and was started again; its clients must reconnect", "gpu", g.Name, "uuid", g.UUID)
			}
			if m.opts.OnRestart != nil {
				m.opts.OnRestart(g, err)
			}
		}
	}
}
