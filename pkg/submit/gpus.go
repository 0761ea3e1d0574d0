package submit

import (
	"context"
	"slices"
	"sync"

	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

// gpuFacts are read once from the simulator's built-in machines, which are
// faithful to the supported GPUs (H100, H200): the MIG profiles they offer
// and the smallest whole GPU.
var gpuFacts = sync.OnceValue(func() (f struct {
	profiles  []string
	memoryMiB uint64
	sms       int
}) {
	for _, name := range sim.BuiltinMachines() {
		m, err := sim.NewBuiltin(name, "submit")
		if err != nil {
			continue
		}
		inv, err := m.Inventory(context.Background())
		_ = m.Close()
		if err != nil {
			continue
		}
		for _, g := range inv.GPUs {
			for _, p := range g.MIG.Profiles {
				if !slices.Contains(f.profiles, p.Name) {
					f.profiles = append(f.profiles, p.Name)
				}
			}
			if f.memoryMiB == 0 || g.MemoryMiB < f.memoryMiB {
				f.memoryMiB = g.MemoryMiB
			}
			if f.sms == 0 || g.Engines.Multiprocessors < f.sms {
				f.sms = g.Engines.Multiprocessors
			}
		}
	}
	slices.Sort(f.profiles)
	return f
})

// KnownMIGProfiles are the MIG profiles of the supported GPUs, sorted.
func KnownMIGProfiles() []string { return slices.Clone(gpuFacts().profiles) }

// SmallestGPU is the memory (MiB) and SM count of the smallest supported
// GPU: a fractional share is of it, so that it fits on every one.
func SmallestGPU() (memoryMiB uint64, multiprocessors int) {
	f := gpuFacts()
	return f.memoryMiB, f.sms
}
