//go:build cgo && linux

package nvml

import (
	"fmt"
	"sort"

	"github.com/NVIDIA/go-nvlib/pkg/nvlib/device"
	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// computeProfileForSlices maps a GPU instance's compute-slice count to the
// compute-instance profile that spans it.
var computeProfileForSlices = map[uint32]int{
	1: nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE,
	2: nvml.COMPUTE_INSTANCE_PROFILE_2_SLICE,
	3: nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE,
	4: nvml.COMPUTE_INSTANCE_PROFILE_4_SLICE,
	6: nvml.COMPUTE_INSTANCE_PROFILE_6_SLICE,
	7: nvml.COMPUTE_INSTANCE_PROFILE_7_SLICE,
	8: nvml.COMPUTE_INSTANCE_PROFILE_8_SLICE,
}

// newerGIProfiles are GPU-instance profile enums go-nvlib v0.12.0 cannot
// name: the base profile of the same slice count and the attribute to add.
var newerGIProfiles = map[int]struct {
	base int
	attr string
}{
	nvml.GPU_INSTANCE_PROFILE_3_SLICE_GFX: {nvml.GPU_INSTANCE_PROFILE_3_SLICE, device.AttributeGraphics},
}

// profileName is the name nvidia-smi gives a GPU-instance profile with its
// full compute instance ("1g.10gb", "1g.10gb+me", "1g.20gb"), or, for a
// smaller compute instance of it, "1c.3g.40gb". go-nvlib derives the memory
// figure from the profile's share of the GPU's memory, as the driver does.
func (b *Backend) profileName(giProfile, ciProfile int, memoryMiB, totalBytes uint64) (string, error) {
	attr := ""
	if n, ok := newerGIProfiles[giProfile]; ok {
		giProfile, attr = n.base, n.attr
	}
	p, err := b.devlib.NewMigProfile(giProfile, ciProfile, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, memoryMiB, totalBytes)
	if err != nil {
		return "", err
	}
	info := p.GetInfo()
	if attr != "" {
		info.Attributes = append(info.Attributes, attr)
	}
	return info.String(), nil
}

// enginesOf reads a profile's units.
func enginesOf(info nvml.GpuInstanceProfileInfo) nvdevice.Engines {
	return nvdevice.Engines{
		Multiprocessors: int(info.MultiprocessorCount), CopyEngines: int(info.CopyEngineCount),
		Decoders: int(info.DecoderCount), Encoders: int(info.EncoderCount),
		JPEGEngines: int(info.JpegCount), OFAEngines: int(info.OfaCount),
	}
}

// giProfile is one GPU-instance profile as NVML reports it.
type giProfile struct {
	enum  int
	info  nvml.GpuInstanceProfileInfo
	model nvdevice.MigProfile
}

// readProfiles reads the GPU-instance profiles the GPU supports, with their
// placements (NVML answers both whether or not MIG mode is on).
func (b *Backend) readProfiles(dev nvml.Device, g *nvdevice.GPU, totalBytes uint64) ([]giProfile, error) {
	var out []giProfile
	for i := range nvml.GPU_INSTANCE_PROFILE_COUNT {
		info, ret := dev.GetGpuInstanceProfileInfo(i)
		if absent(ret, "nvmlDeviceGetGpuInstanceProfileInfo") || ret == nvml.ERROR_INVALID_ARGUMENT {
			continue
		}
		if err := check(ret, "read MIG profile %d of GPU %d (%s)", i, g.Index, g.UUID); err != nil {
			return nil, err
		}
		ci, ok := computeProfileForSlices[info.SliceCount]
		if !ok {
			continue // a slice count no compute instance spans: not a usable profile
		}
		name, err := b.profileName(i, ci, info.MemorySizeMB, totalBytes)
		if err != nil {
			return nil, fmt.Errorf("name MIG profile %d of GPU %d (%s): %w", i, g.Index, g.UUID, err)
		}
		p := nvdevice.MigProfile{
			Name: name, ID: int(info.Id), NVMLIndex: i,
			ComputeSlices: int(info.SliceCount), MaxInstances: int(info.InstanceCount),
			MemoryMiB: info.MemorySizeMB, Engines: enginesOf(info),
		}
		placements, ret := dev.GetGpuInstancePossiblePlacements(&info)
		if !absent(ret, "nvmlDeviceGetGpuInstancePossiblePlacements") {
			if err := check(ret, "read placements of MIG profile %s on GPU %d (%s)", name, g.Index, g.UUID); err != nil {
				return nil, err
			}
		}
		for _, pl := range placements {
			p.Placements = append(p.Placements, nvdevice.Placement{Start: int(pl.Start), Size: int(pl.Size)})
		}
		out = append(out, giProfile{enum: i, info: info, model: p})
	}
	return out, nil
}

func (b *Backend) readMIG(dev nvml.Device, g *nvdevice.GPU, totalBytes uint64) (nvdevice.MIG, error) {
	current, _, ret := dev.GetMigMode()
	if absent(ret, "nvmlDeviceGetMigMode") {
		return nvdevice.MIG{}, nil
	}
	if err := check(ret, "read MIG mode of GPU %d (%s)", g.Index, g.UUID); err != nil {
		return nvdevice.MIG{}, err
	}
	mig := nvdevice.MIG{Capable: true, Enabled: current == nvml.DEVICE_MIG_ENABLE}
	profiles, err := b.readProfiles(dev, g, totalBytes)
	if err != nil {
		return mig, err
	}
	for _, p := range profiles {
		mig.Profiles = append(mig.Profiles, p.model)
	}
	if !mig.Enabled {
		return mig, nil
	}
	mig.Devices, err = b.readMigDevices(dev, g, profiles, totalBytes)
	return mig, err
}

// migUUIDs maps (GPU instance id, compute instance id) to the UUID of the MIG
// device handle. (A compute instance's info names its parent GPU, not the MIG
// device, so the UUID has to come from the MIG device handles.)
func migUUIDs(dev nvml.Device) (map[[2]int]string, error) {
	out := map[[2]int]string{}
	count, ret := dev.GetMaxMigDeviceCount()
	if err := check(ret, "count MIG devices"); err != nil {
		return nil, err
	}
	for i := range count {
		h, ret := dev.GetMigDeviceHandleByIndex(i)
		if ret == nvml.ERROR_NOT_FOUND || ret == nvml.ERROR_INVALID_ARGUMENT {
			continue // no MIG device at this index
		}
		if err := check(ret, "get MIG device %d", i); err != nil {
			return nil, err
		}
		gi, ret := h.GetGpuInstanceId()
		if err := check(ret, "read GPU instance id of MIG device %d", i); err != nil {
			return nil, err
		}
		ci, ret := h.GetComputeInstanceId()
		if err := check(ret, "read compute instance id of MIG device %d", i); err != nil {
			return nil, err
		}
		uuid, ret := h.GetUUID()
		if err := check(ret, "read UUID of MIG device %d", i); err != nil {
			return nil, err
		}
		out[[2]int{gi, ci}] = uuid
	}
	return out, nil
}

// ciOf is one compute instance of a GPU instance.
type ciOf struct {
	enum int
	info nvml.ComputeInstanceProfileInfo
	id   int
}

// computeInstances lists a GPU instance's compute instances, lowest id first.
func computeInstances(gi nvml.GpuInstance) ([]ciOf, error) {
	var out []ciOf
	for j := range nvml.COMPUTE_INSTANCE_PROFILE_COUNT {
		info, ret := gi.GetComputeInstanceProfileInfo(j, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		if absent(ret, "nvmlGpuInstanceGetComputeInstanceProfileInfo") || ret == nvml.ERROR_INVALID_ARGUMENT {
			continue
		}
		if err := check(ret, "read compute instance profile %d", j); err != nil {
			return nil, err
		}
		cis, ret := gi.GetComputeInstances(&info)
		if err := check(ret, "list compute instances of profile %d", j); err != nil {
			return nil, err
		}
		for _, ci := range cis {
			cinfo, ret := ci.GetInfo()
			if err := check(ret, "read compute instance"); err != nil {
				return nil, err
			}
			out = append(out, ciOf{enum: j, info: info, id: int(cinfo.Id)})
		}
	}
	sort.Slice(out, func(a, b int) bool { return out[a].id < out[b].id })
	return out, nil
}

// readMigDevices lists the GPU instances that exist, one MigDevice each.
// A GPU instance with a compute instance spanning it is a MIG device of the
// GPU-instance profile. One without (only smaller compute instances, or none
// yet) is still listed, since it holds its memory slices and engines: its
// Profile then names its first compute instance ("1c.3g.40gb"), or says it
// has none, so that it never passes for a usable device of a GI profile.
func (b *Backend) readMigDevices(dev nvml.Device, g *nvdevice.GPU, profiles []giProfile, totalBytes uint64) ([]nvdevice.MigDevice, error) {
	uuids, err := migUUIDs(dev)
	if err != nil {
		return nil, fmt.Errorf("GPU %d (%s): %w", g.Index, g.UUID, err)
	}
	var out []nvdevice.MigDevice
	for _, p := range profiles {
		gis, ret := dev.GetGpuInstances(&p.info)
		if err := check(ret, "list %s GPU instances of GPU %d (%s)", p.model.Name, g.Index, g.UUID); err != nil {
			return nil, err
		}
		for _, gi := range gis {
			giInfo, ret := gi.GetInfo()
			if err := check(ret, "read %s GPU instance of GPU %d (%s)", p.model.Name, g.Index, g.UUID); err != nil {
				return nil, err
			}
			cis, err := computeInstances(gi)
			if err != nil {
				return nil, fmt.Errorf("GPU instance %d of GPU %d (%s): %w", giInfo.Id, g.Index, g.UUID, err)
			}
			d := nvdevice.MigDevice{
				ParentUUID: g.UUID, ParentIndex: g.Index, Profile: p.model.Name,
				Placement:     nvdevice.Placement{Start: int(giInfo.Placement.Start), Size: int(giInfo.Placement.Size)},
				GPUInstanceID: int(giInfo.Id), ComputeInstanceID: -1,
				MemoryMiB: p.model.MemoryMiB, Engines: p.model.Engines,
			}
			spanning := -1
			for k, ci := range cis {
				if ci.info.SliceCount == p.info.SliceCount {
					spanning = k
					break
				}
			}
			switch {
			case spanning >= 0:
				d.ComputeInstanceID = cis[spanning].id
			case len(cis) > 0:
				d.ComputeInstanceID = cis[0].id
				if d.Profile, err = b.profileName(p.enum, cis[0].enum, p.info.MemorySizeMB, totalBytes); err != nil {
					d.Profile = fmt.Sprintf("%dc.%s", cis[0].info.SliceCount, p.model.Name)
				}
			default:
				d.Profile = p.model.Name + " (no compute instance)"
			}
			if d.ComputeInstanceID >= 0 {
				d.UUID = uuids[[2]int{d.GPUInstanceID, d.ComputeInstanceID}]
			}
			out = append(out, d)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Placement.Start < out[j].Placement.Start })
	return out, nil
}
