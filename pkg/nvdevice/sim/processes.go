package sim

import (
	"fmt"
	"slices"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// usage is what runs on the machine's devices (StartProcess) and the ECC
// errors injected into its GPUs (InjectECC), for Telemetry.
type usage struct {
	// procs: GPU or MIG device UUID -> PID -> the process's use of it.
	procs map[string]map[int]simProcess
	// ecc: GPU UUID -> injected error counts.
	ecc map[string]eccCounts
}

type simProcess struct {
	smShare     float64
	memoryBytes uint64
}

type eccCounts struct{ corrected, uncorrected uint64 }

// StartProcess lists a process on a GPU or MIG device (by UUID) with the
// share of the device's SMs it keeps busy (0..1) and the framebuffer it
// holds; utilization, framebuffer used, power, temperature, clocks, GPM
// and NVLink follow the sum of the device's processes (and SetLoad). A PID
// may be on several devices (call once per device); calling again for the
// same device and PID replaces its figures.
func (m *Machine) StartProcess(deviceUUID string, pid int, smShare float64, memoryBytes uint64) error {
	if pid <= 0 {
		return fmt.Errorf("process %d on %s: want a PID above 0", pid, deviceUUID)
	}
	if smShare < 0 || smShare > 1 {
		return fmt.Errorf("process %d on %s: SM share %v: want 0 to 1", pid, deviceUUID, smShare)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.hasDeviceLocked(deviceUUID) {
		return fmt.Errorf("process %d on device %s: %w", pid, deviceUUID, nvdevice.ErrNotFound)
	}
	if m.usage.procs == nil {
		m.usage.procs = map[string]map[int]simProcess{}
	}
	if m.usage.procs[deviceUUID] == nil {
		m.usage.procs[deviceUUID] = map[int]simProcess{}
	}
	m.usage.procs[deviceUUID][pid] = simProcess{smShare: smShare, memoryBytes: memoryBytes}
	return nil
}

// EndProcess takes the PID off every device.
func (m *Machine) EndProcess(pid int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for uuid, procs := range m.usage.procs {
		delete(procs, pid)
		if len(procs) == 0 {
			delete(m.usage.procs, uuid)
		}
	}
}

// InjectECC adds corrected and uncorrected ECC errors to a GPU's volatile
// and aggregate counts.
func (m *Machine) InjectECC(gpuUUID string, corrected, uncorrected uint64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	found := false
	for _, g := range m.inv.GPUs {
		found = found || g.UUID == gpuUUID
	}
	if !found {
		return fmt.Errorf("inject ECC errors into GPU %s: %w", gpuUUID, nvdevice.ErrNotFound)
	}
	if m.usage.ecc == nil {
		m.usage.ecc = map[string]eccCounts{}
	}
	c := m.usage.ecc[gpuUUID]
	c.corrected += corrected
	c.uncorrected += uncorrected
	m.usage.ecc[gpuUUID] = c
	return nil
}

// hasDeviceLocked says whether a GPU or MIG device with the UUID exists.
func (m *Machine) hasDeviceLocked(uuid string) bool {
	for _, g := range m.inv.GPUs {
		if g.UUID == uuid {
			return true
		}
		for _, d := range g.MIG.Devices {
			if d.UUID == uuid {
				return true
			}
		}
	}
	return false
}

// deviceUse is what a device's processes and load ask of it.
type deviceUse struct {
	// busy is the device's utilization: its load plus its processes' SM
	// shares, at most 1.
	busy float64
	// processBytes is the framebuffer the processes hold.
	processBytes float64
	// processes as NVML lists them, by PID; SM utilization filled where
	// perProcessSM.
	processes []nvdevice.ProcessSample
}

// useOf sums a device's processes. An over-asked device (shares summing
// above 1) gives each process share/sum of it.
func (m *Machine) useOf(uuid string, perProcessSM bool) deviceUse {
	procs := m.usage.procs[uuid]
	pids := make([]int, 0, len(procs))
	asked := 0.0
	u := deviceUse{}
	for pid, p := range procs {
		pids = append(pids, pid)
		asked += p.smShare
		u.processBytes += float64(p.memoryBytes)
	}
	slices.Sort(pids)
	for _, pid := range pids {
		p := procs[pid]
		ps := nvdevice.ProcessSample{PID: pid, UsedMemoryBytes: nvdevice.Read(float64(p.memoryBytes))}
		if perProcessSM {
			sm := p.smShare
			if asked > 1 {
				sm /= asked
			}
			ps.SMUtilization = nvdevice.Read(sm)
		}
		u.processes = append(u.processes, ps)
	}
	u.busy = min(1, m.load[uuid]+asked)
	return u
}
