//go:build cgo && linux

package nvml

import (
	"context"
	"time"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// InventorySnapshotTTL bounds how old the inventory a prepare plans with
// may be. A full read asks NVML about every GPU (its MIG mode, profiles,
// placements, NVLink, fabric: dozens of calls a GPU), which is most of what
// a prepare on a real GPU spends that one on the simulator does not
// (docs/benchmarks.md, issue 50); the devices do not change between one
// claim and the next, except by a MIG change, which the backend sees when
// it makes it, or by a tool outside the plugin (nvidia-smi), which the
// TTL bounds. A prepare whose device is not in the snapshot reads the GPUs
// again before it fails (plugin: prepareLocked).
const InventorySnapshotTTL = 5 * time.Second

var _ nvdevice.InventorySnapshotter = (*Backend)(nil)

// InventorySnapshot is the last inventory read, as long as it is younger
// than InventorySnapshotTTL, no MIG change was made through the backend
// and no health event came since (a GPU lost or back); else a new read,
// kept for the next caller. Nobody may modify it.
func (b *Backend) InventorySnapshot(ctx context.Context) (*nvdevice.Inventory, error) {
	var inv *nvdevice.Inventory
	err := b.locked(func() error {
		now := b.now()
		events := b.healthEvents.Load()
		if b.snap != nil && b.snapChanges == b.migChanges && b.snapEvents == events && now.Sub(b.snapAt) < InventorySnapshotTTL {
			inv = b.snap
			return nil
		}
		fresh, err := b.readInventory(ctx)
		if err != nil {
			return err
		}
		b.snap, b.snapAt, b.snapChanges, b.snapEvents = fresh, now, b.migChanges, events
		inv = fresh
		return nil
	})
	return inv, err
}
