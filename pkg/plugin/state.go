package plugin

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/component-base/featuregate"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/nodelock"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/plugin/checkpoint"
	"github.com/gpudra/gpudra/pkg/prepared"
	"github.com/gpudra/gpudra/pkg/sharing"
)

// CapMinors resolves the /dev/nvidia-caps minors of a MIG device's GPU
// instance and compute instance.
type CapMinors func(gpuMinor, gi, ci int) (giMinor, ciMinor int, err error)

// ClaimLister lists the claims allocated to this node's pool, so that a lost
// or corrupt checkpoint can be rebuilt from the API.
type ClaimLister func(ctx context.Context) ([]*resourceapi.ResourceClaim, error)

// StateOptions configure NodeState.
type StateOptions struct {
	Pool      string
	Backend   nvdevice.Interface
	CDI       *cdi.Writer
	Majors    cdi.Majors
	CapMinors CapMinors
	// CheckpointPath is the checkpoint file; its directory also holds the
	// node lock and the MIG markers, and must be shared by every plugin
	// instance of the node.
	CheckpointPath string
	BootID         string
	// Claims lists this node's allocated claims for a rebuild; nil: a
	// rebuild uses what is on the node only.
	Claims ClaimLister
	// OnRebuild is told what a rebuild found (the plugin records a Node
	// Event).
	OnRebuild func(context.Context, RebuildReport)
	// Now is the clock (tests fix it).
	Now func() time.Time
	// CrashAt, when set, is called at every step of prepare and unprepare
	// that a kill could interrupt; tests panic there to kill the plugin.
	CrashAt func(step string)
	// Sharing sets up time-slicing, MPS and IPC directories. Nil: only
	// exclusive claims can be prepared.
	Sharing *sharing.Manager
	// FeatureGates refuse claims that need a feature that is off; nil:
	// every gate at its default.
	FeatureGates featuregate.FeatureGate
	// OnPrepareStep, if set, receives how long each step of a prepare
	// took (the PrepareStep* steps), for the plugin's metrics.
	OnPrepareStep func(step string, d time.Duration)
	// OnPreparedClaims, if set, receives the number of prepared claims
	// after every call that read or changed the state (for the metrics).
	OnPreparedClaims func(n int)
}

// NodeState prepares and unprepares claims on one node. The checkpoint is
// the state: every call reads it, changes it and stores it under a
// node-wide lock, so that two plugin instances of one node (a rolling
// update) see each other's claims. Every change is recorded before and
// after its side effects.
type NodeState struct {
	opts    StateOptions
	lock    *nodelock.Lock
	markers migMarkers

	// cp is the checkpoint as this instance last read or wrote it; it is
	// reused while the file is the same one (cpID). Another instance's
	// store replaces the file, and with it the identity.
	cp   *checkpoint.Checkpoint
	cpID fileID
	// index caches the device index of the inventory it was built from
	// (keyed by fingerprint): rebuilding 208 device names on every prepare
	// was the largest cost of a prepare. indexInventory is the inventory
	// it was last checked against: a backend's snapshot is the same
	// pointer until the node changes (nvdevice.ReadOnlyInventory), and
	// then not even the fingerprint is made again.
	index            map[string]PlannedDevice
	indexFingerprint string
	indexInventory   *nvdevice.Inventory

	// claims is what PreparedClaims returns: the prepared claims as the
	// last successful call under the node lock left them.
	claimsMu sync.Mutex
	claims   []prepared.Claim
}

// NewNodeState opens the node's state and sweeps what a kill left behind:
// interrupted prepares are rolled back, CDI specs nobody knows are removed,
// MPS servers of prepared claims are adopted. A lost or corrupt checkpoint
// is rebuilt from the node and the API. Failures of the sweep are logged
// and retried (RetryInterrupted), never fatal: the rest of the node keeps
// working.
func NewNodeState(ctx context.Context, opts StateOptions) (*NodeState, error) {
	if opts.Now == nil {
		opts.Now = time.Now
	}
	dir := filepath.Dir(opts.CheckpointPath)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, fmt.Errorf("plugin data directory: %w", err)
	}
	lock, err := nodelock.Open(filepath.Join(dir, "state.lock"))
	if err != nil {
		return nil, err
	}
	s := &NodeState{opts: opts, lock: lock, markers: migMarkers{dir: filepath.Join(dir, "mig-markers")}}
	if err := s.sweep(ctx); err != nil {
		klog.FromContext(ctx).Error(err, "Cleaning up after an earlier plugin instance failed in part; what failed is kept and retried")
	}
	return s, nil
}

// Close releases the lock file.
func (s *NodeState) Close() error { return s.lock.Close() }

// withLock runs fn on the current checkpoint under the node lock.
func (s *NodeState) withLock(ctx context.Context, fn func(cp *checkpoint.Checkpoint) error) error {
	if err := s.lock.Lock(ctx); err != nil {
		return err
	}
	defer s.lock.Unlock()
	cp, err := s.loadLocked(ctx)
	if err != nil {
		return err
	}
	if err := fn(cp); err != nil {
		s.cp = nil // fn may have changed it without storing: read again
		return err
	}
	if s.opts.OnPreparedClaims != nil {
		s.opts.OnPreparedClaims(countPrepared(cp))
	}
	s.snapshotClaims(cp)
	return nil
}

// Record returns a claim's record, if it is prepared.
func (s *NodeState) Record(ctx context.Context, uid string) (prepared.Claim, bool, error) {
	var out prepared.Claim
	var ok bool
	err := s.withLock(ctx, func(cp *checkpoint.Checkpoint) error {
		out, ok = cp.Claim(uid)
		ok = ok && out.State == prepared.PrepareCompleted
		return nil
	})
	return out, ok, err
}

// ManagedMigDevices are the MIG devices the driver created, for the slice
// builder.
func (s *NodeState) ManagedMigDevices(ctx context.Context) (map[string]bool, error) {
	out := map[string]bool{}
	err := s.withLock(ctx, func(cp *checkpoint.Checkpoint) error {
		out = managed(cp)
		return nil
	})
	return out, err
}

// Unprepare undoes a claim's prepare. A claim this node never prepared is
// already unprepared. It reports whether MIG devices were destroyed (the
// published devices change then).
func (s *NodeState) Unprepare(ctx context.Context, uid string) (bool, error) {
	destroyed := false
	err := s.withLock(ctx, func(cp *checkpoint.Checkpoint) error {
		c, ok := cp.Claim(uid)
		if !ok {
			return nil
		}
		destroyed = c.CreatesMig()
		return s.rollbackLocked(ctx, cp, uid)
	})
	return destroyed, err
}

// rollbackLocked undoes the claim's sharing, destroys the MIG devices its
// record names, removes its CDI spec and forgets it. Every step may be
// repeated after a kill or a failure; until all succeeded the record stays.
func (s *NodeState) rollbackLocked(ctx context.Context, cp *checkpoint.Checkpoint, uid string) error {
	c, _ := cp.Claim(uid)
	// Sharing first: an MPS server holds the (MIG) devices it serves.
	if needsSharingSetup(c.Sharing) && s.opts.Sharing != nil {
		if err := s.opts.Sharing.Unprepare(ctx, c, cp.Others(uid)); err != nil {
			return err
		}
		s.crash("after-sharing-undo")
	}
	for _, d := range c.Devices {
		m := d.CreatedMig
		if m == nil {
			continue
		}
		ref := nvdevice.MigPlacementRef{ParentUUID: m.ParentUUID, Profile: m.Profile, Start: m.Start, UUID: m.UUID}
		if err := s.opts.Backend.DeleteMigPlacement(ctx, ref); err != nil && !errors.Is(err, nvdevice.ErrNotFound) {
			return fmt.Errorf("claim %s (%s): device %s: %w", c.Ref(), uid, d.Device, err)
		}
		s.crash("after-mig-delete")
		if err := s.markers.remove(*m); err != nil {
			return err
		}
	}
	if err := s.opts.CDI.Remove(uid); err != nil {
		return err
	}
	s.crash("after-cdi-remove")
	delete(cp.Claims, uid)
	return s.storeWithLocked(cp, stagingFor(&c))
}

// recordLocked stores the claim's record, then passes a crash point.
func (s *NodeState) recordLocked(cp *checkpoint.Checkpoint, record *prepared.Claim, step string) error {
	cp.Put(*record)
	if err := s.storeLocked(cp); err != nil {
		return err
	}
	s.crash(step)
	return nil
}

// noteLocked puts the claim's record into the checkpoint in memory without
// storing it (the next store carries it), then passes a crash point.
func (s *NodeState) noteLocked(cp *checkpoint.Checkpoint, record *prepared.Claim, step string) {
	cp.Put(*record)
	s.crash(step)
}

// crash is a test hook: it lets a test kill the plugin at a named step.
func (s *NodeState) crash(step string) {
	if s.opts.CrashAt != nil {
		s.opts.CrashAt(step)
	}
}

func (s *NodeState) storeLocked(cp *checkpoint.Checkpoint) error {
	return s.storeWithLocked(cp, checkpoint.Stage)
}

// stageFunc writes a checkpoint beside the one in place: checkpoint.Stage
// (fsynced) or checkpoint.StageUnsynced.
type stageFunc func(path string, c *checkpoint.Checkpoint) (*checkpoint.Pending, error)

// stagingFor is how a store that records (or forgets) claim c is written:
// without an fsync when c's only side effect is its CDI spec (no MIG
// device created, no sharing set up). Such a record need not survive a
// power loss: that is a reboot, after which the checkpoint of this boot is
// discarded (checkpoint.Load), and the kubelet prepares the claim again;
// a kill keeps the page cache. A record that names a MIG device or an MPS
// daemon is fsynced, as are the stores of the sweep. A variable: tests see
// which a prepare chose.
var stagingFor = func(c *prepared.Claim) stageFunc {
	if c.CreatesMig() || needsSharingSetup(c.Sharing) {
		return checkpoint.Stage
	}
	return checkpoint.StageUnsynced
}

func (s *NodeState) storeWithLocked(cp *checkpoint.Checkpoint, stage stageFunc) error {
	s.cp = nil
	pending, err := stage(s.opts.CheckpointPath, cp)
	if err != nil {
		return err
	}
	return s.commitLocked(cp, pending)
}

// stageLocked writes cp beside the checkpoint with stage in a goroutine of
// its own; the function it returns waits for that. cp must not change
// until then.
func (s *NodeState) stageLocked(cp *checkpoint.Checkpoint, stage stageFunc) func() (*checkpoint.Pending, error) {
	type staged struct {
		p   *checkpoint.Pending
		err error
	}
	done := make(chan staged, 1)
	go func() {
		p, err := stage(s.opts.CheckpointPath, cp)
		done <- staged{p, err}
	}()
	return func() (*checkpoint.Pending, error) {
		r := <-done
		return r.p, r.err
	}
}

// commitLocked puts a staged checkpoint in place, as the current one.
func (s *NodeState) commitLocked(cp *checkpoint.Checkpoint, pending *checkpoint.Pending) error {
	s.cp = nil
	if err := pending.Commit(); err != nil {
		return err
	}
	if id, err := statID(s.opts.CheckpointPath); err == nil {
		s.cp, s.cpID = cp, id
	}
	return nil
}

// loadLocked returns the current checkpoint: the one this instance holds
// if the file did not change since, otherwise the file's. A lost or corrupt
// checkpoint is rebuilt from the node and the API.
func (s *NodeState) loadLocked(ctx context.Context) (*checkpoint.Checkpoint, error) {
	path := s.opts.CheckpointPath
	id, statErr := statID(path)
	if statErr == nil && s.cp != nil && id == s.cpID {
		return s.cp, nil
	}
	res, err := checkpoint.Load(path, s.opts.BootID, s.opts.Now())
	if err != nil {
		return nil, err
	}
	cp := res.Checkpoint
	switch {
	case res.StaleBoot:
		// A reboot destroyed every MIG instance and the CDI specs in
		// tmpfs: the markers describe nothing any more.
		klog.FromContext(ctx).Info("Checkpoint was written before a reboot; starting empty")
		if err := os.RemoveAll(s.markers.dir); err != nil {
			return nil, fmt.Errorf("remove MIG markers of an earlier boot: %w", err)
		}
		if err := s.storeLocked(cp); err != nil {
			return nil, err
		}
	case res.MovedAside != "" || os.IsNotExist(statErr):
		rebuilt, err := s.rebuildLocked(ctx, cp, res)
		if err != nil {
			return nil, err
		}
		if !rebuilt && res.MovedAside == "" {
			// A new node. The file is created now, so that a missing file
			// later means a lost one, not a first prepare a kill cut short.
			klog.FromContext(ctx).V(2).Info("No checkpoint yet; starting empty", "path", path)
		}
		if err := s.storeLocked(cp); err != nil {
			return nil, err
		}
	default:
		s.cp, s.cpID = cp, id
	}
	return cp, nil
}

// fileID tells one version of the checkpoint file from another: a store
// renames a new file over it, which changes the inode and the times.
type fileID struct {
	dev, ino, size, mtime, ctime int64
}

func statID(path string) (fileID, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return fileID{}, err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return fileID{}, errors.New("no stat data")
	}
	return fileID{dev: int64(st.Dev), ino: int64(st.Ino), size: st.Size, mtime: st.Mtim.Nano(), ctime: st.Ctim.Nano()}, nil
}
