package sim

import (
	"fmt"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// UnloadDriver simulates the NVIDIA kernel driver going away under a
// running plugin (the first half of a driver upgrade or reload): until
// LoadDriver, every NVML read and MIG operation fails with
// nvdevice.ErrDriverNotLoaded. As on real GPUs, MIG instances do not
// survive the unload (MIG mode does).
func (m *Machine) UnloadDriver() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.driverUnloaded = true
	for i := range m.inv.GPUs {
		m.inv.GPUs[i].MIG.Devices = nil
	}
	m.changedLocked()
}

// LoadDriver loads the driver again, at a new version (driver and CUDA
// driver versions as NVML reports them; empty keeps the old one).
func (m *Machine) LoadDriver(driverVersion, cudaDriverVersion string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.driverUnloaded = false
	if driverVersion != "" {
		m.inv.DriverVersion = driverVersion
	}
	if cudaDriverVersion != "" {
		m.inv.CUDADriverVersion = cudaDriverVersion
	}
	for i := range m.inv.GPUs {
		m.inv.GPUs[i].DriverVersion, m.inv.GPUs[i].CUDADriverVersion = m.inv.DriverVersion, m.inv.CUDADriverVersion
	}
	m.changedLocked()
}

// driverLoadedLocked is the error of an NVML call while the driver is
// unloaded. The caller holds m.mu.
func (m *Machine) driverLoadedLocked(op string) error {
	if m.driverUnloaded {
		return fmt.Errorf("%s: %w", op, nvdevice.ErrDriverNotLoaded)
	}
	return nil
}
