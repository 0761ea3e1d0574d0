package sim

import (
	"context"
	"fmt"
	"strings"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// noComputeInstance ends the profile of a GPU instance without compute
// instances, as the NVML backend reports it ("3g.40gb (no compute
// instance)", compute instance id -1, no UUID).
const noComputeInstance = " (no compute instance)"

// giProfileName is the GPU-instance profile of a simulated GPU instance,
// with or without its compute instance.
func giProfileName(d nvdevice.MigDevice) string {
	return strings.TrimSuffix(d.Profile, noComputeInstance)
}

// CreateMigDevice creates a GPU instance and its full compute instance,
// refusing what an H100 refuses: MIG mode off, an unknown profile, a
// placement the profile does not allow (NVML_ERROR_INVALID_ARGUMENT), a
// placement overlapping another instance or a GPU out of instances or
// engines for the profile (NVML_ERROR_INSUFFICIENT_RESOURCES).
//
// As on the hardware these are two steps: between them (StepAfterGICreate)
// the inventory shows a GPU instance without a compute instance.
func (m *Machine) CreateMigDevice(ctx context.Context, req nvdevice.MigCreateRequest) (*nvdevice.MigDevice, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	m.mu.Lock()
	giID, err := m.createGILocked(req)
	m.mu.Unlock()
	if err != nil {
		return nil, err
	}
	m.step(StepAfterGICreate)
	m.mu.Lock()
	defer m.mu.Unlock()
	// The compute instance fails only when the GPU or the GPU instance is
	// gone in between: then there is nothing left to roll back.
	return m.createCILocked(req, giID)
}

// createLocked creates a MIG device in one go (machine specs).
func (m *Machine) createLocked(req nvdevice.MigCreateRequest) (*nvdevice.MigDevice, error) {
	giID, err := m.createGILocked(req)
	if err != nil {
		return nil, err
	}
	return m.createCILocked(req, giID)
}

func (m *Machine) gpuLocked(uuid string) (*nvdevice.GPU, error) {
	if m.closed {
		return nil, fmt.Errorf("simulated machine %q is closed", m.spec.Name)
	}
	if err := m.driverLoadedLocked("find GPU " + uuid); err != nil {
		return nil, err
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

// createGILocked creates a GPU instance without compute instance and
// returns its id.
func (m *Machine) createGILocked(req nvdevice.MigCreateRequest) (int, error) {
	g, err := m.gpuLocked(req.ParentUUID)
	if err != nil {
		return 0, err
	}
	where := createWhere(req, g)
	if !g.MIG.Enabled {
		return 0, fmt.Errorf("%s: %w", where, nvdevice.ErrMigDisabled)
	}
	prof, err := g.Profile(req.Profile)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", where, err)
	}
	pl, ok := prof.AllowsPlacement(req.Start)
	if !ok {
		return 0, fmt.Errorf("%s: allowed starts are %v: %w", where, starts(prof.Placements), nvdevice.ErrInvalidPlacement)
	}
	if err := checkCapacity(g, prof, pl); err != nil {
		return 0, fmt.Errorf("%s: %w", where, err)
	}
	d := nvdevice.MigDevice{
		ParentUUID:        g.UUID,
		ParentIndex:       g.Index,
		Profile:           prof.Name + noComputeInstance,
		Placement:         pl,
		GPUInstanceID:     freeInstanceID(g.MIG.Devices),
		ComputeInstanceID: -1,
		MemoryMiB:         prof.MemoryMiB,
		Engines:           prof.Engines,
	}
	g.MIG.Devices = append(g.MIG.Devices, d)
	m.changedLocked()
	return d.GPUInstanceID, nil
}

// createCILocked creates the compute instance spanning GPU instance giID,
// which makes it a MIG device with a UUID.
func (m *Machine) createCILocked(req nvdevice.MigCreateRequest, giID int) (*nvdevice.MigDevice, error) {
	g, err := m.gpuLocked(req.ParentUUID)
	if err != nil {
		return nil, err
	}
	i := giIndex(g, giID)
	if i < 0 || g.MIG.Devices[i].ComputeInstanceID >= 0 {
		return nil, fmt.Errorf("%s: GPU instance %d is gone or has a compute instance already: %w", createWhere(req, g), giID, nvdevice.ErrNotFound)
	}
	m.created++
	d := &g.MIG.Devices[i]
	d.UUID = "MIG-" + derivedUUID(g.UUID, "mig", fmt.Sprint(m.created))
	d.ComputeInstanceID = 0
	d.Profile = giProfileName(*d)
	m.changedLocked()
	out := *d
	return &out, nil
}

func createWhere(req nvdevice.MigCreateRequest, g *nvdevice.GPU) string {
	return fmt.Sprintf("create MIG %s at placement start %d on GPU %d (%s)", req.Profile, req.Start, g.Index, g.UUID)
}

// giIndex is the index in g.MIG.Devices of GPU instance id, -1 if none.
func giIndex(g *nvdevice.GPU, id int) int {
	for i, d := range g.MIG.Devices {
		if d.GPUInstanceID == id {
			return i
		}
	}
	return -1
}

// checkCapacity applies the hardware's rules to a new instance of prof at pl
// next to the GPU's existing MIG devices.
func checkCapacity(g *nvdevice.GPU, prof *nvdevice.MigProfile, pl nvdevice.Placement) error {
	count := 0
	used := nvdevice.Engines{}
	computeSlices := 0
	for _, d := range g.MIG.Devices {
		if d.Placement.Overlaps(pl) {
			return fmt.Errorf("placement %s overlaps GPU instance %d (MIG device %q, %s at %s): %w",
				pl, d.GPUInstanceID, d.UUID, d.Profile, d.Placement, nvdevice.ErrInsufficientResources)
		}
		if giProfileName(d) == prof.Name {
			count++
		}
		used = addEngines(used, d.Engines)
		if p, err := g.Profile(giProfileName(d)); err == nil {
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

// DeleteMigDevice destroys a MIG device's compute and GPU instance. A GPU
// instance of ref.GPUInstanceID without compute instance (left by a kill or
// a failed GPU-instance destroy) is destroyed too.
func (m *Machine) DeleteMigDevice(ctx context.Context, ref nvdevice.MigDeviceRef) error {
	what := fmt.Sprintf("MIG device GI %d CI %d", ref.GPUInstanceID, ref.ComputeInstanceID)
	return m.deleteGI(ctx, ref.ParentUUID, what, func(g *nvdevice.GPU) (int, error) {
		i := giIndex(g, ref.GPUInstanceID)
		if i < 0 {
			return 0, fmt.Errorf("no GPU instance %d: %w", ref.GPUInstanceID, nvdevice.ErrNotFound)
		}
		d := g.MIG.Devices[i]
		switch {
		case d.ComputeInstanceID < 0:
			// Its compute instance went before a kill or a failed destroy.
		case d.ComputeInstanceID != ref.ComputeInstanceID:
			return 0, fmt.Errorf("GPU instance %d has no compute instance %d: %w", d.GPUInstanceID, ref.ComputeInstanceID, nvdevice.ErrNotFound)
		case ref.UUID != "" && ref.UUID != d.UUID:
			return 0, fmt.Errorf("it is %s, not %s: %w", d.UUID, ref.UUID, nvdevice.ErrNotFound)
		}
		return d.GPUInstanceID, nil
	})
}

// DeleteMigPlacement destroys the compute instance of the GPU instance of
// ref.Profile at ref.Start, then the GPU instance (see
// nvdevice.MigManager).
func (m *Machine) DeleteMigPlacement(ctx context.Context, ref nvdevice.MigPlacementRef) error {
	what := fmt.Sprintf("MIG %s at placement start %d", ref.Profile, ref.Start)
	return m.deleteGI(ctx, ref.ParentUUID, what, func(g *nvdevice.GPU) (int, error) {
		for _, d := range g.MIG.Devices {
			if giProfileName(d) != ref.Profile || d.Placement.Start != ref.Start {
				continue
			}
			if ref.UUID != "" && d.UUID != "" && d.UUID != ref.UUID {
				return 0, fmt.Errorf("GPU instance %d holds MIG device %s, not %s: %w", d.GPUInstanceID, d.UUID, ref.UUID, nvdevice.ErrNotFound)
			}
			return d.GPUInstanceID, nil
		}
		return 0, fmt.Errorf("no %s GPU instance there: %w", ref.Profile, nvdevice.ErrNotFound)
	})
}

// deleteGI destroys the compute instance of the GPU instance find names,
// then the GPU instance, in two steps as on the hardware: between them
// (StepAfterCIDestroy) the inventory shows the GPU instance without a
// compute instance.
func (m *Machine) deleteGI(ctx context.Context, parentUUID, what string, find func(*nvdevice.GPU) (int, error)) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	m.mu.Lock()
	g, err := m.gpuLocked(parentUUID)
	if err != nil {
		m.mu.Unlock()
		return fmt.Errorf("delete %s on GPU %s: %w", what, parentUUID, err)
	}
	where := fmt.Sprintf("delete %s on GPU %d (%s)", what, g.Index, g.UUID)
	id, err := find(g)
	if err != nil {
		m.mu.Unlock()
		return fmt.Errorf("%s: %w", where, err)
	}
	d := &g.MIG.Devices[giIndex(g, id)]
	hadCI := d.ComputeInstanceID >= 0
	if hadCI {
		d.Profile, d.UUID, d.ComputeInstanceID = giProfileName(*d)+noComputeInstance, "", -1
		m.changedLocked()
	}
	m.mu.Unlock()
	if hadCI {
		m.step(StepAfterCIDestroy)
	}

	m.mu.Lock()
	defer m.mu.Unlock()
	if g, err = m.gpuLocked(parentUUID); err != nil {
		return fmt.Errorf("%s: destroy GPU instance %d: %w", where, id, err)
	}
	i := giIndex(g, id)
	if i < 0 {
		return fmt.Errorf("%s: GPU instance %d is gone: %w", where, id, nvdevice.ErrNotFound)
	}
	if err := m.failGIDestroy; err != nil {
		m.failGIDestroy = nil
		return fmt.Errorf("%s: destroy GPU instance %d: %w", where, id, err)
	}
	g.MIG.Devices = append(g.MIG.Devices[:i], g.MIG.Devices[i+1:]...)
	m.changedLocked()
	return nil
}
