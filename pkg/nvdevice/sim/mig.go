package sim

import (
	"context"
	"fmt"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// CreateMigDevice creates a GPU instance and its full compute instance,
// refusing what an H100 refuses: MIG mode off, an unknown profile, a
// placement the profile does not allow (NVML_ERROR_INVALID_ARGUMENT), a
// placement overlapping another instance or a GPU out of instances or
// engines for the profile (NVML_ERROR_INSUFFICIENT_RESOURCES).
func (m *Machine) CreateMigDevice(ctx context.Context, req nvdevice.MigCreateRequest) (*nvdevice.MigDevice, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.createLocked(req)
}

func (m *Machine) gpuLocked(uuid string) (*nvdevice.GPU, error) {
	if m.closed {
		return nil, fmt.Errorf("simulated machine %q is closed", m.spec.Name)
	}
	g, err := m.inv.GPUByUUID(uuid)
	if err != nil {
		return nil, err
	}
	if m.lost[uuid] {
		return nil, fmt.Errorf("GPU %d (%s): %w", g.Index, uuid, nvdevice.ErrGPULost)
	}
	return g, nil
}

func (m *Machine) createLocked(req nvdevice.MigCreateRequest) (*nvdevice.MigDevice, error) {
	g, err := m.gpuLocked(req.ParentUUID)
	if err != nil {
		return nil, err
	}
	where := fmt.Sprintf("create MIG %s at placement start %d on GPU %d (%s)", req.Profile, req.Start, g.Index, g.UUID)
	if !g.MIG.Enabled {
		return nil, fmt.Errorf("%s: %w", where, nvdevice.ErrMigDisabled)
	}
	prof, err := g.Profile(req.Profile)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", where, err)
	}
	pl, ok := prof.AllowsPlacement(req.Start)
	if !ok {
		return nil, fmt.Errorf("%s: allowed starts are %v: %w", where, starts(prof.Placements), nvdevice.ErrInvalidPlacement)
	}
	if err := checkCapacity(g, prof, pl); err != nil {
		return nil, fmt.Errorf("%s: %w", where, err)
	}
	m.created++
	d := nvdevice.MigDevice{
		UUID:              "MIG-" + derivedUUID(g.UUID, "mig", fmt.Sprint(m.created)),
		ParentUUID:        g.UUID,
		ParentIndex:       g.Index,
		Profile:           prof.Name,
		Placement:         pl,
		GPUInstanceID:     freeInstanceID(g.MIG.Devices),
		ComputeInstanceID: 0,
		MemoryMiB:         prof.MemoryMiB,
		Engines:           prof.Engines,
	}
	g.MIG.Devices = append(g.MIG.Devices, d)
	return &d, nil
}

// checkCapacity applies the hardware's rules to a new instance of prof at pl
// next to the GPU's existing MIG devices.
func checkCapacity(g *nvdevice.GPU, prof *nvdevice.MigProfile, pl nvdevice.Placement) error {
	count := 0
	used := nvdevice.Engines{}
	computeSlices := 0
	for _, d := range g.MIG.Devices {
		if d.Placement.Overlaps(pl) {
			return fmt.Errorf("placement %s overlaps MIG device %s (%s at %s): %w",
				pl, d.UUID, d.Profile, d.Placement, nvdevice.ErrInsufficientResources)
		}
		if d.Profile == prof.Name {
			count++
		}
		used = addEngines(used, d.Engines)
		if p, err := g.Profile(d.Profile); err == nil {
			computeSlices += p.ComputeSlices
		}
	}
	if count >= prof.MaxInstances {
		return fmt.Errorf("profile %s allows at most %d instances: %w", prof.Name, prof.MaxInstances, nvdevice.ErrInsufficientResources)
	}
	full := fullProfile(g)
	total := addEngines(used, prof.Engines)
	checks := []struct {
		name      string
		want, max int
	}{
		{"compute slices", computeSlices + prof.ComputeSlices, full.ComputeSlices},
		{"copy engines", total.CopyEngines, full.Engines.CopyEngines},
		{"decoders", total.Decoders, full.Engines.Decoders},
		{"JPEG engines", total.JPEGEngines, full.Engines.JPEGEngines},
		{"OFA engines", total.OFAEngines, full.Engines.OFAEngines},
	}
	for _, c := range checks {
		if c.want > c.max {
			return fmt.Errorf("GPU has %d %s, %d would be in use: %w", c.max, c.name, c.want, nvdevice.ErrInsufficientResources)
		}
	}
	return nil
}

// fullProfile is the profile that spans the whole GPU (7g.80gb on H100).
func fullProfile(g *nvdevice.GPU) nvdevice.MigProfile {
	best := nvdevice.MigProfile{}
	for _, p := range g.MIG.Profiles {
		if p.ComputeSlices > best.ComputeSlices {
			best = p
		}
	}
	return best
}

func addEngines(a, b nvdevice.Engines) nvdevice.Engines {
	return nvdevice.Engines{
		Multiprocessors: a.Multiprocessors + b.Multiprocessors,
		CopyEngines:     a.CopyEngines + b.CopyEngines,
		Decoders:        a.Decoders + b.Decoders,
		Encoders:        a.Encoders + b.Encoders,
		JPEGEngines:     a.JPEGEngines + b.JPEGEngines,
		OFAEngines:      a.OFAEngines + b.OFAEngines,
	}
}

// freeInstanceID returns the lowest GPU instance id not in use, from 1.
func freeInstanceID(devs []nvdevice.MigDevice) int {
	for id := 1; ; id++ {
		inUse := false
		for _, d := range devs {
			if d.GPUInstanceID == id {
				inUse = true
				break
			}
		}
		if !inUse {
			return id
		}
	}
}

func starts(ps []nvdevice.Placement) []int {
	s := make([]int, len(ps))
	for i, p := range ps {
		s[i] = p.Start
	}
	return s
}

// DeleteMigDevice destroys a MIG device's compute and GPU instance.
func (m *Machine) DeleteMigDevice(ctx context.Context, ref nvdevice.MigDeviceRef) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	g, err := m.gpuLocked(ref.ParentUUID)
	if err != nil {
		return err
	}
	for i, d := range g.MIG.Devices {
		if d.GPUInstanceID != ref.GPUInstanceID || d.ComputeInstanceID != ref.ComputeInstanceID {
			continue
		}
		if ref.UUID != "" && ref.UUID != d.UUID {
			return fmt.Errorf("delete MIG device GI %d CI %d on GPU %d: it is %s, not %s: %w",
				ref.GPUInstanceID, ref.ComputeInstanceID, g.Index, d.UUID, ref.UUID, nvdevice.ErrNotFound)
		}
		g.MIG.Devices = append(g.MIG.Devices[:i], g.MIG.Devices[i+1:]...)
		return nil
	}
	return fmt.Errorf("delete MIG device GI %d CI %d on GPU %d (%s): %w",
		ref.GPUInstanceID, ref.ComputeInstanceID, g.Index, g.UUID, nvdevice.ErrNotFound)
}
