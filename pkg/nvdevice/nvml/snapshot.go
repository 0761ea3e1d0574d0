//go:build cgo && linux

package nvml

import (
	"context"
	"reflect"
	"time"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// InventorySnapshotTTL bounds how old the inventory a prepare plans with
// may be. A full read asks NVML about every GPU (its MIG mode, profiles,
// placements, NVLink, fabric: 75 calls a GPU), which is most of what a
// prepare on a real GPU spent that one on the simulator does not
// (docs/benchmarks.md, issue 50). The devices do not change between one
// claim and the next, except by a MIG change, which the backend sees when
// it makes it, a health event (a GPU lost or back), which it sees too, or a
// tool outside the plugin (nvidia-smi), which the plugin's inventory poll
// (every 15 s) sees: each full read the poll makes (Inventory) confirms the
// snapshot when it finds the GPUs unchanged, and drops it when not. So
// while the poll runs, no prepare reads the GPUs because of the snapshot's
// age; the TTL is the bound where nothing polls. A prepare whose device is
// not in the snapshot reads the GPUs again before it fails (plugin:
// prepareLocked).
const InventorySnapshotTTL = 30 * time.Second

var _ nvdevice.InventorySnapshotter = (*Backend)(nil)

// InventorySnapshot is the last inventory read, as long as it is younger
// than InventorySnapshotTTL (or was confirmed by a full read since), no
// MIG change was made through the backend and no health event came since;
// else a new read, kept for the next caller. Nobody may modify it.
func (b *Backend) InventorySnapshot(ctx context.Context) (*nvdevice.Inventory, error) {
	var inv *nvdevice.Inventory
	err := b.locked(func() error {
		now := b.now()
		events := b.healthEvents.Load()
		if b.snapshotCurrent(now, events) {
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

// snapshotCurrent says whether the snapshot may still be handed out. The
// caller holds b.mu.
func (b *Backend) snapshotCurrent(now time.Time, events uint64) bool {
	ttl := b.snapTTL
	if ttl == 0 {
		ttl = InventorySnapshotTTL
	}
	return b.snap != nil && b.snapChanges == b.migChanges && b.snapEvents == events && now.Sub(b.snapAt) < ttl
}

// confirmSnapshot is told what a full read found (fresh, read under b.mu
// with the health events counted before it): the same GPUs as the
// snapshot's renew it, other ones drop it, so that the next prepare reads
// them again. The caller holds b.mu.
func (b *Backend) confirmSnapshot(fresh *nvdevice.Inventory, now time.Time, events uint64) {
	if b.snap == nil {
		return
	}
	if b.snapChanges == b.migChanges && b.snapEvents == events && reflect.DeepEqual(b.snap, fresh) {
		b.snapAt = now
		return
	}
	b.snap = nil
}
