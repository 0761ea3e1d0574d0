package sim

import (
	"context"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

func snapshot(t *testing.T, m *Machine) *nvdevice.Inventory {
	t.Helper()
	inv, err := m.InventorySnapshot(context.Background())
	require.NoError(t, err)
	return inv
}

// stateNow is what the machine's state is now, made from its fields and
// not through the snapshot: the oracle the snapshot must match.
func stateNow(m *Machine) *nvdevice.Inventory {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := &nvdevice.Inventory{DriverVersion: m.inv.DriverVersion, CUDADriverVersion: m.inv.CUDADriverVersion}
	for _, g := range m.inv.GPUs {
		if !m.lost[g.UUID] {
			out.GPUs = append(out.GPUs, copyGPU(g))
		}
	}
	return out
}

// TestInventorySnapshotIsSharedUntilTheMachineChanges: reads without a
// change in between get the same snapshot; Inventory still gives each
// caller a copy of its own.
func TestInventorySnapshotIsSharedUntilTheMachineChanges(t *testing.T) {
	m, err := NewBuiltin("dgx-h100", "node-a")
	require.NoError(t, err)
	first := snapshot(t, m)
	assert.Same(t, first, snapshot(t, m))
	assert.Equal(t, stateNow(m), first)

	own := inventory(t, m)
	assert.NotSame(t, first, own)
	assert.Equal(t, first, own)
	own.GPUs[0].MIG.Profiles[0].Placements[0].Start = 99
	own.GPUs[1].MIG.Enabled = !own.GPUs[1].MIG.Enabled
	assert.Equal(t, stateNow(m), snapshot(t, m), "a caller's copy shares nothing with the snapshot")
}

// TestInventorySnapshotFollowsEveryChange: after each kind of change to
// what Inventory shows, the next snapshot is a new one that shows it.
func TestInventorySnapshotFollowsEveryChange(t *testing.T) {
	ctx := context.Background()
	m, err := NewBuiltin("dgx-h100", "node-a")
	require.NoError(t, err)
	inv := inventory(t, m)
	gpu0, gpu3 := inv.GPUs[0].UUID, inv.GPUs[3].UUID
	var created *nvdevice.MigDevice
	for _, c := range []struct {
		name   string
		change func() error
		check  func(t *testing.T, s *nvdevice.Inventory)
	}{
		{"MIG device created", func() error {
			var err error
			created, err = m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu0, Profile: "3g.40gb", Start: 4})
			return err
		}, func(t *testing.T, s *nvdevice.Inventory) {
			require.Len(t, s.GPUs[0].MIG.Devices, 1)
			assert.Equal(t, created.UUID, s.GPUs[0].MIG.Devices[0].UUID)
		}},
		{"MIG device destroyed", func() error {
			return m.DeleteMigDevice(ctx, nvdevice.MigDeviceRef{ParentUUID: gpu0, GPUInstanceID: created.GPUInstanceID, ComputeInstanceID: created.ComputeInstanceID})
		}, func(t *testing.T, s *nvdevice.Inventory) { assert.Empty(t, s.GPUs[0].MIG.Devices) }},
		{"MIG placement created again", func() error {
			_, err := m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu0, Profile: "1g.10gb", Start: 0})
			return err
		}, func(t *testing.T, s *nvdevice.Inventory) { assert.Len(t, s.GPUs[0].MIG.Devices, 1) }},
		{"MIG placement destroyed", func() error {
			return m.DeleteMigPlacement(ctx, nvdevice.MigPlacementRef{ParentUUID: gpu0, Profile: "1g.10gb", Start: 0})
		}, func(t *testing.T, s *nvdevice.Inventory) { assert.Empty(t, s.GPUs[0].MIG.Devices) }},
		{"GPU lost", func() error { return m.LoseGPU(gpu3) }, func(t *testing.T, s *nvdevice.Inventory) {
			assert.Len(t, s.GPUs, 7)
		}},
		{"lost GPU recovered", func() error { return m.RecoverGPU(gpu3) }, func(t *testing.T, s *nvdevice.Inventory) {
			assert.Len(t, s.GPUs, 8)
		}},
		{"lost GPU reset", func() error {
			if err := m.LoseGPU(gpu3); err != nil {
				return err
			}
			if len(snapshot(t, m).GPUs) != 7 {
				t.Error("the lost GPU is listed")
			}
			return m.ResetGPU(gpu3)
		}, func(t *testing.T, s *nvdevice.Inventory) { assert.Len(t, s.GPUs, 8) }},
		{"driver reloaded at a new version", func() error {
			if _, err := m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu0, Profile: "1g.10gb", Start: 0}); err != nil {
				return err
			}
			snapshot(t, m)
			m.UnloadDriver()
			_, err := m.InventorySnapshot(ctx)
			require.ErrorIs(t, err, nvdevice.ErrDriverNotLoaded)
			m.LoadDriver("580.1.2", "13.0")
			return nil
		}, func(t *testing.T, s *nvdevice.Inventory) {
			assert.Equal(t, "580.1.2", s.DriverVersion)
			assert.Equal(t, "580.1.2", s.GPUs[5].DriverVersion)
			assert.Empty(t, s.GPUs[0].MIG.Devices, "MIG instances do not survive the unload")
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			before := snapshot(t, m)
			require.NoError(t, c.change())
			after := snapshot(t, m)
			assert.NotSame(t, before, after)
			assert.Equal(t, stateNow(m), after)
			c.check(t, after)
		})
	}
}

// TestInventorySnapshotHandedOutNeverChanges: a snapshot shares nothing
// the machine changes later, not even in the middle of a MIG operation
// (the machine changes a MIG device in place when it gives its GPU
// instance a compute instance, or takes it away).
func TestInventorySnapshotHandedOutNeverChanges(t *testing.T) {
	ctx := context.Background()
	m, err := NewBuiltin("dgx-h100", "node-a")
	require.NoError(t, err)
	gpu0 := inventory(t, m).GPUs[0].UUID
	var mid []taken
	m.SetStepHook(func(string) {
		s := snapshot(t, m)
		mid = append(mid, taken{s, copyInventory(s)})
	})
	start := snapshot(t, m)
	startCopy := copyInventory(start)
	d, err := m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu0, Profile: "3g.40gb", Start: 4})
	require.NoError(t, err)
	assert.Equal(t, stateNow(m), snapshot(t, m), "the snapshot taken in the middle is not the last word")
	require.NoError(t, m.DeleteMigDevice(ctx, nvdevice.MigDeviceRef{ParentUUID: gpu0, GPUInstanceID: d.GPUInstanceID, ComputeInstanceID: d.ComputeInstanceID}))
	assert.Equal(t, stateNow(m), snapshot(t, m))
	_, err = m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu0, Profile: "1g.10gb", Start: 0})
	require.NoError(t, err)
	assert.Equal(t, stateNow(m), snapshot(t, m))

	assert.Equal(t, startCopy, start)
	require.Len(t, mid, 3, "after the first GI create, the CI destroy and the second GI create")
	for i, s := range mid {
		assert.Equal(t, s.copy, s.snap, "snapshot %d changed after it was handed out", i)
	}
	assert.Equal(t, -1, mid[0].snap.GPUs[0].MIG.Devices[0].ComputeInstanceID, "taken between the GPU instance and its compute instance")
}

// TestInventorySnapshotUnderConcurrentChanges: readers take snapshots
// while MIG devices come and go; every snapshot is one the machine was in
// (all of one GPU's MIG devices complete or all of them in the middle of
// an operation, never torn) and stays as it was read. Run with -race
// (CGO_ENABLED=1) it also checks that nothing is read unguarded.
func TestInventorySnapshotUnderConcurrentChanges(t *testing.T) {
	ctx := context.Background()
	m, err := NewBuiltin("dgx-h100", "node-a")
	require.NoError(t, err)
	gpus := inventory(t, m).GPUs
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for i := 0; i < 4; i++ {
		gpu := gpus[i].UUID
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := 0; j < 50; j++ {
				d, err := m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: "3g.40gb", Start: 4})
				if !assert.NoError(t, err) {
					return
				}
				if !assert.NoError(t, m.DeleteMigDevice(ctx, nvdevice.MigDeviceRef{ParentUUID: gpu, GPUInstanceID: d.GPUInstanceID, ComputeInstanceID: d.ComputeInstanceID})) {
					return
				}
			}
		}()
	}
	var readers sync.WaitGroup
	for r := 0; r < 4; r++ {
		readers.Add(1)
		go func() {
			defer readers.Done()
			var kept []taken
			for {
				select {
				case <-stop:
					for _, k := range kept {
						assert.Equal(t, k.copy, k.snap, "a snapshot changed after it was handed out")
					}
					return
				default:
				}
				s, err := m.InventorySnapshot(ctx)
				if !assert.NoError(t, err) {
					return
				}
				for _, g := range s.GPUs {
					for _, d := range g.MIG.Devices {
						assert.Equal(t, d.UUID == "", d.ComputeInstanceID < 0, "a MIG device has a UUID exactly when it has a compute instance")
					}
				}
				if len(kept) < 200 {
					kept = append(kept, taken{s, copyInventory(s)})
				}
			}
		}()
	}
	wg.Wait()
	close(stop)
	readers.Wait()
	assert.Equal(t, stateNow(m), snapshot(t, m))
}

// taken is a snapshot as handed out, and a copy of it made then.
type taken struct{ snap, copy *nvdevice.Inventory }
