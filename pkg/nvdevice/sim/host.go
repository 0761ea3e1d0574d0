package sim

import (
	"context"
	"fmt"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// Majors are the device majors of a simulated node: 195 as the driver fixes
// it, and typical values for the ones allocated at module load.
var Majors = nvdevice.DeviceMajors{NVIDIA: 195, UVM: 508, Caps: 511}

// Host is what a node of this machine would tell the plugin: the simulated
// majors, the capability minors of its GPUs in the driver's numbering, and
// the machine itself as the compute policy (it records time slices).
func (m *Machine) Host(context.Context) (nvdevice.Host, error) {
	gpus := m.spec.GPUCount
	return nvdevice.Host{
		Majors: Majors,
		CapMinors: func(gpuMinor, gi, ci int) (int, int, error) {
			// The driver lists every GPU and every possible instance, and
			// nothing else: outside that range there is no node to name.
			if gpuMinor < 0 || gpuMinor >= gpus || gi < 0 || gi >= migGIs || ci < 0 || ci >= migCIs {
				return 0, 0, fmt.Errorf("MIG capability minors: no entry for gpu%d/gi%d/ci%d: %w", gpuMinor, gi, ci, nvdevice.ErrNotFound)
			}
			giMinor, ciMinor := migCapMinors(gpuMinor, gi, ci)
			return giMinor, ciMinor, nil
		},
		ComputePolicy: m,
	}, nil
}
