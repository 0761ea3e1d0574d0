package sim

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

var e3g = nvdevice.Engines{Multiprocessors: 60, CopyEngines: 3, Decoders: 3, JPEGEngines: 3}

// killAt is a step hook that panics at the given step, as a kill would stop
// the process there.
func killAt(step string) func(string) {
	return func(s string) {
		if s == step {
			panic("killed at " + s)
		}
	}
}

// assertUnlocked fails when a panicking hook left the machine's mutex held.
func assertUnlocked(t *testing.T, m *Machine) {
	t.Helper()
	require.True(t, m.mu.TryLock(), "the machine's mutex is still held after the hook panicked")
	m.mu.Unlock()
}

// orphan3g is a 3g.40gb GPU instance at 4 without compute instance, as NVML
// reports it.
func orphan3g(gpu string, giID int) nvdevice.MigDevice {
	return nvdevice.MigDevice{UUID: "", ParentUUID: gpu, ParentIndex: 0, Profile: "3g.40gb (no compute instance)",
		Placement: nvdevice.Placement{Start: 4, Size: 4}, GPUInstanceID: giID, ComputeInstanceID: -1, MemoryMiB: 40448, Engines: e3g}
}

func TestMigStepsInOrder(t *testing.T) {
	ctx := context.Background()
	m, gpu := oneGPU(t, true)
	var steps []string
	var between []nvdevice.MigDevice
	m.SetStepHook(func(s string) {
		steps = append(steps, s)
		// The lock is not held: the hook can read the state in between.
		between = append(between, inventory(t, m).GPUs[0].MIG.Devices...)
	})
	d, err := m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: "3g.40gb", Start: 4})
	require.NoError(t, err)
	require.NoError(t, m.DeleteMigPlacement(ctx, nvdevice.MigPlacementRef{ParentUUID: gpu, Profile: "3g.40gb", Start: 4, UUID: d.UUID}))
	assert.Equal(t, []string{StepAfterGICreate, StepAfterCIDestroy}, steps)
	assert.Equal(t, []nvdevice.MigDevice{orphan3g(gpu, d.GPUInstanceID), orphan3g(gpu, d.GPUInstanceID)}, between,
		"between the steps the GPU instance is there without compute instance")
	assert.Empty(t, inventory(t, m).GPUs[0].MIG.Devices)
}

func TestKillAfterGICreate(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name    string
		killed  placement
		then    placement
		wantErr error
	}{
		{name: "the placement stays taken", killed: placement{"3g.40gb", 4}, then: placement{"3g.40gb", 4}, wantErr: nvdevice.ErrInsufficientResources},
		{name: "overlapping placements stay taken", killed: placement{"3g.40gb", 4}, then: placement{"1g.10gb", 5}, wantErr: nvdevice.ErrInsufficientResources},
		{name: "it counts towards the profile's instances", killed: placement{"1g.10gb+me", 0}, then: placement{"1g.10gb+me", 3}, wantErr: nvdevice.ErrInsufficientResources},
		{name: "other placements stay free", killed: placement{"3g.40gb", 4}, then: placement{"3g.40gb", 0}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, gpu := oneGPU(t, true)
			m.SetStepHook(killAt(StepAfterGICreate))
			require.PanicsWithValue(t, "killed at "+StepAfterGICreate, func() {
				_, _ = m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: tc.killed.profile, Start: tc.killed.start})
			})
			assertUnlocked(t, m)
			m.SetStepHook(nil)

			devs := inventory(t, m).GPUs[0].MIG.Devices
			require.Len(t, devs, 1)
			assert.Equal(t, tc.killed.profile+" (no compute instance)", devs[0].Profile)
			assert.Equal(t, -1, devs[0].ComputeInstanceID)
			assert.Empty(t, devs[0].UUID)
			assert.Equal(t, tc.killed.start, devs[0].Placement.Start)

			_, err := m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: tc.then.profile, Start: tc.then.start})
			if tc.wantErr != nil {
				require.ErrorIs(t, err, tc.wantErr)
				assert.Len(t, inventory(t, m).GPUs[0].MIG.Devices, 1)
			} else {
				require.NoError(t, err)
				assert.Len(t, inventory(t, m).GPUs[0].MIG.Devices, 2)
			}
		})
	}
}

func TestDeleteMigPlacementAfterKilledCreate(t *testing.T) {
	ctx := context.Background()
	m, gpu := oneGPU(t, true)
	m.SetStepHook(killAt(StepAfterGICreate))
	require.Panics(t, func() {
		_, _ = m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: "3g.40gb", Start: 4})
	})
	assertUnlocked(t, m)
	m.SetStepHook(nil)
	require.Equal(t, []nvdevice.MigDevice{orphan3g(gpu, 1)}, inventory(t, m).GPUs[0].MIG.Devices)

	// The plugin recorded the placement, not yet a UUID.
	ref := nvdevice.MigPlacementRef{ParentUUID: gpu, Profile: "3g.40gb", Start: 4}
	require.NoError(t, m.DeleteMigPlacement(ctx, ref))
	assert.Empty(t, inventory(t, m).GPUs[0].MIG.Devices)
	require.ErrorIs(t, m.DeleteMigPlacement(ctx, ref), nvdevice.ErrNotFound, "a second delete finds nothing")

	d, err := m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: "3g.40gb", Start: 4})
	require.NoError(t, err, "the placement is free again")
	assert.Equal(t, "3g.40gb", d.Profile)
	assert.Equal(t, 0, d.ComputeInstanceID)
	assert.NotEmpty(t, d.UUID)
}

// retry is one way a caller deletes a MIG device it created.
type retry struct {
	name string
	del  func(m *Machine, d *nvdevice.MigDevice) error
}

var deleteWays = []retry{
	{"by placement", func(m *Machine, d *nvdevice.MigDevice) error {
		return m.DeleteMigPlacement(context.Background(), nvdevice.MigPlacementRef{ParentUUID: d.ParentUUID, Profile: d.Profile, Start: d.Placement.Start, UUID: d.UUID})
	}},
	{"by instance ids", func(m *Machine, d *nvdevice.MigDevice) error {
		return m.DeleteMigDevice(context.Background(), nvdevice.MigDeviceRef{ParentUUID: d.ParentUUID, GPUInstanceID: d.GPUInstanceID, ComputeInstanceID: d.ComputeInstanceID, UUID: d.UUID})
	}},
}

// TestInterruptedDeleteIsFinishedByARetry: a delete stopped after the
// compute instance went (by a kill, or a GPU instance NVML would not
// destroy) leaves the GPU instance; the retry, by placement or by ids,
// destroys it instead of taking ErrNotFound for done.
func TestInterruptedDeleteIsFinishedByARetry(t *testing.T) {
	interruptions := []struct {
		name      string
		interrupt func(t *testing.T, m *Machine, del func() error)
	}{
		{"kill after the compute instance went", func(t *testing.T, m *Machine, del func() error) {
			m.SetStepHook(killAt(StepAfterCIDestroy))
			require.PanicsWithValue(t, "killed at "+StepAfterCIDestroy, func() { _ = del() })
			assertUnlocked(t, m)
			m.SetStepHook(nil)
		}},
		{"GPU instance destroy fails", func(t *testing.T, m *Machine, del func() error) {
			m.FailNextGIDestroy(nvdevice.ErrInUse)
			err := del()
			require.ErrorIs(t, err, nvdevice.ErrInUse)
			assert.Contains(t, err.Error(), "destroy GPU instance 1")
		}},
	}
	for _, in := range interruptions {
		for _, first := range deleteWays {
			for _, again := range deleteWays {
				t.Run(in.name+"/"+first.name+" then "+again.name, func(t *testing.T) {
					m, gpu := oneGPU(t, true)
					d, err := m.CreateMigDevice(context.Background(), nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: "3g.40gb", Start: 4})
					require.NoError(t, err)

					in.interrupt(t, m, func() error { return first.del(m, d) })
					require.Equal(t, []nvdevice.MigDevice{orphan3g(gpu, d.GPUInstanceID)}, inventory(t, m).GPUs[0].MIG.Devices,
						"the GPU instance is left without compute instance")

					require.NoError(t, again.del(m, d), "the retry finishes the delete")
					assert.Empty(t, inventory(t, m).GPUs[0].MIG.Devices)
					require.ErrorIs(t, again.del(m, d), nvdevice.ErrNotFound, "then it is gone")
					_, err = m.CreateMigDevice(context.Background(), nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: "3g.40gb", Start: 4})
					require.NoError(t, err, "the placement is free again")
				})
			}
		}
	}
}

func TestFailNextGIDestroyFailsOnce(t *testing.T) {
	ctx := context.Background()
	m, gpu := oneGPU(t, true)
	boom := errors.New("boom")
	m.FailNextGIDestroy(boom)
	a, err := m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: "3g.40gb", Start: 0})
	require.NoError(t, err, "creating is not affected")
	b, err := m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: "3g.40gb", Start: 4})
	require.NoError(t, err)
	require.ErrorIs(t, deleteWays[0].del(m, a), boom)
	require.NoError(t, deleteWays[0].del(m, b), "only the next destroy fails")
	devs := inventory(t, m).GPUs[0].MIG.Devices
	require.Len(t, devs, 1)
	assert.Equal(t, "3g.40gb (no compute instance)", devs[0].Profile)
	assert.Equal(t, 0, devs[0].Placement.Start)
}

func TestDeleteMigPlacementNotFound(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name      string
		ref       func(gpu string, d *nvdevice.MigDevice) nvdevice.MigPlacementRef
		migOff    bool
		wantInMsg string
	}{
		{name: "another MIG device's UUID", ref: func(gpu string, d *nvdevice.MigDevice) nvdevice.MigPlacementRef {
			return nvdevice.MigPlacementRef{ParentUUID: gpu, Profile: "3g.40gb", Start: 4, UUID: "MIG-00000000-0000-0000-0000-000000000000"}
		}, wantInMsg: "not MIG-00000000-0000-0000-0000-000000000000"},
		{name: "no GPU instance at the placement", ref: func(gpu string, _ *nvdevice.MigDevice) nvdevice.MigPlacementRef {
			return nvdevice.MigPlacementRef{ParentUUID: gpu, Profile: "3g.40gb", Start: 0}
		}, wantInMsg: "delete MIG 3g.40gb at placement start 0 on GPU 0"},
		{name: "another profile at the placement", ref: func(gpu string, _ *nvdevice.MigDevice) nvdevice.MigPlacementRef {
			return nvdevice.MigPlacementRef{ParentUUID: gpu, Profile: "1g.10gb", Start: 4}
		}, wantInMsg: "no 1g.10gb GPU instance there"},
		{name: "unknown GPU", ref: func(string, *nvdevice.MigDevice) nvdevice.MigPlacementRef {
			return nvdevice.MigPlacementRef{ParentUUID: "GPU-nope", Profile: "3g.40gb", Start: 4}
		}, wantInMsg: "GPU-nope"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, gpu := oneGPU(t, true)
			d, err := m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: "3g.40gb", Start: 4})
			require.NoError(t, err)
			var steps []string
			m.SetStepHook(func(s string) { steps = append(steps, s) })

			err = m.DeleteMigPlacement(ctx, tc.ref(gpu, d))
			require.ErrorIs(t, err, nvdevice.ErrNotFound)
			assert.Contains(t, err.Error(), tc.wantInMsg)
			assert.Equal(t, []nvdevice.MigDevice{*d}, inventory(t, m).GPUs[0].MIG.Devices, "nothing destroyed")
			assert.Empty(t, steps, "not even the compute instance")
		})
	}

	t.Run("MIG mode off", func(t *testing.T) {
		m, gpu := oneGPU(t, false)
		err := m.DeleteMigPlacement(ctx, nvdevice.MigPlacementRef{ParentUUID: gpu, Profile: "3g.40gb", Start: 4})
		require.ErrorIs(t, err, nvdevice.ErrNotFound)
	})
}

// TestDeleteMigDeviceLeavesOthersAlone: the ids of a GPU instance that has
// another compute instance, or another MIG device, are not found.
func TestDeleteMigDeviceLeavesOthersAlone(t *testing.T) {
	ctx := context.Background()
	m, gpu := oneGPU(t, true)
	d, err := m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: "3g.40gb", Start: 4})
	require.NoError(t, err)
	for _, ref := range []nvdevice.MigDeviceRef{
		{ParentUUID: gpu, GPUInstanceID: d.GPUInstanceID, ComputeInstanceID: 3},
		{ParentUUID: gpu, GPUInstanceID: d.GPUInstanceID, ComputeInstanceID: 0, UUID: "MIG-other"},
		{ParentUUID: gpu, GPUInstanceID: 5, ComputeInstanceID: 0},
	} {
		require.ErrorIs(t, m.DeleteMigDevice(ctx, ref), nvdevice.ErrNotFound, "%+v", ref)
	}
	assert.Equal(t, []nvdevice.MigDevice{*d}, inventory(t, m).GPUs[0].MIG.Devices)
}
