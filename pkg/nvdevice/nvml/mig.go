//go:build cgo

package nvml

import (
	"context"
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// computeProfileForSlices maps a GPU instance's slice count to the compute
// instance profile that spans it.
var computeProfileForSlices = map[uint32]int{
	1: nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE,
	2: nvml.COMPUTE_INSTANCE_PROFILE_2_SLICE,
	3: nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE,
	4: nvml.COMPUTE_INSTANCE_PROFILE_4_SLICE,
	6: nvml.COMPUTE_INSTANCE_PROFILE_6_SLICE,
	7: nvml.COMPUTE_INSTANCE_PROFILE_7_SLICE,
	8: nvml.COMPUTE_INSTANCE_PROFILE_8_SLICE,
}

// ProfileName is the name nvidia-smi gives a GPU-instance profile:
// "<slices>g.<memory GB>gb" plus the suffix of its revision.
func ProfileName(index int, info nvml.GpuInstanceProfileInfo) string {
	gb := (info.MemorySizeMB + 1023) / 1024
	name := fmt.Sprintf("%dg.%dgb", info.SliceCount, gb)
	switch index {
	case nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, nvml.GPU_INSTANCE_PROFILE_2_SLICE_REV1:
		name += "+me"
	case nvml.GPU_INSTANCE_PROFILE_1_SLICE_NO_ME, nvml.GPU_INSTANCE_PROFILE_2_SLICE_NO_ME:
		name += "-me"
	case nvml.GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME, nvml.GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME:
		name += "+me.all"
	case nvml.GPU_INSTANCE_PROFILE_1_SLICE_GFX, nvml.GPU_INSTANCE_PROFILE_2_SLICE_GFX, nvml.GPU_INSTANCE_PROFILE_4_SLICE_GFX:
		name += "+gfx"
	}
	return name
}

// enginesOf reads a profile's units.
func enginesOf(info nvml.GpuInstanceProfileInfo) nvdevice.Engines {
	return nvdevice.Engines{
		Multiprocessors: int(info.MultiprocessorCount), CopyEngines: int(info.CopyEngineCount),
		Decoders: int(info.DecoderCount), Encoders: int(info.EncoderCount),
		JPEGEngines: int(info.JpegCount), OFAEngines: int(info.OfaCount),
	}
}

// profileInfos returns the GPU's supported GPU-instance profiles by NVML index.
func profileInfos(dev nvml.Device) map[int]nvml.GpuInstanceProfileInfo {
	out := map[int]nvml.GpuInstanceProfileInfo{}
	for i := 0; i < nvml.GPU_INSTANCE_PROFILE_COUNT; i++ {
		info, ret := dev.GetGpuInstanceProfileInfo(i)
		if ret == nvml.SUCCESS {
			out[i] = info
		}
	}
	return out
}

func (b *Backend) readMIG(dev nvml.Device, g *nvdevice.GPU) (nvdevice.MIG, error) {
	current, _, ret := dev.GetMigMode()
	if ret == nvml.ERROR_NOT_SUPPORTED {
		return nvdevice.MIG{}, nil
	}
	if err := check(ret, "read MIG mode of GPU %d (%s)", g.Index, g.UUID); err != nil {
		return nvdevice.MIG{}, err
	}
	mig := nvdevice.MIG{Capable: true, Enabled: current == nvml.DEVICE_MIG_ENABLE}
	infos := profileInfos(dev)
	for i := 0; i < nvml.GPU_INSTANCE_PROFILE_COUNT; i++ {
		info, ok := infos[i]
		if !ok {
			continue
		}
		p := nvdevice.MigProfile{
			Name: ProfileName(i, info), ID: int(info.Id), NVMLIndex: i,
			ComputeSlices: int(info.SliceCount), MaxInstances: int(info.InstanceCount), MemoryMiB: info.MemorySizeMB,
			Engines: enginesOf(info),
		}
		placements, ret := dev.GetGpuInstancePossiblePlacements(&info)
		if ret == nvml.SUCCESS {
			for _, pl := range placements {
				p.Placements = append(p.Placements, nvdevice.Placement{Start: int(pl.Start), Size: int(pl.Size)})
			}
		}
		mig.Profiles = append(mig.Profiles, p)
	}
	if !mig.Enabled {
		return mig, nil
	}
	devs, err := readMigDevices(dev, g, mig.Profiles, infos)
	if err != nil {
		return mig, err
	}
	mig.Devices = devs
	return mig, nil
}

// readMigDevices lists the GPU and compute instances that exist, with the
// UUIDs of their MIG device handles.
func readMigDevices(dev nvml.Device, g *nvdevice.GPU, profiles []nvdevice.MigProfile, infos map[int]nvml.GpuInstanceProfileInfo) ([]nvdevice.MigDevice, error) {
	uuids := map[[2]int]string{}
	maxMig, ret := dev.GetMaxMigDeviceCount()
	if ret == nvml.SUCCESS {
		for i := 0; i < maxMig; i++ {
			h, ret := dev.GetMigDeviceHandleByIndex(i)
			if ret != nvml.SUCCESS {
				continue
			}
			gi, r1 := h.GetGpuInstanceId()
			ci, r2 := h.GetComputeInstanceId()
			uuid, r3 := h.GetUUID()
			if r1 == nvml.SUCCESS && r2 == nvml.SUCCESS && r3 == nvml.SUCCESS {
				uuids[[2]int{gi, ci}] = uuid
			}
		}
	}
	var out []nvdevice.MigDevice
	for _, p := range profiles {
		info := infos[p.NVMLIndex]
		gis, ret := dev.GetGpuInstances(&info)
		if ret != nvml.SUCCESS {
			continue
		}
		for _, gi := range gis {
			giInfo, ret := gi.GetInfo()
			if err := check(ret, "read GPU instance of GPU %d (%s)", g.Index, g.UUID); err != nil {
				return nil, err
			}
			ciProfile, ok := computeProfileForSlices[info.SliceCount]
			if !ok {
				continue
			}
			ciInfo, ret := gi.GetComputeInstanceProfileInfo(ciProfile, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
			if ret != nvml.SUCCESS {
				continue
			}
			cis, ret := gi.GetComputeInstances(&ciInfo)
			if ret != nvml.SUCCESS {
				continue
			}
			for _, ci := range cis {
				cinfo, ret := ci.GetInfo()
				if ret != nvml.SUCCESS {
					continue
				}
				out = append(out, nvdevice.MigDevice{
					UUID: uuids[[2]int{int(giInfo.Id), int(cinfo.Id)}], ParentUUID: g.UUID, ParentIndex: g.Index,
					Profile:       p.Name,
					Placement:     nvdevice.Placement{Start: int(giInfo.Placement.Start), Size: int(giInfo.Placement.Size)},
					GPUInstanceID: int(giInfo.Id), ComputeInstanceID: int(cinfo.Id),
					MemoryMiB: p.MemoryMiB, Engines: p.Engines,
				})
			}
		}
	}
	return out, nil
}

// deviceByUUID finds a full GPU.
func (b *Backend) deviceByUUID(uuid string) (nvml.Device, error) {
	dev, ret := b.lib.DeviceGetHandleByUUID(uuid)
	if err := check(ret, "find GPU %s", uuid); err != nil {
		return nil, err
	}
	return dev, nil
}

// CreateMigDevice creates a GPU instance at the placement and a compute
// instance spanning it; the GPU instance is destroyed again if the compute
// instance cannot be created.
func (b *Backend) CreateMigDevice(ctx context.Context, req nvdevice.MigCreateRequest) (*nvdevice.MigDevice, error) {
	var out *nvdevice.MigDevice
	err := b.locked(func() error {
		var err error
		out, err = b.createMigDevice(ctx, req)
		return err
	})
	return out, err
}

func (b *Backend) createMigDevice(ctx context.Context, req nvdevice.MigCreateRequest) (*nvdevice.MigDevice, error) {
	where := fmt.Sprintf("create MIG %s at placement start %d on GPU %s", req.Profile, req.Start, req.ParentUUID)
	dev, err := b.deviceByUUID(req.ParentUUID)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", where, err)
	}
	mode, _, ret := dev.GetMigMode()
	if err := check(ret, "read MIG mode"); err != nil {
		return nil, fmt.Errorf("%s: %w", where, err)
	}
	if mode != nvml.DEVICE_MIG_ENABLE {
		return nil, fmt.Errorf("%s: %w", where, nvdevice.ErrMigDisabled)
	}
	info, found := nvml.GpuInstanceProfileInfo{}, false
	for i, in := range profileInfos(dev) {
		if ProfileName(i, in) == req.Profile {
			info, found = in, true
			break
		}
	}
	if !found {
		return nil, fmt.Errorf("%s: MIG profile %q: %w", where, req.Profile, nvdevice.ErrNotFound)
	}
	gi, ret := dev.CreateGpuInstanceWithPlacement(&info, &nvml.GpuInstancePlacement{Start: uint32(req.Start), Size: info.SliceCount})
	if err := check(ret, "create GPU instance"); err != nil {
		return nil, fmt.Errorf("%s: %w", where, err)
	}
	rollback := func(cause error) error {
		if ret := gi.Destroy(); ret != nvml.SUCCESS {
			klog.FromContext(ctx).Error(check(ret, "destroy GPU instance"), "Rollback failed, a GPU instance is left behind", "gpu", req.ParentUUID, "profile", req.Profile)
		}
		return fmt.Errorf("%s: %w", where, cause)
	}
	giInfo, ret := gi.GetInfo()
	if err := check(ret, "read new GPU instance"); err != nil {
		return nil, rollback(err)
	}
	ciInfo, ret := gi.GetComputeInstanceProfileInfo(computeProfileForSlices[info.SliceCount], nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
	if err := check(ret, "read compute instance profile"); err != nil {
		return nil, rollback(err)
	}
	ci, ret := gi.CreateComputeInstance(&ciInfo)
	if err := check(ret, "create compute instance"); err != nil {
		return nil, rollback(err)
	}
	cinfo, ret := ci.GetInfo()
	if err := check(ret, "read new compute instance"); err != nil {
		ci.Destroy()
		return nil, rollback(err)
	}
	parentIndex, _ := dev.GetIndex()
	uuid := ""
	if cinfo.Device != nil {
		uuid, _ = cinfo.Device.GetUUID()
	}
	return &nvdevice.MigDevice{
		UUID: uuid, ParentUUID: req.ParentUUID, ParentIndex: parentIndex, Profile: req.Profile,
		Placement:     nvdevice.Placement{Start: int(giInfo.Placement.Start), Size: int(giInfo.Placement.Size)},
		GPUInstanceID: int(giInfo.Id), ComputeInstanceID: int(cinfo.Id), MemoryMiB: info.MemorySizeMB,
		Engines: enginesOf(info),
	}, nil
}

// DeleteMigDevice destroys the compute instance, then the GPU instance.
func (b *Backend) DeleteMigDevice(ctx context.Context, ref nvdevice.MigDeviceRef) error {
	return b.locked(func() error {
		where := fmt.Sprintf("delete MIG device GI %d CI %d on GPU %s", ref.GPUInstanceID, ref.ComputeInstanceID, ref.ParentUUID)
		dev, err := b.deviceByUUID(ref.ParentUUID)
		if err != nil {
			return fmt.Errorf("%s: %w", where, err)
		}
		gi, ret := dev.GetGpuInstanceById(ref.GPUInstanceID)
		if err := check(ret, "find GPU instance"); err != nil {
			return fmt.Errorf("%s: %w", where, err)
		}
		ci, ret := gi.GetComputeInstanceById(ref.ComputeInstanceID)
		if err := check(ret, "find compute instance"); err != nil {
			return fmt.Errorf("%s: %w", where, err)
		}
		if ref.UUID != "" {
			if info, ret := ci.GetInfo(); ret == nvml.SUCCESS && info.Device != nil {
				if uuid, ret := info.Device.GetUUID(); ret == nvml.SUCCESS && uuid != ref.UUID {
					return fmt.Errorf("%s: it is %s, not %s: %w", where, uuid, ref.UUID, nvdevice.ErrNotFound)
				}
			}
		}
		if err := check(ci.Destroy(), "destroy compute instance"); err != nil {
			return fmt.Errorf("%s: %w", where, err)
		}
		if err := check(gi.Destroy(), "destroy GPU instance"); err != nil {
			return fmt.Errorf("%s: %w", where, err)
		}
		return nil
	})
}
