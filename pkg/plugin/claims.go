package plugin

import (
	"sort"

	"github.com/gpudra/gpudra/pkg/plugin/checkpoint"
	"github.com/gpudra/gpudra/pkg/prepared"
)

// snapshotClaims keeps, for PreparedClaims, the claims of cp whose prepare
// completed: their identity and their devices' names and GPUs only (no
// sharing, CDI or MIG records, so that a copy holds no shared pointer).
// Called under the node lock after every call that read or changed the
// state; SuperviseSharing's pass every few seconds keeps it fresh when
// another plugin instance of the node changed the checkpoint.
func (s *NodeState) snapshotClaims(cp *checkpoint.Checkpoint) {
	var out []prepared.Claim
	for uid, c := range cp.Claims {
		if c.State != prepared.PrepareCompleted {
			continue
		}
		devs := make([]prepared.Device, len(c.Devices))
		for i, d := range c.Devices {
			devs[i] = prepared.Device{Pool: d.Pool, Device: d.Device, UUID: d.UUID, GPUUUID: d.GPUUUID, Mig: d.Mig, AdminAccess: d.AdminAccess}
		}
		out = append(out, prepared.Claim{UID: uid, Namespace: c.Namespace, Name: c.Name, State: c.State, Devices: devs})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].UID < out[j].UID })
	s.claimsMu.Lock()
	s.claims = out
	s.claimsMu.Unlock()
}

// PreparedClaims returns a copy of the claims prepared on the node, as the
// last call under the node lock saw them: their UID, namespace, name and
// devices (name, pool, GPU and MIG UUIDs, admin access), sorted by UID. It
// never takes the node lock, so that a scrape never waits for a prepare;
// the copy is the caller's to change.
func (s *NodeState) PreparedClaims() []prepared.Claim {
	s.claimsMu.Lock()
	defer s.claimsMu.Unlock()
	out := make([]prepared.Claim, len(s.claims))
	for i, c := range s.claims {
		c.Devices = append([]prepared.Device(nil), c.Devices...)
		out[i] = c
	}
	return out
}

// PreparedClaims returns a copy of the claims prepared on the node
// (NodeState.PreparedClaims), for the telemetry's claim attribution.
func (p *Plugin) PreparedClaims() []prepared.Claim { return p.Driver.state.PreparedClaims() }
