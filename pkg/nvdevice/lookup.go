package nvdevice

import "fmt"

// GPUByUUID returns the GPU with the given UUID.
func (inv *Inventory) GPUByUUID(uuid string) (*GPU, error) {
	for i := range inv.GPUs {
		if inv.GPUs[i].UUID == uuid {
			return &inv.GPUs[i], nil
		}
	}
	return nil, fmt.Errorf("GPU %q: %w", uuid, ErrNotFound)
}

// Profile returns the MIG profile with the given name ("3g.40gb").
func (g *GPU) Profile(name string) (*MigProfile, error) {
	for i := range g.MIG.Profiles {
		if g.MIG.Profiles[i].Name == name {
			return &g.MIG.Profiles[i], nil
		}
	}
	return nil, fmt.Errorf("MIG profile %q on GPU %d (%s): %w", name, g.Index, g.UUID, ErrNotFound)
}

// AllowsPlacement reports whether start is one of the profile's placements.
func (p *MigProfile) AllowsPlacement(start int) (Placement, bool) {
	for _, pl := range p.Placements {
		if pl.Start == start {
			return pl, true
		}
	}
	return Placement{}, false
}
