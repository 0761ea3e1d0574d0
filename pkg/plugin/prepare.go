package plugin

// A claim's prepare, in steps: plan its devices from the node's inventory
// and the claim's allocation, check them against what is prepared, make
// its MIG devices and sharing, write its CDI spec and record it in the
// checkpoint (two phases, so that a kill between any two steps is undone
// at the next start). NodeState (state.go) holds the lock and the
// checkpoint it runs under.

import (
	"context"
	"errors"
	"fmt"
	"time"

	resourceapi "k8s.io/api/resource/v1"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/plugin/checkpoint"
	"github.com/gpudra/gpudra/pkg/prepared"
)

// Prepare prepares a claim: idempotent, refusing devices prepared for
// another claim, and crash-safe through the two-phase checkpoint. It
// returns the claim's record.
func (s *NodeState) Prepare(ctx context.Context, claim *resourceapi.ResourceClaim) (prepared.Claim, error) {
	var out prepared.Claim
	waited := s.stepTimer(PrepareStepLock)
	err := s.withLock(ctx, func(cp *checkpoint.Checkpoint) error {
		waited()
		var err error
		out, err = s.prepareLocked(ctx, cp, claim)
		return err
	})
	return out, err
}

// The steps of a prepare whose time the plugin reports
// (gpudra_plugin_prepare_step_duration_seconds, docs/metrics.md): where a
// prepare's time goes on any node, real GPU or simulated.
const (
	// PrepareStepLock is the wait for the node lock and the checkpoint's
	// load.
	PrepareStepLock = "lock"
	// PrepareStepInventory reads the GPUs (the backend's snapshot, or NVML).
	PrepareStepInventory = "inventory"
	// PrepareStepPlan maps the claim's allocation to devices and checks it.
	PrepareStepPlan = "plan"
	// PrepareStepMIG creates the claim's MIG devices (none: not observed).
	PrepareStepMIG = "mig"
	// PrepareStepSharing sets up time-slicing or MPS (none: not observed).
	PrepareStepSharing = "sharing"
	// PrepareStepCDI writes the claim's CDI spec.
	PrepareStepCDI = "cdi"
	// PrepareStepCheckpoint is the completed record's write and fsync
	// beyond the CDI spec's (they run side by side), and its commit.
	PrepareStepCheckpoint = "checkpoint"
)

// stepTimer starts timing a step of a prepare; the function it returns
// reports it.
func (s *NodeState) stepTimer(step string) func() {
	if s.opts.OnPrepareStep == nil {
		return func() {}
	}
	start := time.Now()
	return func() { s.opts.OnPrepareStep(step, time.Since(start)) }
}

func (s *NodeState) prepareLocked(ctx context.Context, cp *checkpoint.Checkpoint, claim *resourceapi.ResourceClaim) (prepared.Claim, error) {
	uid := string(claim.UID)
	if c, ok := cp.Claim(uid); ok {
		if c.State == prepared.PrepareCompleted {
			return c, nil
		}
		if err := s.rollbackLocked(ctx, cp, uid); err != nil {
			return prepared.Claim{}, err
		}
	}
	// Read only, for the index: where the backend keeps a snapshot, no
	// copy of every GPU for each prepare.
	readDone := s.stepTimer(PrepareStepInventory)
	inv, err := nvdevice.ReadOnlyInventory(ctx, s.opts.Backend)
	if err != nil {
		return prepared.Claim{}, fmt.Errorf("read GPUs: %w", err)
	}
	index := s.indexLocked(inv)
	readDone()
	planDone := s.stepTimer(PrepareStepPlan)
	plan, err := planWithIndex(claim, s.opts.Pool, index, managed(cp))
	var missing *notOnNodeError
	if _, snapshot := s.opts.Backend.(nvdevice.InventorySnapshotter); snapshot && errors.As(err, &missing) {
		// The snapshot may be older than the device (a MIG device made
		// by another tool a moment ago): the GPUs as they are now decide.
		if inv, err = s.opts.Backend.Inventory(ctx); err != nil {
			return prepared.Claim{}, fmt.Errorf("read GPUs: %w", err)
		}
		index = s.indexLocked(inv)
		plan, err = planWithIndex(claim, s.opts.Pool, index, managed(cp))
	}
	if err != nil {
		return prepared.Claim{}, err
	}
	if err := checkConflicts(cp, uid, plan, index); err != nil {
		return prepared.Claim{}, err
	}
	shareCfg, err := claimSharing(claim.Namespace+"/"+claim.Name, plan)
	if err != nil {
		return prepared.Claim{}, err
	}
	if err := claimFeatures(s.opts.FeatureGates, shareCfg, plan); err != nil {
		return prepared.Claim{}, fmt.Errorf("claim %s/%s: %w", claim.Namespace, claim.Name, err)
	}
	planDone()
	setup := needsSharingSetup(shareCfg)
	if setup && s.opts.Sharing == nil {
		return prepared.Claim{}, fmt.Errorf("claim %s/%s: this node cannot share GPUs (sharing is not configured)", claim.Namespace, claim.Name)
	}

	// Phase one: record the intent before a side effect that only the
	// record can undo (a MIG instance, an MPS client, a time slice). A CDI
	// spec alone needs no record: unknown specs are removed at start.
	record := prepared.Claim{UID: uid, Namespace: claim.Namespace, Name: claim.Name, State: prepared.PrepareStarted}
	if setup {
		record.Sharing = shareCfg
	}
	// Not stored yet: every side effect below is preceded by a store of
	// the record that names it (the MIG placement before the creation, the
	// devices before sharing), so a store here would only add an fsync.
	s.noteLocked(cp, &record, "after-intent")
	if err := s.executeLocked(ctx, cp, &record, plan); err != nil {
		if rbErr := s.rollbackLocked(ctx, cp, uid); rbErr != nil {
			err = errors.Join(err, fmt.Errorf("roll back: %w", rbErr))
		}
		return prepared.Claim{}, err
	}
	return record, nil
}

func (s *NodeState) executeLocked(ctx context.Context, cp *checkpoint.Checkpoint, record *prepared.Claim, plan []PlannedDevice) error {
	uid := record.UID
	spec := cdi.Claim{UID: uid}
	var devices []prepared.Device
	for _, p := range plan {
		d := preparedDevice(uid, s.opts.Pool, p)
		d.Nodes = []prepared.DeviceNode{cdi.GPUNode(s.opts.Majors, p.GPU.Minor)}
		if p.Mig != nil {
			mig := p.Mig.Existing
			if mig == nil {
				migDone := s.stepTimer(PrepareStepMIG)
				created, err := s.createMigLocked(ctx, cp, record, &d, p)
				if err != nil {
					return err
				}
				migDone()
				mig = created
			}
			d.UUID = mig.UUID
			giMinor, ciMinor, err := s.opts.CapMinors(p.GPU.Minor, mig.GPUInstanceID, mig.ComputeInstanceID)
			if err != nil {
				return fmt.Errorf("device %s: %w", p.Device, err)
			}
			d.Nodes = append(d.Nodes, cdi.CapNode(s.opts.Majors, giMinor), cdi.CapNode(s.opts.Majors, ciMinor))
		}
		devices = append(devices, d)
	}
	record.Devices = devices
	spec.Devices = devices
	if record.Sharing != nil {
		// The record names every device before sharing touches them, so
		// that a kill from here on is undone by the rollback.
		if err := s.recordLocked(cp, record, "before-sharing"); err != nil {
			return err
		}
		sharingDone := s.stepTimer(PrepareStepSharing)
		edits, err := s.opts.Sharing.Prepare(ctx, *record)
		if err != nil {
			return err
		}
		sharingDone()
		s.crash("after-sharing")
		spec.Env = edits.Env
		for _, m := range edits.Mounts {
			spec.Mounts = append(spec.Mounts, cdi.Mount{HostPath: m.HostPath, ContainerPath: m.ContainerPath})
		}
	}
	cdiSpec, err := cdi.BuildSpec(spec, s.opts.Majors)
	if err != nil {
		return err
	}
	// Phase two: done. Device nodes are host facts, not state: the record
	// goes without.
	done := *record
	done.State = prepared.PrepareCompleted
	done.Devices = make([]prepared.Device, len(record.Devices))
	for i, d := range record.Devices {
		d.Nodes = nil
		done.Devices[i] = d
	}
	// The completed record is written and fsynced beside the checkpoint
	// while the CDI spec is written: neither needs the other, and the
	// record replaces the checkpoint only after the spec exists, so that a
	// kill in between leaves a spec no record names (removed at start),
	// never a record without its spec.
	cp.Put(done)
	staged := s.stageLocked(cp, stagingFor(record))
	cdiDone := s.stepTimer(PrepareStepCDI)
	writeErr := s.opts.CDI.Write(uid, cdiSpec)
	cdiDone()
	checkpointDone := s.stepTimer(PrepareStepCheckpoint)
	pending, stageErr := staged()
	if err := errors.Join(writeErr, stageErr); err != nil {
		pending.Abort()
		cp.Put(*record) // the record as it was, for the rollback
		return err
	}
	s.crash("after-cdi-write")
	if err := s.commitLocked(cp, pending); err != nil {
		cp.Put(*record)
		return err
	}
	checkpointDone()
	*record = done
	s.crash("after-complete")
	return nil
}

// createMigLocked creates a planned MIG device. The placement is recorded
// (checkpoint and marker) before the creation and the instance's ids right
// after: a kill in between is rolled back by placement, so nothing leaks.
func (s *NodeState) createMigLocked(ctx context.Context, cp *checkpoint.Checkpoint, record *prepared.Claim, d *prepared.Device, p PlannedDevice) (*nvdevice.MigDevice, error) {
	d.CreatedMig = &prepared.CreatedMig{ParentUUID: p.GPU.UUID, Profile: p.Mig.Profile, Start: p.Mig.Placement.Start,
		GPUInstanceID: prepared.UnknownInstance, ComputeInstanceID: prepared.UnknownInstance}
	record.Devices = append(record.Devices, *d)
	if err := s.recordLocked(cp, record, "before-mig-marker"); err != nil {
		return nil, err
	}
	if err := s.markers.put(record.UID, *d.CreatedMig); err != nil {
		return nil, err
	}
	s.crash("before-mig-create")
	created, err := s.opts.Backend.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: p.GPU.UUID, Profile: p.Mig.Profile, Start: p.Mig.Placement.Start})
	if err != nil {
		return nil, &migCreateError{device: p.Device, err: err} // the Driver records an Event for it
	}
	s.crash("after-mig-create")
	d.CreatedMig.GPUInstanceID, d.CreatedMig.ComputeInstanceID, d.CreatedMig.UUID = created.GPUInstanceID, created.ComputeInstanceID, created.UUID
	record.Devices[len(record.Devices)-1] = *d
	// The instance ids are stored with the next record (the next device's
	// placement, or the completed claim). A kill before that leaves the
	// placement on disk, and the rollback finds the instances by placement
	// and profile: the ids are a convenience, not what makes it safe.
	s.noteLocked(cp, record, "after-mig-record")
	if err := s.markers.put(record.UID, *d.CreatedMig); err != nil {
		return nil, err
	}
	return created, nil
}

func checkConflicts(cp *checkpoint.Checkpoint, uid string, plan []PlannedDevice, index map[string]PlannedDevice) error {
	for otherUID, other := range cp.Claims {
		if otherUID == uid {
			continue
		}
		for _, od := range other.Devices {
			held, ok := index[od.Device]
			if !ok {
				continue
			}
			if od.Share != nil {
				held.Share = &PlannedShare{ID: od.Share.ID}
			}
			held.AdminAccess = od.AdminAccess
			for _, p := range plan {
				if conflicts(p, held) {
					return fmt.Errorf("device %s is unavailable: %s is prepared for claim %s/%s (%s)",
						p.Device, od.Device, other.Namespace, other.Name, otherUID)
				}
			}
		}
	}
	return nil
}

// indexLocked is the device index of inv, which the caller and the index
// only read.
func (s *NodeState) indexLocked(inv *nvdevice.Inventory) map[string]PlannedDevice {
	if inv == s.indexInventory && s.index != nil {
		return s.index // the same snapshot: the node did not change
	}
	// Every MIG device counts here: the plans name the ones that exist.
	if fp := fingerprint(inv, nil); fp != s.indexFingerprint || s.index == nil {
		s.index, s.indexFingerprint = deviceIndex(inv), fp
	}
	s.indexInventory = inv
	return s.index
}

// managed are the UUIDs of the MIG devices the checkpoint says the driver
// created.
func managed(cp *checkpoint.Checkpoint) map[string]bool {
	out := map[string]bool{}
	for _, c := range cp.Claims {
		for _, d := range c.Devices {
			if d.CreatedMig != nil && d.CreatedMig.UUID != "" {
				out[d.CreatedMig.UUID] = true
			}
		}
	}
	return out
}

func createsMig(plan []PlannedDevice) bool {
	for _, p := range plan {
		if p.Mig != nil && p.Mig.Existing == nil {
			return true
		}
	}
	return false
}
