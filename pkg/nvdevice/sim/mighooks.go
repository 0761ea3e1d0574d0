package sim

// Steps of a MIG operation at which SetStepHook's hook is called. A hook that
// panics there simulates a kill of the process between the two NVML calls.
const (
	// StepAfterGICreate: the GPU instance exists, its compute instance not yet.
	StepAfterGICreate = "after-gi-create"
	// StepAfterCIDestroy: the compute instances are gone, the GPU instance is
	// still there.
	StepAfterCIDestroy = "after-ci-destroy"
)

// SetStepHook sets a function called, without the machine's lock held, at
// each step of a MIG create or destroy (StepAfterGICreate,
// StepAfterCIDestroy). nil removes it. A hook may panic to simulate a kill:
// the machine is left in the state between the two steps, as the hardware
// would be.
func (m *Machine) SetStepHook(hook func(step string)) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.stepHook = hook
}

// FailNextGIDestroy makes the next GPU-instance destroy fail with err, after
// the instance's compute instances were destroyed, as NVML can (IN_USE).
// nil clears it.
func (m *Machine) FailNextGIDestroy(err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.failGIDestroy = err
}

// step calls the step hook, if any. The lock must not be held: the hook may
// panic, and may call the machine.
func (m *Machine) step(name string) {
	m.mu.Lock()
	hook := m.stepHook
	m.mu.Unlock()
	if hook != nil {
		hook(name)
	}
}
