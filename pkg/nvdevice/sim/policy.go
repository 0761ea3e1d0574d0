package sim

import (
	"context"
	"fmt"
)

// SetTimeSlice records a GPU's time slice as nvidia-smi would set it
// (0 default .. 3 long).
func (m *Machine) SetTimeSlice(_ context.Context, gpuUUID string, level int) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, err := m.gpuLocked(gpuUUID); err != nil {
		return err
	}
	if level < 0 || level > 3 {
		return fmt.Errorf("time slice %d: must be 0 to 3", level)
	}
	if m.timeSlices == nil {
		m.timeSlices = map[string]int{}
	}
	m.timeSlices[gpuUUID] = level
	return nil
}

// TimeSlice is the GPU's time slice as last set (0 when never set), so that
// tests can read back what the driver did.
func (m *Machine) TimeSlice(gpuUUID string) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.timeSlices[gpuUUID]
}
