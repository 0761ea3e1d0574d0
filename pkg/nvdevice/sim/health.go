package sim

import (
	"context"
	"fmt"
	"time"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// WatchHealth streams injected faults until ctx is done.
func (m *Machine) WatchHealth(ctx context.Context) (<-chan nvdevice.HealthEvent, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil, fmt.Errorf("simulated machine %q is closed", m.spec.Name)
	}
	return m.health.Subscribe(ctx), nil
}

// InjectXID reports an XID error on a GPU, or on one MIG device of it when
// migUUID is set, as the driver would.
func (m *Machine) InjectXID(gpuUUID, migUUID string, xid uint64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, err := m.gpuLocked(gpuUUID); err != nil {
		return err
	}
	m.health.Publish(nvdevice.HealthEvent{Kind: nvdevice.HealthXID, GPUUUID: gpuUUID, MigUUID: migUUID, XID: xid,
		Time: time.Now(), Message: fmt.Sprintf("simulated XID %d", xid)})
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
	m.health.Publish(nvdevice.HealthEvent{Kind: nvdevice.HealthGPULost, GPUUUID: gpuUUID, Time: time.Now(),
		Message: "simulated GPU fell off the bus"})
	return nil
}

// RecoverGPU brings a lost GPU back (or clears an XID condition) and tells
// watchers the GPU is healthy again.
func (m *Machine) RecoverGPU(gpuUUID string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return fmt.Errorf("simulated machine %q is closed", m.spec.Name)
	}
	if _, err := m.inv.GPUByUUID(gpuUUID); err != nil {
		return err
	}
	delete(m.lost, gpuUUID)
	m.health.Publish(nvdevice.HealthEvent{Kind: nvdevice.HealthRecovered, GPUUUID: gpuUUID, Time: time.Now(),
		Message: "simulated recovery"})
	return nil
}
