//go:build cgo && linux

package nvml

import (
	"context"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// TestInventorySnapshot: prepares read the GPUs through NVML once, not for
// every claim. The snapshot is the same value, with no NVML call, until
// the TTL passes, a MIG change is made through the backend, or a health
// event comes; then the GPUs are read again, a new MIG device in them.
func TestInventorySnapshot(t *testing.T) {
	gpus := board(2, nvml.DEVICE_MIG_ENABLE, "sw0")
	lib := fakeLib(gpus)
	b := testBackend(t, lib)
	now := time.Unix(1_800_000_000, 0)
	b.now = func() time.Time { return now }
	mocks := []any{lib, gpus[0].Device, gpus[1].Device}
	snapshot := func() (*nvdevice.Inventory, int) {
		t.Helper()
		before := map[string]int{}
		countCalls(before, mocks...)
		inv, err := b.InventorySnapshot(context.Background())
		require.NoError(t, err)
		after := map[string]int{}
		countCalls(after, mocks...)
		n := 0
		for k, v := range after {
			n += v - before[k]
		}
		return inv, n
	}

	first, calls := snapshot()
	assert.NotZero(t, calls, "the first snapshot reads the GPUs")
	require.Len(t, first.GPUs, 2)
	again, calls := snapshot()
	assert.Same(t, first, again)
	assert.Zero(t, calls, "the next prepare asks NVML nothing")

	now = now.Add(InventorySnapshotTTL)
	aged, calls := snapshot()
	assert.NotSame(t, first, aged, "read again once the TTL passed")
	assert.NotZero(t, calls)

	made, err := b.CreateMigDevice(context.Background(), nvdevice.MigCreateRequest{ParentUUID: "GPU-0", Profile: "1g.10gb", Start: 0})
	require.NoError(t, err)
	afterMIG, calls := snapshot()
	assert.NotZero(t, calls, "read again after a MIG change through the backend")
	assert.Contains(t, snapshotMigUUIDs(afterMIG), made.UUID)

	b.healthEvents.Add(1)
	afterEvent, calls := snapshot()
	assert.NotSame(t, afterMIG, afterEvent, "read again after a health event (a GPU lost or back)")
	assert.NotZero(t, calls)
}

func snapshotMigUUIDs(inv *nvdevice.Inventory) []string {
	var out []string
	for _, g := range inv.GPUs {
		for _, m := range g.MIG.Devices {
			out = append(out, m.UUID)
		}
	}
	return out
}

// TestInventoryPollConfirmsTheSnapshot: the plugin's inventory poll
// (Inventory, every 15 s) renews the snapshot when it finds the GPUs as
// they were, so that no prepare reads them for the snapshot's age while
// the poll runs (an 8-GPU node's read is 600 NVML calls, about 140 ms on
// the H200's cost of a call); and drops it when it finds them changed by
// another tool (nvidia-smi), so that the next prepare sees the change.
func TestInventoryPollConfirmsTheSnapshot(t *testing.T) {
	gpus := board(2, nvml.DEVICE_MIG_ENABLE, "sw0")
	lib := fakeLib(gpus)
	b := testBackend(t, lib)
	now := time.Unix(1_800_000_000, 0)
	b.now = func() time.Time { return now }
	mocks := []any{lib, gpus[0].Device, gpus[1].Device}
	calls := func() int {
		got := map[string]int{}
		countCalls(got, mocks...)
		n := 0
		for _, v := range got {
			n += v
		}
		return n
	}
	snapshot := func() (*nvdevice.Inventory, int) {
		t.Helper()
		before := calls()
		inv, err := b.InventorySnapshot(context.Background())
		require.NoError(t, err)
		return inv, calls() - before
	}
	poll := func() {
		t.Helper()
		_, err := b.Inventory(context.Background())
		require.NoError(t, err)
	}

	first, _ := snapshot()
	for range 4 { // a minute of polls, every 15 s, a prepare after each
		now = now.Add(15 * time.Second)
		poll()
		got, n := snapshot()
		assert.True(t, first == got, "the same snapshot")
		assert.Zero(t, n, "a prepare %v after the snapshot was made, the poll having found the GPUs unchanged", now.Sub(time.Unix(1_800_000_000, 0)))
	}

	gpus[1].addGI(nvml.GPU_INSTANCE_PROFILE_1_SLICE, 0, nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE) // nvidia-smi mig
	now = now.Add(15 * time.Second)
	poll()
	changed, n := snapshot()
	assert.False(t, first == changed, "the poll found another tool's MIG device: the snapshot is dropped")
	assert.NotZero(t, n)
	assert.NotEmpty(t, snapshotMigUUIDs(changed))
}
