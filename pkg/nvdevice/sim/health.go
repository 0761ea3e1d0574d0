package sim

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// Errors of a recovery the GPU's faults do not allow yet.
var (
	// ErrResetRequired: the GPU had an XID that only a GPU reset clears
	// (ResetGPU).
	ErrResetRequired = errors.New("GPU needs a reset")
	// ErrRebootRequired: the GPU had an XID that only a reboot of the node
	// clears; in the simulator, a new Machine.
	ErrRebootRequired = errors.New("node needs a reboot")
)

// faults is the health of a machine's GPUs, guarded by Machine.mu. The
// simulator recovers a GPU when the NVML backend's check would: a fault
// that needs no reset once the GPU has been quiet for the quiet period
// (nvdevice.DefaultRecoveryQuietPeriod unless SetRecoveryQuietPeriod), one
// that needs a reset at ResetGPU, one that needs a reboot never.
type faults struct {
	// unhealthy: GPU UUID -> the most demanding fault since the GPU was
	// last healthy.
	unhealthy map[string]fault
	// gen: GPU UUID -> bumped at every fault and recovery, so that a
	// pending quiet-period recovery is called off by what came after it.
	gen   map[string]int
	quiet time.Duration
}

type fault struct {
	recovery nvdevice.Recovery
	xid      uint64
}

// WatchHealth streams injected faults until ctx is done.
func (m *Machine) WatchHealth(ctx context.Context) (<-chan nvdevice.HealthEvent, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil, fmt.Errorf("simulated machine %q is closed", m.spec.Name)
	}
	return m.health.Subscribe(ctx), nil
}

// SetRecoveryQuietPeriod sets how long a GPU whose fault needs no reset
// must stay quiet before it is reported recovered; zero restores
// nvdevice.DefaultRecoveryQuietPeriod.
func (m *Machine) SetRecoveryQuietPeriod(d time.Duration) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.faults.quiet = d
}

// InjectXID reports an XID error on a GPU, or on one MIG device of it when
// migUUID is set, as the driver would. A critical XID leaves the GPU
// unhealthy until what nvdevice.XIDRecovery says it needs has happened.
func (m *Machine) InjectXID(gpuUUID, migUUID string, xid uint64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, err := m.gpuLocked(gpuUUID); err != nil {
		return err
	}
	ev := nvdevice.HealthEvent{Kind: nvdevice.HealthXID, GPUUUID: gpuUUID, MigUUID: migUUID, XID: xid,
		Time: time.Now(), Message: fmt.Sprintf("simulated XID %d", xid)}
	m.health.Publish(ev)
	if nvdevice.DefaultXIDPolicy.Critical(ev) {
		m.faultLocked(ev)
	}
	return nil
}

// LoseGPU makes a GPU fall off the bus: it vanishes from the inventory, MIG
// operations on it fail with ErrGPULost, and watchers get a gpu-lost event.
func (m *Machine) LoseGPU(gpuUUID string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, err := m.gpuLocked(gpuUUID); err != nil {
		return err
	}
	m.lost[gpuUUID] = true
	m.changedLocked()
	ev := nvdevice.HealthEvent{Kind: nvdevice.HealthGPULost, GPUUUID: gpuUUID, Time: time.Now(),
		Message: "simulated GPU fell off the bus"}
	m.health.Publish(ev)
	m.faultLocked(ev)
	return nil
}

// RecoverGPU makes a GPU answer again and tells watchers it is healthy:
// a lost GPU comes back on the bus, reinitialised, which clears a fault
// that needed a reset as the NVML check counts it; a fault that needs no
// reset is cleared before its quiet period ends. A GPU that did not fall
// off the bus and has a fault needing a reset is refused with
// ErrResetRequired (use ResetGPU), one needing a reboot always with
// ErrRebootRequired.
func (m *Machine) RecoverGPU(gpuUUID string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return fmt.Errorf("simulated machine %q is closed", m.spec.Name)
	}
	if _, err := m.inv.GPUByUUID(gpuUUID); err != nil {
		return err
	}
	f := m.faults.unhealthy[gpuUUID]
	switch {
	case f.recovery == nvdevice.RecoverNodeReboot:
		return fmt.Errorf("recover GPU %s after XID %d: %w", gpuUUID, f.xid, ErrRebootRequired)
	case f.recovery == nvdevice.RecoverGPUReset && !m.lost[gpuUUID]:
		return fmt.Errorf("recover GPU %s after XID %d: %w", gpuUUID, f.xid, ErrResetRequired)
	}
	delete(m.lost, gpuUUID)
	m.changedLocked()
	m.recoveredLocked(gpuUUID, "simulated recovery")
	return nil
}

// ResetGPU resets a GPU, as `nvidia-smi -r` does: it clears faults that
// need a reset (or none) and brings a lost GPU back, and watchers of an
// unhealthy GPU are told it recovered, as the NVML check would report it
// after a reset. A fault that needs a reboot is refused with
// ErrRebootRequired. The reset does not model what a real one also does to
// MIG instances.
func (m *Machine) ResetGPU(uuid string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return fmt.Errorf("simulated machine %q is closed", m.spec.Name)
	}
	if _, err := m.inv.GPUByUUID(uuid); err != nil {
		return err
	}
	f, bad := m.faults.unhealthy[uuid]
	if f.recovery == nvdevice.RecoverNodeReboot {
		return fmt.Errorf("reset GPU %s after XID %d: %w", uuid, f.xid, ErrRebootRequired)
	}
	bad = bad || m.lost[uuid]
	delete(m.lost, uuid)
	m.changedLocked()
	if bad {
		m.recoveredLocked(uuid, "simulated GPU reset")
	}
	return nil
}

// TrackUnhealthy takes a fault a restarted plugin remembers, or an XID
// the plugin's policy counts and the default ignores, as the machine's
// own, without publishing it again: the hardware still has it. The
// caller's policy decided that ev makes the GPU unhealthy; a recovery is
// no fault.
func (m *Machine) TrackUnhealthy(ev nvdevice.HealthEvent) error {
	if ev.Kind == nvdevice.HealthRecovered {
		return nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return fmt.Errorf("simulated machine %q is closed", m.spec.Name)
	}
	if _, err := m.inv.GPUByUUID(ev.GPUUUID); err != nil {
		return err
	}
	m.faultLocked(ev)
	return nil
}

var _ nvdevice.UnhealthyTracker = (*Machine)(nil)

// faultLocked records an event that makes the GPU unhealthy and, for one
// that needs no reset, schedules the recovery the quiet period allows.
func (m *Machine) faultLocked(ev nvdevice.HealthEvent) {
	f := &m.faults
	if f.unhealthy == nil {
		f.unhealthy, f.gen = map[string]fault{}, map[string]int{}
	}
	uuid, r := ev.GPUUUID, ev.Recovery()
	if cur, was := f.unhealthy[uuid]; !was || r > cur.recovery {
		f.unhealthy[uuid] = fault{recovery: r, xid: ev.XID}
	}
	f.gen[uuid]++
	if f.unhealthy[uuid].recovery.NeedsReset() {
		return
	}
	quiet := f.quiet
	if quiet <= 0 {
		quiet = nvdevice.DefaultRecoveryQuietPeriod
	}
	gen, since := f.gen[uuid], ev.Time
	if since.IsZero() {
		since = time.Now()
	}
	time.AfterFunc(max(0, quiet-time.Since(since)), func() {
		m.mu.Lock()
		defer m.mu.Unlock()
		if m.closed || m.lost[uuid] || m.faults.gen[uuid] != gen {
			return
		}
		m.recoveredLocked(uuid, fmt.Sprintf("simulated GPU answers and has been quiet for %s", quiet))
	})
}

// recoveredLocked forgets a GPU's faults and tells watchers it is healthy.
func (m *Machine) recoveredLocked(uuid, msg string) {
	if m.faults.gen != nil {
		delete(m.faults.unhealthy, uuid)
		m.faults.gen[uuid]++
	}
	m.health.Publish(nvdevice.HealthEvent{Kind: nvdevice.HealthRecovered, GPUUUID: uuid, Time: time.Now(), Message: msg})
}
