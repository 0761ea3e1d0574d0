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
// strategy: "nvidia.com/mig-1g.10gb"; a "+" (1g.10gb+me) becomes ".", as in
// NVIDIA's plugin, since resource names cannot hold it.
func MigResourceName(profile string) string {
	return DefaultResourceDomain + "/mig-" + strings.ReplaceAll(profile, "+", ".")
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
	// MigMode says that a whole GPU is in MIG mode (the none strategy
	// advertises it anyway).
	MigMode bool
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
	// Response says how Allocate answers (flags.plugin); the zero value is
	// NVIDIA's defaults.
	Response Response
}

// ResourceOptions say what to advertise.
type ResourceOptions struct {
	// GPUResourceName is the whole-GPU resource; empty: nvidia.com/gpu.
	GPUResourceName string
	// Config is the parsed config file; nil: defaults (mixed MIG
	// strategy, no sharing).
	Config *Config
}

// Resources computes the resources to advertise from an inventory, by the
// MIG strategy (migstrategy.go): whole GPUs under the GPU resource name, the
// MIG devices that exist on GPUs in MIG mode (never created) under the GPU
// resource name (single) or one resource per profile (mixed), and the
// replicas the sharing config asks for. Resources without devices are left
// out. A node that does not fit the strategy is an error naming its GPUs.
// Pure.
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
	base, err := baseDevices(inv, cfg.migStrategy(), gpuName)
	if err != nil {
		return nil, err
	}
	response := responseFor(cfg)
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
				if mode == MPS && (d.MigProfile != "" || d.MigMode) {
					return fmt.Errorf("sharing.mps: %s's device %s (%s) is a MIG device or a GPU in MIG mode: MPS cannot share it; select other devices (devices:) or change the MIG strategy or mode", name, d.ID, d.Name)
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
		if response.usesIndex() {
			for _, d := range devs {
				if d.MigProfile != "" {
					return nil, fmt.Errorf("flags.plugin.deviceIDStrategy: %q cannot name MIG device %s (%s) in NVIDIA_VISIBLE_DEVICES: gpudra does not know NVML's MIG device index; use %q", DeviceIDIndex, d.UUID, d.Name, DeviceIDUUID)
				}
			}
		}
		resources = append(resources, Resource{Name: name, Devices: devs, Response: response})
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

// gpuDevice is a whole GPU as a device ID.
func gpuDevice(g *nvdevice.GPU) Device {
	return Device{ID: g.UUID, Name: slicebuilder.GPUDeviceName(g), UUID: g.UUID, GPUUUID: g.UUID,
		GPUIndex: g.Index, GPUMinor: g.Minor, NUMANode: g.NUMANode, NVLinkDomain: g.NVLink.Domain, MemoryMiB: g.MemoryMiB,
		MigMode: g.MIG.Enabled}
}

// migDevice is a MIG device as a device ID.
func migDevice(g *nvdevice.GPU, m *nvdevice.MigDevice) Device {
	return Device{ID: m.UUID, Name: slicebuilder.MigDeviceName(g, m.Profile, m.Placement.Start), UUID: m.UUID,
		GPUUUID: g.UUID, GPUIndex: g.Index, GPUMinor: g.Minor, MigProfile: m.Profile, MigStart: m.Placement.Start,
		NUMANode: g.NUMANode, MemoryMiB: m.MemoryMiB}
}

func devName(g *nvdevice.GPU, m *nvdevice.MigDevice) string {
	if m == nil {
		return slicebuilder.GPUDeviceName(g)
	}
	return slicebuilder.MigDeviceName(g, m.Profile, m.Placement.Start)
}
