package plugin

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/plugin/checkpoint"
	"github.com/gpudra/gpudra/pkg/prepared"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// RebuildReport says what a rebuild of a lost or corrupt checkpoint found.
type RebuildReport struct {
	// Cause is why the checkpoint was rebuilt; MovedAside is where a
	// corrupt one was moved.
	Cause      error
	MovedAside string
	// Adopted are the claims (namespace/name) prepared again from their
	// CDI specs and the API, with the MIG devices the markers name.
	Adopted []string
	// Unknown are claim UIDs with a CDI spec whose claim the API no longer
	// has: recorded with what the node shows, so that their unprepare
	// removes the spec and the driver's MIG devices.
	Unknown []string
	// Interrupted counts claims whose MIG devices were being created when
	// the state was lost: they are rolled back.
	Interrupted int
}

// Message is the Node Event's text.
func (r RebuildReport) Message() string {
	var b strings.Builder
	if r.MovedAside != "" {
		fmt.Fprintf(&b, "gpudra kubelet plugin: checkpoint was corrupt (%v) and was moved to %s; ", r.Cause, r.MovedAside)
	} else {
		b.WriteString("gpudra kubelet plugin: checkpoint was missing while CDI specs or MIG markers were on the node; ")
	}
	fmt.Fprintf(&b, "rebuilt from the node and the API: %d prepared claim(s) adopted", len(r.Adopted))
	if len(r.Adopted) > 0 {
		fmt.Fprintf(&b, " (%s)", strings.Join(r.Adopted, ", "))
	}
	if len(r.Unknown) > 0 {
		fmt.Fprintf(&b, ", %d CDI spec(s) of claims the API no longer has kept until their unprepare", len(r.Unknown))
	}
	if r.Interrupted > 0 {
		fmt.Fprintf(&b, ", %d interrupted MIG creation(s) rolled back", r.Interrupted)
	}
	b.WriteString("; nothing running pods use was destroyed")
	return b.String()
}

// rebuildLocked fills cp from what is on the node when the checkpoint was
// lost or corrupt: every claim with a CDI spec was prepared and returned to
// the kubelet (the spec is written last), so it is adopted as prepared, its
// devices planned again from the API's claim and its MIG devices matched
// with the driver's markers. Markers of claims without a spec are
// interrupted creations, recorded as such and rolled back by the sweep.
// Nothing is destroyed here. It reports whether there was anything to
// rebuild. An API error fails the rebuild (nothing is stored, the next call
// tries again): a partial state would hand the kubelet empty devices.
func (s *NodeState) rebuildLocked(ctx context.Context, cp *checkpoint.Checkpoint, res checkpoint.LoadResult) (bool, error) {
	logger := klog.FromContext(ctx)
	specs, err := s.opts.CDI.ClaimUIDs()
	if err != nil {
		return false, err
	}
	markers, err := s.markers.list()
	if err != nil {
		logger.Error(err, "Some MIG markers are unreadable; their MIG devices stay foreign")
	}
	if res.MovedAside == "" && len(specs) == 0 && len(markers) == 0 {
		return false, nil
	}
	report := RebuildReport{Cause: res.Cause, MovedAside: res.MovedAside}
	claims := map[string]*resourceapi.ResourceClaim{}
	if s.opts.Claims != nil && len(specs) > 0 {
		list, err := s.opts.Claims(ctx)
		if err != nil {
			return false, fmt.Errorf("rebuild the lost checkpoint: list this node's claims: %w", err)
		}
		for _, c := range list {
			claims[string(c.UID)] = c
		}
	}
	byClaim := map[string][]prepared.CreatedMig{}
	for _, m := range markers {
		byClaim[m.ClaimUID] = append(byClaim[m.ClaimUID], m.Mig)
	}
	var index map[string]PlannedDevice
	if len(claims) > 0 {
		inv, err := nvdevice.ReadOnlyInventory(ctx, s.opts.Backend)
		if err != nil {
			return false, fmt.Errorf("rebuild the lost checkpoint: read GPUs: %w", err)
		}
		index = s.indexLocked(inv)
	}
	for _, uid := range specs {
		record := prepared.Claim{UID: uid, State: prepared.PrepareCompleted}
		if claim, ok := claims[uid]; ok {
			if err := s.adoptLocked(claim, index, byClaim[uid], &record); err != nil {
				logger.Error(err, "A prepared claim could not be planned again; kept with what the node shows", "claim", klog.KObj(claim))
			} else {
				report.Adopted = append(report.Adopted, claim.Namespace+"/"+claim.Name)
			}
		} else {
			report.Unknown = append(report.Unknown, uid)
		}
		if len(record.Devices) == 0 {
			for _, m := range byClaim[uid] {
				record.Devices = append(record.Devices, prepared.Device{Pool: s.opts.Pool, GPUUUID: m.ParentUUID, Mig: true, UUID: m.UUID, CreatedMig: &m})
			}
		}
		cp.Put(record)
	}
	for uid, migs := range byClaim {
		if _, done := cp.Claims[uid]; done {
			continue
		}
		record := prepared.Claim{UID: uid, State: prepared.PrepareStarted}
		for _, m := range migs {
			record.Devices = append(record.Devices, prepared.Device{Pool: s.opts.Pool, GPUUUID: m.ParentUUID, Mig: true, CreatedMig: &m})
		}
		cp.Put(record)
		report.Interrupted++
	}
	slices.Sort(report.Adopted)
	logger.Info("Rebuilt the node state", "adopted", report.Adopted, "unknownClaims", report.Unknown, "interrupted", report.Interrupted)
	if s.opts.OnRebuild != nil {
		s.opts.OnRebuild(ctx, report)
	}
	return true, nil
}

// adoptLocked plans a prepared claim again without side effects: the MIG
// devices are the ones at the planned placements, and those a marker says
// the driver created for this claim are recorded as created (destroyed at
// unprepare).
func (s *NodeState) adoptLocked(claim *resourceapi.ResourceClaim, index map[string]PlannedDevice, migs []prepared.CreatedMig, record *prepared.Claim) error {
	record.Namespace, record.Name = claim.Namespace, claim.Name
	plan, err := planWithIndex(claim, s.opts.Pool, index, nil)
	if err != nil {
		return err
	}
	shareCfg, err := claimSharing(claim.Namespace+"/"+claim.Name, plan)
	if err != nil {
		return err
	}
	if needsSharingSetup(shareCfg) {
		record.Sharing = shareCfg
	}
	var errs []error
	for _, p := range plan {
		d := preparedDevice(record.UID, s.opts.Pool, p)
		if p.Mig != nil {
			if p.Mig.Existing == nil {
				errs = append(errs, fmt.Errorf("device %s: no MIG device at its placement any more", p.Device))
			} else {
				d.UUID = p.Mig.Existing.UUID
			}
			for i, m := range migs {
				if m.ParentUUID == p.GPU.UUID && m.Start == p.Mig.Placement.Start && m.Profile == p.Mig.Profile {
					d.CreatedMig = &migs[i]
				}
			}
		}
		record.Devices = append(record.Devices, d)
	}
	return errors.Join(errs...)
}

// ClaimsOfPool lists the claims allocated to a pool of this driver, for a
// rebuild.
func ClaimsOfPool(list func(ctx context.Context) ([]resourceapi.ResourceClaim, error), pool string) ClaimLister {
	return func(ctx context.Context) ([]*resourceapi.ResourceClaim, error) {
		all, err := list(ctx)
		if err != nil {
			return nil, err
		}
		var out []*resourceapi.ResourceClaim
		for i := range all {
			c := &all[i]
			if c.Status.Allocation == nil {
				continue
			}
			for _, r := range c.Status.Allocation.Devices.Results {
				if r.Driver == slicebuilder.DriverName && r.Pool == pool {
					out = append(out, c)
					break
				}
			}
		}
		return out, nil
	}
}
