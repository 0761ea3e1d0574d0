package plugin

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/plugin/checkpoint"
	"github.com/gpudra/gpudra/pkg/sharing"
)

// CapMinors resolves the /dev/nvidia-caps minors of a MIG device's GPU
// instance and compute instance.
type CapMinors func(gpuMinor, gi, ci int) (giMinor, ciMinor int, err error)

// StateOptions configure NodeState.
type StateOptions struct {
	Pool           string
	Backend        nvdevice.Interface
	CDI            *cdi.Writer
	Majors         cdi.Majors
	CapMinors      CapMinors
	CheckpointPath string
	BootID         string
	// Now is the clock (tests fix it).
	Now func() time.Time
	// CrashAt, when set, is called at every step of prepare and unprepare
	// that a kill could interrupt; tests panic there to kill the plugin.
	CrashAt func(step string)
	// Sharing sets up time-slicing, MPS and IPC directories. Nil: only
	// exclusive claims can be prepared.
	Sharing *sharing.Manager
}

// NodeState prepares and unprepares claims on one node. Every change is
// recorded in the checkpoint before and after its side effects.
type NodeState struct {
	opts StateOptions
	mu   sync.Mutex
	cp   *checkpoint.Checkpoint
	// index caches the device index of the inventory it was built from
	// (keyed by fingerprint): rebuilding 208 device names on every prepare
	// was the largest cost of a prepare.
	index            map[string]PlannedDevice
	indexFingerprint string
}

// NewNodeState loads the checkpoint (a corrupt one is moved aside and
// reported through the returned LoadResult) and rolls back every claim whose
// prepare was interrupted.
func NewNodeState(ctx context.Context, opts StateOptions) (*NodeState, checkpoint.LoadResult, error) {
	if opts.Now == nil {
		opts.Now = time.Now
	}
	res, err := checkpoint.Load(opts.CheckpointPath, opts.BootID, opts.Now())
	if err != nil {
		return nil, res, err
	}
	s := &NodeState{opts: opts, cp: res.Checkpoint}
	s.mu.Lock()
	defer s.mu.Unlock()
	for uid, c := range s.cp.Claims {
		if c.State == checkpoint.PrepareStarted {
			klog.FromContext(ctx).Info("Rolling back a prepare interrupted by a restart", "claim", klog.KRef(c.Namespace, c.Name), "uid", uid)
			if err := s.rollbackLocked(ctx, uid); err != nil {
				return nil, res, err
			}
		}
	}
	// A kill between writing a CDI spec and recording the claim leaves a
	// spec nobody knows: remove it.
	uids, err := opts.CDI.ClaimUIDs()
	if err != nil {
		return nil, res, err
	}
	for _, uid := range uids {
		if _, known := s.cp.Claims[uid]; !known {
			klog.FromContext(ctx).Info("Removing a CDI spec left by an interrupted prepare", "uid", uid)
			if err := opts.CDI.Remove(uid); err != nil {
				return nil, res, err
			}
		}
	}
	// MPS daemons of prepared claims are adopted (or started again if
	// they died); those of claims nobody knows are stopped.
	if opts.Sharing != nil {
		var prepared []sharing.Claim
		for uid, c := range s.cp.Claims {
			prepared = append(prepared, sharingClaim(uid, c))
		}
		if err := opts.Sharing.Resume(ctx, prepared); err != nil {
			klog.FromContext(ctx).Error(err, "Resuming the sharing of prepared claims failed; their prepare will be retried")
		}
	}
	return s, res, nil
}

// Prepared returns the claim's prepared devices, if it is prepared.
func (s *NodeState) Prepared(uid string) ([]checkpoint.PreparedDevice, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c, ok := s.cp.Claims[uid]
	if !ok || c.State != checkpoint.PrepareCompleted {
		return nil, false
	}
	return c.Devices, true
}

// Record returns a prepared claim's checkpoint record.
func (s *NodeState) Record(uid string) (checkpoint.PreparedClaim, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c, ok := s.cp.Claims[uid]
	return c, ok && c.State == checkpoint.PrepareCompleted
}

// ManagedMigDevices are the MIG devices the driver created, for the slice
// builder.
func (s *NodeState) ManagedMigDevices() map[string]bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.managedLocked()
}

// Prepare prepares a claim: idempotent, refusing devices prepared for
// another claim, and crash-safe through the two-phase checkpoint.
func (s *NodeState) Prepare(ctx context.Context, claim *resourceapi.ResourceClaim) ([]checkpoint.PreparedDevice, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	uid := string(claim.UID)
	if c, ok := s.cp.Claims[uid]; ok {
		if c.State == checkpoint.PrepareCompleted {
			return c.Devices, nil
		}
		if err := s.rollbackLocked(ctx, uid); err != nil {
			return nil, err
		}
	}
	inv, err := s.opts.Backend.Inventory(ctx)
	if err != nil {
		return nil, fmt.Errorf("read GPUs: %w", err)
	}
	index := s.indexLocked(inv)
	plan, err := planWithIndex(claim, s.opts.Pool, index, s.managedLocked())
	if err != nil {
		return nil, err
	}
	if err := s.checkConflictsLocked(uid, plan, index); err != nil {
		return nil, err
	}
	shareCfg, err := claimSharing(claim.Namespace+"/"+claim.Name, plan)
	if err != nil {
		return nil, err
	}
	setup := needsSharingSetup(shareCfg)
	if setup && s.opts.Sharing == nil {
		return nil, fmt.Errorf("claim %s/%s: this node cannot share GPUs (sharing is not configured)", claim.Namespace, claim.Name)
	}

	// Phase one: record the intent before a side effect that only the
	// record can undo (a MIG instance, an MPS daemon, a time slice). A CDI
	// spec alone needs no record: unknown specs are removed at start.
	record := checkpoint.PreparedClaim{Namespace: claim.Namespace, Name: claim.Name, State: checkpoint.PrepareStarted}
	if setup {
		record.Sharing = shareCfg
	}
	if createsMig(plan) || setup {
		if err := s.recordLocked(uid, &record, "after-intent"); err != nil {
			delete(s.cp.Claims, uid)
			return nil, err
		}
	}
	devices, err := s.executeLocked(ctx, uid, &record, plan)
	if err != nil {
		if rbErr := s.rollbackLocked(ctx, uid); rbErr != nil {
			err = errors.Join(err, fmt.Errorf("roll back: %w", rbErr))
		}
		return nil, err
	}
	// Phase two: done.
	record.State, record.Devices = checkpoint.PrepareCompleted, devices
	if err := s.recordLocked(uid, &record, "after-complete"); err != nil {
		return nil, err
	}
	return devices, nil
}

func (s *NodeState) executeLocked(ctx context.Context, uid string, record *checkpoint.PreparedClaim, plan []PlannedDevice) ([]checkpoint.PreparedDevice, error) {
	spec := cdi.Claim{UID: uid}
	var devices []checkpoint.PreparedDevice
	for _, p := range plan {
		pd := checkpoint.PreparedDevice{Requests: p.Requests, Pool: s.opts.Pool, Device: p.Device, UUID: p.GPU.UUID,
			CDIDeviceIDs: []string{cdi.QualifiedName(uid, p.Device)}}
		describeDevice(&pd, p)
		nodes := []cdi.DeviceNode{cdi.GPUNode(s.opts.Majors, p.GPU.Minor)}
		if p.Mig != nil {
			mig := p.Mig.Existing
			if mig == nil {
				// Record the placement before creating it, and the
				// instance's ids right after: a kill in between is
				// rolled back by placement, so nothing leaks.
				pd.CreatedMig = &checkpoint.CreatedMig{ParentUUID: p.GPU.UUID, Profile: p.Mig.Profile, Start: p.Mig.Placement.Start,
					GPUInstanceID: unknownInstance, ComputeInstanceID: unknownInstance}
				record.Devices = append(record.Devices, pd)
				if err := s.recordLocked(uid, record, "before-mig-create"); err != nil {
					return nil, err
				}
				created, err := s.opts.Backend.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: p.GPU.UUID, Profile: p.Mig.Profile, Start: p.Mig.Placement.Start})
				if err != nil {
					return nil, fmt.Errorf("device %s: %w", p.Device, err)
				}
				s.crash("after-mig-create")
				mig = created
				pd.CreatedMig.GPUInstanceID, pd.CreatedMig.ComputeInstanceID, pd.CreatedMig.UUID = created.GPUInstanceID, created.ComputeInstanceID, created.UUID
				record.Devices[len(record.Devices)-1] = pd
				if err := s.recordLocked(uid, record, "after-mig-record"); err != nil {
					return nil, err
				}
			}
			pd.UUID = mig.UUID
			giMinor, ciMinor, err := s.opts.CapMinors(p.GPU.Minor, mig.GPUInstanceID, mig.ComputeInstanceID)
			if err != nil {
				return nil, fmt.Errorf("device %s: %w", p.Device, err)
			}
			nodes = append(nodes, cdi.CapNode(s.opts.Majors, giMinor), cdi.CapNode(s.opts.Majors, ciMinor))
		}
		spec.Devices = append(spec.Devices, cdi.Device{Name: p.Device, UUID: pd.UUID, Nodes: nodes})
		devices = append(devices, pd)
	}
	if record.Sharing != nil {
		// The record names every device before sharing touches them, so
		// that a kill from here on is undone by the rollback.
		record.Devices = devices
		if err := s.recordLocked(uid, record, "before-sharing"); err != nil {
			return nil, err
		}
		edits, err := s.opts.Sharing.Prepare(ctx, sharingClaim(uid, *record))
		if err != nil {
			return nil, err
		}
		s.crash("after-sharing")
		spec.Env = edits.Env
		for _, m := range edits.Mounts {
			spec.Mounts = append(spec.Mounts, cdi.Mount{HostPath: m.HostPath, ContainerPath: m.ContainerPath})
		}
	}
	cdiSpec, err := cdi.BuildSpec(spec, s.opts.Majors)
	if err != nil {
		return nil, err
	}
	if err := s.opts.CDI.Write(uid, cdiSpec); err != nil {
		return nil, err
	}
	s.crash("after-cdi-write")
	return devices, nil
}

// Unprepare undoes a claim's prepare. An unknown claim is already
// unprepared. It reports whether MIG devices were destroyed (the published
// devices change then).
func (s *NodeState) Unprepare(ctx context.Context, uid string) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c, ok := s.cp.Claims[uid]
	if !ok {
		return false, nil
	}
	createdMig := false
	for _, d := range c.Devices {
		createdMig = createdMig || d.CreatedMig != nil
	}
	return createdMig, s.rollbackLocked(ctx, uid)
}

// rollbackLocked destroys the MIG devices the claim's record names, removes
// its CDI spec and forgets it. Every step may be repeated after a kill.
func (s *NodeState) rollbackLocked(ctx context.Context, uid string) error {
	c := s.cp.Claims[uid]
	// Sharing first: an MPS daemon holds the (MIG) devices it serves.
	if c.Sharing != nil && s.opts.Sharing != nil {
		var others []sharing.Claim
		for otherUID, o := range s.cp.Claims {
			if otherUID != uid {
				others = append(others, sharingClaim(otherUID, o))
			}
		}
		if err := s.opts.Sharing.Unprepare(ctx, sharingClaim(uid, c), others); err != nil {
			return err
		}
		s.crash("after-sharing-undo")
	}
	for _, d := range c.Devices {
		if m := d.CreatedMig; m != nil {
			ref, found, err := s.migRefLocked(ctx, m)
			if err != nil {
				return fmt.Errorf("claim %s/%s: %w", c.Namespace, c.Name, err)
			}
			if !found {
				continue
			}
			if err := s.opts.Backend.DeleteMigDevice(ctx, ref); err != nil && !errors.Is(err, nvdevice.ErrNotFound) {
				return fmt.Errorf("claim %s/%s: %w", c.Namespace, c.Name, err)
			}
			s.crash("after-mig-delete")
		}
	}
	if err := s.opts.CDI.Remove(uid); err != nil {
		return err
	}
	s.crash("after-cdi-remove")
	delete(s.cp.Claims, uid)
	return s.storeLocked()
}

func (s *NodeState) checkConflictsLocked(uid string, plan []PlannedDevice, index map[string]PlannedDevice) error {
	for otherUID, other := range s.cp.Claims {
		if otherUID == uid {
			continue
		}
		for _, od := range other.Devices {
			prepared, ok := index[od.Device]
			if !ok {
				continue
			}
			if od.Share != nil {
				prepared.Share = &PlannedShare{ID: od.Share.ID}
			}
			for _, p := range plan {
				if conflicts(p, prepared) {
					return fmt.Errorf("device %s is unavailable: %s is prepared for claim %s/%s (%s)",
						p.Device, od.Device, other.Namespace, other.Name, otherUID)
				}
			}
		}
	}
	return nil
}

func (s *NodeState) indexLocked(inv *nvdevice.Inventory) map[string]PlannedDevice {
	if fp := fingerprint(inv); fp != s.indexFingerprint || s.index == nil {
		s.index, s.indexFingerprint = deviceIndex(inv), fp
	}
	return s.index
}

func (s *NodeState) managedLocked() map[string]bool {
	out := map[string]bool{}
	for _, c := range s.cp.Claims {
		for _, d := range c.Devices {
			if d.CreatedMig != nil {
				out[d.CreatedMig.UUID] = true
			}
		}
	}
	return out
}

// migRefLocked names the MIG device a record points at. A record written
// just before a creation has no instance ids: the device is found by its
// placement, if the creation happened at all.
func (s *NodeState) migRefLocked(ctx context.Context, m *checkpoint.CreatedMig) (nvdevice.MigDeviceRef, bool, error) {
	if m.GPUInstanceID != unknownInstance {
		return nvdevice.MigDeviceRef{ParentUUID: m.ParentUUID, GPUInstanceID: m.GPUInstanceID, ComputeInstanceID: m.ComputeInstanceID, UUID: m.UUID}, true, nil
	}
	inv, err := s.opts.Backend.Inventory(ctx)
	if err != nil {
		return nvdevice.MigDeviceRef{}, false, fmt.Errorf("read GPUs: %w", err)
	}
	g, err := inv.GPUByUUID(m.ParentUUID)
	if err != nil {
		return nvdevice.MigDeviceRef{}, false, nil // the GPU is gone, and its instances with it
	}
	for _, d := range g.MIG.Devices {
		if d.Profile == m.Profile && d.Placement.Start == m.Start {
			return nvdevice.MigDeviceRef{ParentUUID: m.ParentUUID, GPUInstanceID: d.GPUInstanceID, ComputeInstanceID: d.ComputeInstanceID, UUID: d.UUID}, true, nil
		}
	}
	return nvdevice.MigDeviceRef{}, false, nil
}

func createsMig(plan []PlannedDevice) bool {
	for _, p := range plan {
		if p.Mig != nil && p.Mig.Existing == nil {
			return true
		}
	}
	return false
}

// unknownInstance marks instance ids not known yet.
const unknownInstance = -1

// recordLocked stores the claim's record, then passes a crash point.
func (s *NodeState) recordLocked(uid string, record *checkpoint.PreparedClaim, step string) error {
	s.cp.Claims[uid] = *record
	if err := s.storeLocked(); err != nil {
		return err
	}
	s.crash(step)
	return nil
}

// crash is a test hook: it lets a test kill the plugin at a named step.
func (s *NodeState) crash(step string) {
	if s.opts.CrashAt != nil {
		s.opts.CrashAt(step)
	}
}

func (s *NodeState) storeLocked() error {
	return checkpoint.Store(s.opts.CheckpointPath, s.cp)
}
