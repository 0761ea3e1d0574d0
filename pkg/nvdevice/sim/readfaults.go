package sim

import (
	"errors"
	"fmt"
)

// ErrInjectedRead is what an Inventory read injected to fail returns: an
// NVML query that failed for a moment (a GPU busy resetting, a driver call
// that timed out), which the next read may not repeat.
var ErrInjectedRead = errors.New("simulated NVML read failure")

// readFaults are injected Inventory failures, guarded by Machine.mu.
type readFaults struct {
	// pending: how many reads still fail; negative: every read until
	// cleared.
	pending int
	// returned counts the failures returned so far.
	returned int
}

// takeLocked returns the injected error if the read must fail.
func (f *readFaults) takeLocked() error {
	if f.pending == 0 {
		return nil
	}
	if f.pending > 0 {
		f.pending--
	}
	f.returned++
	return fmt.Errorf("read GPUs: %w", ErrInjectedRead)
}

// FailInventory makes the next n Inventory reads fail with
// ErrInjectedRead, as a transient NVML failure would; n < 0 makes every
// read fail until FailInventory(0), which clears what is left. It lets
// tests show that what depends on a read (the published slices) is retried
// rather than lost.
func (m *Machine) FailInventory(n int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.readFaults.pending = n
}

// InventoryFailures is how many injected Inventory failures were returned
// so far.
func (m *Machine) InventoryFailures() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.readFaults.returned
}

// SetTelemetryHook sets a function that Telemetry calls for each GPU, with
// its UUID, where the NVML backend takes the GPU's readings: without the
// machine's lock held. A hook that sleeps is a slow reading; one that
// blocks is a reading hung in the driver. nil removes it.
func (m *Machine) SetTelemetryHook(hook func(gpuUUID string)) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.telemetryHook = hook
}

// readingsOf calls the telemetry hook, if any, for the GPU. The lock must
// not be held: the hook may block, and may call the machine.
func (m *Machine) readingsOf(gpuUUID string) {
	m.mu.Lock()
	hook := m.telemetryHook
	m.mu.Unlock()
	if hook != nil {
		hook(gpuUUID)
	}
}
