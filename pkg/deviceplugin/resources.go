package deviceplugin

import (
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// DefaultGPUResourceName is the whole-GPU resource, NVIDIA's name for
// drop-in use.
const DefaultGPUResourceName = DefaultResourceDomain + "/gpu"

// MigResourceName is the resource of a MIG profile under the mixed
// strategy: "nvidia.com/mig-1g.10gb".
func MigResourceName(profile string) string {
	return DefaultResourceDomain + "/mig-" + profile
}

// ReplicaSeparator separates a replicated device's UUID from its replica
// number in its device ID: "<uuid>::<n>", as NVIDIA's plugin writes it.
const ReplicaSeparator = "::"

// SharingMode is how a device ID shares its device.
type SharingMode string

const (
	// Exclusive: the ID is the device.
	Exclusive SharingMode = ""
	// TimeSlicing: the ID is one of several replicas of the device.
	TimeSlicing SharingMode = "time-slicing"
	// MPS: the ID is one of several replicas of the device, each an MPS
	// client with a share of the GPU.
	MPS SharingMode = "mps"
)

// Device is one device ID a resource advertises.
type Device struct {
	// ID is what the kubelet sees: the GPU or MIG UUID, or
	// "<uuid>::<n>" for a replica.
	ID string
	// Name is the DRA device name of the underlying device ("gpu-3",
	// "gpu-0-mig-1g-10gb-2"): its CDI device in the device plugin's spec.
	Name string
	// UUID is the GPU or MIG device the container sees.
	UUID string
	// GPUUUID is the physical GPU (the parent of a MIG device).
	GPUUUID  string
	GPUIndex int
	GPUMinor int
	// MigProfile is set for a MIG device ("1g.10gb").
	MigProfile string
	// MigStart is the MIG device's placement start.
	MigStart int
	// NUMANode of the GPU, -1 when unknown.
	NUMANode int
	// NVLinkDomain of the GPU; empty for MIG devices (no NVLink
	// peer-to-peer) and GPUs without NVLink.
	NVLinkDomain string
	MemoryMiB    uint64
	// Sharing, Replica (0-based) and Replicas describe a replica.
	Sharing  SharingMode
	Replica  int
	Replicas int
	// FailRequestsGreaterThanOne: a container may get this replica only
	// alone.
	FailRequestsGreaterThanOne bool
}

// Replicated reports whether the ID is a replica.
func (d Device) Replicated() bool { return d.Sharing != Exclusive }

// Resource is one extended resource and its device IDs.
type Resource struct {
	Name    string
	Devices []Device
}

// ResourceOptions say what to advertise.
type ResourceOptions struct {
	// GPUResourceName is the whole-GPU resource; empty: nvidia.com/gpu.
	GPUResourceName string
	// Config is the parsed config file; nil: defaults (mixed MIG
	// strategy, no sharing).
	Config *Config
}

// Resources computes the resources to advertise from an inventory: whole
// GPUs not in MIG mode under the GPU resource name, the MIG devices that
// exist on GPUs in MIG mode under one resource per profile (mixed
// strategy; MIG devices are not created), and the replicas the sharing
// config asks for. Resources without devices are left out. Pure.
func Resources(inv *nvdevice.Inventory, opts ResourceOptions) ([]Resource, error) {
	gpuName := opts.GPUResourceName
	if gpuName == "" {
		gpuName = DefaultGPUResourceName
	}
	if err := ValidResourceName(gpuName); err != nil {
		return nil, fmt.Errorf("GPU resource name: %w", err)
	}
	cfg := opts.Config
	if cfg == nil {
		cfg = &Config{Version: ConfigVersion}
	}
	base := map[string][]Device{}
	for i := range inv.GPUs {
		g := &inv.GPUs[i]
		if !g.MIG.Enabled {
			base[gpuName] = append(base[gpuName], Device{
				ID: g.UUID, Name: slicebuilder.GPUDeviceName(g), UUID: g.UUID, GPUUUID: g.UUID,
				GPUIndex: g.Index, GPUMinor: g.Minor, NUMANode: g.NUMANode, NVLinkDomain: g.NVLink.Domain,
				MemoryMiB: g.MemoryMiB,
			})
			continue
		}
		if cfg.Flags.MigStrategy == MigStrategyNone {
			continue
		}
		for _, m := range g.MIG.Devices {
			name := MigResourceName(m.Profile)
			base[name] = append(base[name], Device{
				ID: m.UUID, Name: slicebuilder.MigDeviceName(g, m.Profile, m.Placement.Start), UUID: m.UUID,
				GPUUUID: g.UUID, GPUIndex: g.Index, GPUMinor: g.Minor, MigProfile: m.Profile, MigStart: m.Placement.Start,
				NUMANode: g.NUMANode, MemoryMiB: m.MemoryMiB,
			})
		}
	}
	out := map[string][]Device{}
	for name, devs := range base {
		out[name] = devs
	}
	replicate := func(mode SharingMode, r *ReplicatedResources) error {
		if r == nil {
			return nil
		}
		for _, res := range r.Resources {
			name := QualifyResourceName(res.Name)
			devs, ok := base[name]
			if !ok {
				continue // not on this node
			}
			target := cfg.advertisedName(name, res.Rename, r.RenameByDefault)
			if _, clash := base[target]; clash && target != name {
				return fmt.Errorf("sharing: %s renamed to %s, a resource this node already advertises", name, target)
			}
			var kept []Device
			for _, d := range devs {
				if !res.Devices.selects(d.GPUIndex, d.UUID, d.GPUUUID) {
					kept = append(kept, d)
					continue
				}
				for n := 0; n < res.Replicas; n++ {
					rd := d
					rd.ID = d.UUID + ReplicaSeparator + strconv.Itoa(n)
					rd.Sharing, rd.Replica, rd.Replicas = mode, n, res.Replicas
					rd.FailRequestsGreaterThanOne = r.FailRequestsGreaterThanOne || mode == MPS
					if target == name {
						kept = append(kept, rd)
					} else {
						out[target] = append(out[target], rd)
					}
				}
			}
			out[name] = kept
		}
		return nil
	}
	if err := replicate(TimeSlicing, cfg.Sharing.TimeSlicing); err != nil {
		return nil, err
	}
	if err := replicate(MPS, cfg.Sharing.MPS); err != nil {
		return nil, err
	}
	var resources []Resource
	for name, devs := range out {
		if len(devs) == 0 {
			continue
		}
		sortDevices(devs)
		resources = append(resources, Resource{Name: name, Devices: devs})
	}
	sort.Slice(resources, func(i, j int) bool { return resources[i].Name < resources[j].Name })
	return resources, nil
}

func sortDevices(devs []Device) {
	sort.SliceStable(devs, func(i, j int) bool {
		a, b := devs[i], devs[j]
		if a.GPUIndex != b.GPUIndex {
			return a.GPUIndex < b.GPUIndex
		}
		if a.MigStart != b.MigStart {
			return a.MigStart < b.MigStart
		}
		if a.MigProfile != b.MigProfile {
			return a.MigProfile < b.MigProfile
		}
		return a.Replica < b.Replica
	})
}

// SocketName is the plugin socket of a resource in the device plugin
// directory: "gpudra-nvidia.com-gpu.sock".
func SocketName(resource string) string {
	return "gpudra-" + strings.NewReplacer("/", "-").Replace(resource) + ".sock"
}

func devName(g *nvdevice.GPU, m *nvdevice.MigDevice) string {
	if m == nil {
		return slicebuilder.GPUDeviceName(g)
	}
	return slicebuilder.MigDeviceName(g, m.Profile, m.Placement.Start)
}
