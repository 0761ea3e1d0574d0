//go:build cgo && linux

package nvml

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// migParent finds a full GPU by UUID and checks that MIG mode is on.
func (b *Backend) migParent(uuid string) (nvml.Device, nvdevice.GPU, error) {
	g := nvdevice.GPU{UUID: uuid}
	dev, ret := b.lib.DeviceGetHandleByUUID(uuid)
	if ret == nvml.ERROR_INVALID_ARGUMENT { // not a UUID NVML knows the form of
		return nil, g, fmt.Errorf("GPU %s: %w", uuid, nvdevice.ErrNotFound)
	}
	if err := check(ret, "find GPU %s", uuid); err != nil {
		return nil, g, err
	}
	g.Index, ret = dev.GetIndex()
	if err := check(ret, "read index of GPU %s", uuid); err != nil {
		return nil, g, err
	}
	mode, _, ret := dev.GetMigMode()
	if absent(ret, "nvmlDeviceGetMigMode") {
		return nil, g, fmt.Errorf("GPU %d (%s) is not MIG capable: %w", g.Index, uuid, nvdevice.ErrMigDisabled)
	}
	if err := check(ret, "read MIG mode of GPU %d (%s)", g.Index, uuid); err != nil {
		return nil, g, err
	}
	if mode != nvml.DEVICE_MIG_ENABLE {
		return nil, g, fmt.Errorf("GPU %d (%s): %w", g.Index, uuid, nvdevice.ErrMigDisabled)
	}
	return dev, g, nil
}

// CreateMigDevice creates a GPU instance of the profile at the placement and
// a compute instance spanning it. The GPU instance is destroyed again if the
// compute instance cannot be created.
func (b *Backend) CreateMigDevice(ctx context.Context, req nvdevice.MigCreateRequest) (*nvdevice.MigDevice, error) {
	var out *nvdevice.MigDevice
	err := b.locked(func() error {
		b.migChanges++ // telemetry reads its devices again (telemetry.go)
		var err error
		out, err = b.createMigDevice(ctx, req)
		if err != nil {
			err = fmt.Errorf("create MIG device %s at placement start %d on GPU %s: %w", req.Profile, req.Start, req.ParentUUID, err)
		}
		return err
	})
	return out, err
}

// migProfile reads the GPU's GPU-instance profiles and returns the one
// named name.
func (b *Backend) migProfile(dev nvml.Device, g *nvdevice.GPU, name string) (*giProfile, error) {
	mem, ret := dev.GetMemoryInfo()
	if err := check(ret, "read memory of GPU %d", g.Index); err != nil {
		return nil, err
	}
	profiles, err := b.readProfiles(dev, g, mem.Total)
	if err != nil {
		return nil, err
	}
	var names []string
	for i := range profiles {
		names = append(names, profiles[i].model.Name)
		if profiles[i].model.Name == name {
			return &profiles[i], nil
		}
	}
	return nil, fmt.Errorf("GPU %d has no MIG profile %q (it has %s): %w", g.Index, name, strings.Join(names, ", "), nvdevice.ErrNotFound)
}

func (b *Backend) createMigDevice(ctx context.Context, req nvdevice.MigCreateRequest) (*nvdevice.MigDevice, error) {
	dev, g, err := b.migParent(req.ParentUUID)
	if err != nil {
		return nil, err
	}
	p, err := b.migProfile(dev, &g, req.Profile)
	if err != nil {
		return nil, err
	}
	pl, ok := p.model.AllowsPlacement(req.Start)
	if !ok {
		return nil, fmt.Errorf("%s may start at %s, not %d: %w", p.model.Name, starts(p.model.Placements), req.Start, nvdevice.ErrInvalidPlacement)
	}
	placement := nvml.GpuInstancePlacement{Start: uint32(pl.Start), Size: uint32(pl.Size)}
	gi, ret := dev.CreateGpuInstanceWithPlacement(&p.info, &placement)
	if err := checkPlacement(ret, "create GPU instance at %s", pl); err != nil {
		return nil, err
	}
	logger := klog.FromContext(ctx)
	var ci nvml.ComputeInstance
	// rollback destroys what was created, compute instance first (a GPU
	// instance with a compute instance cannot be destroyed). What it cannot
	// destroy stays at the placement, where DeleteMigPlacement finds it.
	rollback := func(cause error) error {
		if ci != nil {
			if ret := ci.Destroy(); ret != nvml.SUCCESS {
				err := check(ret, "destroy compute instance")
				logger.Error(err, "Rollback failed, a MIG device is left behind", "gpu", req.ParentUUID, "profile", req.Profile, "placement", pl.String())
				return fmt.Errorf("%w (rollback: %v; the MIG device is left behind)", cause, err)
			}
		}
		if ret := gi.Destroy(); ret != nvml.SUCCESS {
			err := check(ret, "destroy GPU instance")
			logger.Error(err, "Rollback failed, a GPU instance is left behind", "gpu", req.ParentUUID, "profile", req.Profile, "placement", pl.String())
			return fmt.Errorf("%w (rollback: %v; the GPU instance is left behind)", cause, err)
		}
		return cause
	}
	giInfo, ret := gi.GetInfo()
	if err := check(ret, "read the new GPU instance"); err != nil {
		return nil, rollback(err)
	}
	ciEnum := computeProfileForSlices[p.info.SliceCount]
	ciInfo, ret := gi.GetComputeInstanceProfileInfo(ciEnum, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
	if err := check(ret, "read compute instance profile %d", ciEnum); err != nil {
		return nil, rollback(err)
	}
	ci, ret = gi.CreateComputeInstance(&ciInfo)
	if err := check(ret, "create compute instance in GPU instance %d", giInfo.Id); err != nil {
		ci = nil
		return nil, rollback(err)
	}
	cinfo, ret := ci.GetInfo()
	if err := check(ret, "read the new compute instance"); err != nil {
		return nil, rollback(err)
	}
	uuids, err := migUUIDs(dev)
	if err != nil {
		return nil, rollback(err)
	}
	uuid, ok := uuids[[2]int{int(giInfo.Id), int(cinfo.Id)}]
	if !ok {
		return nil, rollback(fmt.Errorf("no MIG device handle for GPU instance %d compute instance %d", giInfo.Id, cinfo.Id))
	}
	d := &nvdevice.MigDevice{
		UUID: uuid, ParentUUID: req.ParentUUID, ParentIndex: g.Index, Profile: p.model.Name,
		Placement:     nvdevice.Placement{Start: int(giInfo.Placement.Start), Size: int(giInfo.Placement.Size)},
		GPUInstanceID: int(giInfo.Id), ComputeInstanceID: int(cinfo.Id),
		MemoryMiB: p.model.MemoryMiB, Engines: p.model.Engines,
	}
	logger.V(2).Info("Created MIG device", "gpu", req.ParentUUID, "profile", d.Profile, "placement", d.Placement.String(), "uuid", uuid,
		"gpuInstance", d.GPUInstanceID, "computeInstance", d.ComputeInstanceID)
	return d, nil
}

func starts(pls []nvdevice.Placement) string {
	s := make([]string, 0, len(pls))
	for _, p := range pls {
		s = append(s, fmt.Sprint(p.Start))
	}
	if len(s) == 0 {
		return "nowhere"
	}
	return strings.Join(s, ", ")
}

// DeleteMigDevice destroys the compute instance, then the GPU instance. A GPU
// instance left without compute instances (its destroy failed after the
// compute instance went) is destroyed, so that a retry finishes the job.
func (b *Backend) DeleteMigDevice(ctx context.Context, ref nvdevice.MigDeviceRef) error {
	return b.locked(func() error {
		b.migChanges++
		if err := b.deleteMigDevice(ctx, ref); err != nil {
			return fmt.Errorf("delete MIG device (GPU instance %d, compute instance %d) on GPU %s: %w",
				ref.GPUInstanceID, ref.ComputeInstanceID, ref.ParentUUID, err)
		}
		return nil
	})
}

func (b *Backend) deleteMigDevice(ctx context.Context, ref nvdevice.MigDeviceRef) error {
	dev, _, err := b.migParent(ref.ParentUUID)
	if errors.Is(err, nvdevice.ErrMigDisabled) {
		// Without MIG mode no MIG device exists: the device is gone.
		return fmt.Errorf("%w: %w", nvdevice.ErrNotFound, err)
	}
	if err != nil {
		return err
	}
	gi, ret := dev.GetGpuInstanceById(ref.GPUInstanceID)
	if err := checkLookup(ret, "find GPU instance %d", ref.GPUInstanceID); err != nil {
		return err
	}
	ci, ret := gi.GetComputeInstanceById(ref.ComputeInstanceID)
	if err := checkLookup(ret, "find compute instance %d", ref.ComputeInstanceID); err != nil {
		if !errors.Is(err, nvdevice.ErrNotFound) {
			return err
		}
		// No such compute instance. A GPU instance with none at all is
		// what a failed GPU-instance destroy (or a kill) left: finish it.
		// One with other compute instances is not the caller's device.
		cis, lerr := computeInstances(gi)
		if lerr != nil {
			return fmt.Errorf("GPU instance %d: %w", ref.GPUInstanceID, lerr)
		}
		if len(cis) > 0 {
			return err
		}
		if err := check(gi.Destroy(), "destroy GPU instance %d, left without compute instances", ref.GPUInstanceID); err != nil {
			return err
		}
		klog.FromContext(ctx).V(2).Info("Deleted a GPU instance left without compute instances", "gpu", ref.ParentUUID,
			"uuid", ref.UUID, "gpuInstance", ref.GPUInstanceID)
		return nil
	}
	if ref.UUID != "" {
		uuids, err := migUUIDs(dev)
		if err != nil {
			return err
		}
		if uuid := uuids[[2]int{ref.GPUInstanceID, ref.ComputeInstanceID}]; uuid != ref.UUID {
			return fmt.Errorf("the MIG device there is %q, not %s: %w", uuid, ref.UUID, nvdevice.ErrNotFound)
		}
	}
	if err := check(ci.Destroy(), "destroy compute instance %d", ref.ComputeInstanceID); err != nil {
		return err
	}
	if err := check(gi.Destroy(), "destroy GPU instance %d", ref.GPUInstanceID); err != nil {
		return err
	}
	klog.FromContext(ctx).V(2).Info("Deleted MIG device", "gpu", ref.ParentUUID, "uuid", ref.UUID,
		"gpuInstance", ref.GPUInstanceID, "computeInstance", ref.ComputeInstanceID)
	return nil
}

// DeleteMigPlacement destroys every compute instance of the GPU instance of
// ref.Profile at ref.Start, then the GPU instance (see nvdevice.MigManager).
func (b *Backend) DeleteMigPlacement(ctx context.Context, ref nvdevice.MigPlacementRef) error {
	return b.locked(func() error {
		b.migChanges++
		if err := b.deleteMigPlacement(ctx, ref); err != nil {
			return fmt.Errorf("delete MIG %s at placement start %d on GPU %s: %w", ref.Profile, ref.Start, ref.ParentUUID, err)
		}
		return nil
	})
}

func (b *Backend) deleteMigPlacement(ctx context.Context, ref nvdevice.MigPlacementRef) error {
	dev, g, err := b.migParent(ref.ParentUUID)
	if errors.Is(err, nvdevice.ErrMigDisabled) {
		// Without MIG mode no GPU instance exists.
		return fmt.Errorf("%w: %w", nvdevice.ErrNotFound, err)
	}
	if err != nil {
		return err
	}
	p, err := b.migProfile(dev, &g, ref.Profile)
	if err != nil {
		return err
	}
	gis, ret := dev.GetGpuInstances(&p.info)
	if err := check(ret, "list %s GPU instances of GPU %d", p.model.Name, g.Index); err != nil {
		return err
	}
	var gi nvml.GpuInstance
	giID := 0
	for _, cand := range gis {
		info, ret := cand.GetInfo()
		if err := check(ret, "read %s GPU instance of GPU %d", p.model.Name, g.Index); err != nil {
			return err
		}
		if int(info.Placement.Start) == ref.Start {
			gi, giID = cand, int(info.Id)
			break
		}
	}
	if gi == nil {
		return fmt.Errorf("GPU %d has no %s GPU instance at placement start %d: %w", g.Index, p.model.Name, ref.Start, nvdevice.ErrNotFound)
	}
	cis, err := computeInstances(gi)
	if err != nil {
		return fmt.Errorf("GPU instance %d: %w", giID, err)
	}
	if ref.UUID != "" && len(cis) > 0 {
		uuids, err := migUUIDs(dev)
		if err != nil {
			return err
		}
		for _, ci := range cis {
			if uuid := uuids[[2]int{giID, ci.id}]; uuid != ref.UUID {
				return fmt.Errorf("GPU instance %d holds MIG device %q (compute instance %d), not %s: %w", giID, uuid, ci.id, ref.UUID, nvdevice.ErrNotFound)
			}
		}
	}
	for _, c := range cis {
		ci, ret := gi.GetComputeInstanceById(c.id)
		if ret == nvml.ERROR_NOT_FOUND || ret == nvml.ERROR_INVALID_ARGUMENT {
			continue // gone since it was listed
		}
		if err := check(ret, "find compute instance %d of GPU instance %d", c.id, giID); err != nil {
			return err
		}
		if err := check(ci.Destroy(), "destroy compute instance %d of GPU instance %d", c.id, giID); err != nil {
			return err
		}
	}
	if err := check(gi.Destroy(), "destroy GPU instance %d", giID); err != nil {
		return err
	}
	klog.FromContext(ctx).V(2).Info("Deleted MIG GPU instance", "gpu", ref.ParentUUID, "profile", ref.Profile, "start", ref.Start,
		"uuid", ref.UUID, "gpuInstance", giID, "computeInstances", len(cis))
	return nil
}

// checkLookup is check for finding an instance by id: an id NVML rejects
// (INVALID_ARGUMENT) names no instance either.
func checkLookup(ret nvml.Return, op string, args ...any) error {
	if ret == nvml.ERROR_INVALID_ARGUMENT {
		ret = nvml.ERROR_NOT_FOUND
	}
	return check(ret, op, args...)
}
