// Package plugin is the DRA kubelet plugin's node logic: what to prepare for
// a claim (a pure plan), doing it (MIG creation, CDI spec, checkpoint), and
// undoing it. The gRPC front (kubeletplugin) is not wired yet.
package plugin

import (
	"fmt"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/resourceclaim"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// PlannedDevice is one device of a claim and what preparing it takes.
type PlannedDevice struct {
	Requests []string
	Device   string
	GPU      nvdevice.GPU
	// Mig is set for a MIG placement.
	Mig *PlannedMig
	// Config is the decoded GpuConfig that applies to the device.
	Config *gpuapi.GpuConfig
	// Share is set when the device was allocated as one share of a GPU
	// that several claims may use (consumable capacity).
	Share *PlannedShare
	// AdminAccess is set for a result with admin access: not a use of the
	// device (it conflicts with nothing, creates no MIG instance) but its
	// monitoring view: the whole GPU's device nodes, no limits, no sharing.
	AdminAccess bool
	// CDIName is the device's CDI device name in the claim's spec when it
	// is not the device name: two shares of one GPU in one claim.
	CDIName string
}

// PlannedShare is what the scheduler let a claim consume of a shared GPU.
type PlannedShare struct {
	ID              string
	MemoryBytes     int64
	Multiprocessors int64
}

// PlannedMig is a MIG placement to use or create.
type PlannedMig struct {
	Profile   string
	Placement nvdevice.Placement
	// MemoryMiB and Multiprocessors are the profile's.
	MemoryMiB       uint64
	Multiprocessors int
	computeSlices   int
	// Existing is set when a MIG device already sits at the placement and
	// the driver did not create it: it is used as it is.
	Existing *nvdevice.MigDevice
}

// Plan computes, without side effects, what preparing a claim's devices of
// this driver and pool takes. Errors name the device or the config.
func Plan(claim *resourceapi.ResourceClaim, pool string, inv *nvdevice.Inventory, managed map[string]bool) ([]PlannedDevice, error) {
	return planWithIndex(claim, pool, deviceIndex(inv), managed)
}

// planWithIndex is Plan over a device index the caller already built.
// notOnNodeError is a claim's device the node's inventory does not have.
type notOnNodeError struct{ device, claim string }

func (e *notOnNodeError) Error() string {
	return fmt.Sprintf("device %s of claim %s does not exist on this node (a GPU may have vanished)", e.device, e.claim)
}

func planWithIndex(claim *resourceapi.ResourceClaim, pool string, index map[string]PlannedDevice, managed map[string]bool) ([]PlannedDevice, error) {
	if claim.Status.Allocation == nil {
		return nil, fmt.Errorf("claim %s/%s is not allocated", claim.Namespace, claim.Name)
	}
	var out []PlannedDevice
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver != slicebuilder.DriverName || r.Pool != pool {
			continue
		}
		pd, ok := index[r.Device]
		if !ok {
			return nil, &notOnNodeError{device: r.Device, claim: claim.Namespace + "/" + claim.Name}
		}
		cfg, err := configFor(claim, r)
		if err != nil {
			return nil, err
		}
		pd.Requests, pd.Config = []string{r.Request}, cfg
		if r.AdminAccess != nil && *r.AdminAccess {
			pd.AdminAccess = true
			if pd.Mig != nil && pd.Mig.Existing == nil {
				if pd.Device != slicebuilder.GPUDeviceName(&pd.GPU) {
					return nil, fmt.Errorf("device %s of claim %s/%s: admin access to a MIG placement without a MIG device: admin access never creates one (it is not a use of the device); ask for the parent GPU %s for its monitoring view",
						r.Device, claim.Namespace, claim.Name, slicebuilder.GPUDeviceName(&pd.GPU))
				}
				// The whole GPU in MIG mode: its device node, no instance.
				pd.Mig = nil
			}
			out = append(out, pd)
			continue
		}
		if r.ShareID != nil {
			pd.Share = &PlannedShare{ID: string(*r.ShareID), MemoryBytes: int64(pd.GPU.MemoryMiB) << 20}
			if q, ok := r.ConsumedCapacity[slicebuilder.CapacityMemory]; ok {
				pd.Share.MemoryBytes = q.Value()
			}
			if q, ok := r.ConsumedCapacity[slicebuilder.CapacityMultiprocessors]; ok {
				pd.Share.Multiprocessors = q.Value()
			}
		}
		if pd.Mig != nil && pd.Mig.Existing != nil && managed[pd.Mig.Existing.UUID] {
			// Created by us for a claim that was unprepared in between
			// without cleanup: it is free to take over as if new.
			mig := *pd.Mig // the index is shared: never change it in place
			mig.Existing = nil
			pd.Mig = &mig
		}
		out = append(out, pd)
	}
	distinctCDINames(out)
	return out, nil
}

// distinctCDINames names the CDI devices of several shares of one GPU in
// one claim after their share ids, so that each is a device of its own in
// the claim's spec. A device that appears once keeps its device name (the
// name earlier releases gave it).
func distinctCDINames(plan []PlannedDevice) {
	count := map[string]int{}
	for _, p := range plan {
		count[p.Device]++
	}
	for i, p := range plan {
		if count[p.Device] > 1 && p.Share != nil {
			plan[i].CDIName = p.Device + "-share-" + cdiSafe(p.Share.ID)
		}
	}
}

// cdiSafe keeps the characters a CDI device name may hold.
func cdiSafe(s string) string {
	b := []byte(s)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			b[i] = '-'
		}
	}
	return string(b)
}

// configFor decodes the claim's opaque configs for this driver that apply to
// the result; the last one wins, as the DRA API orders class configs before
// claim configs.
func configFor(claim *resourceapi.ResourceClaim, r resourceapi.DeviceRequestAllocationResult) (*gpuapi.GpuConfig, error) {
	cfg := gpuapi.DefaultConfig()
	for i, c := range resourceclaim.ConfigForResult(claim.Status.Allocation.Devices.Config, r) {
		if c.Opaque == nil || c.Opaque.Driver != slicebuilder.DriverName {
			continue
		}
		decoded, err := gpuapi.Decode(c.Opaque.Parameters.Raw)
		if err != nil {
			return nil, fmt.Errorf("claim %s/%s: config %d for request %q: %w", claim.Namespace, claim.Name, i, r.Request, err)
		}
		cfg = decoded
	}
	return cfg, nil
}

// deviceIndex maps every device name a node publishes to its plan.
func deviceIndex(inv *nvdevice.Inventory) map[string]PlannedDevice {
	out := map[string]PlannedDevice{}
	for _, g := range inv.GPUs {
		full := PlannedDevice{Device: slicebuilder.GPUDeviceName(&g), GPU: g}
		if g.MIG.Enabled {
			// In MIG mode CUDA sees no GPU without an instance: the whole
			// GPU is served as the instance that spans it (7g.80gb).
			full.Mig = wholeGPUInstance(&g)
		}
		out[full.Device] = full
		for _, p := range g.MIG.Profiles {
			for _, pl := range p.Placements {
				name := slicebuilder.MigDeviceName(&g, p.Name, pl.Start)
				mig := &PlannedMig{Profile: p.Name, Placement: pl, MemoryMiB: p.MemoryMiB, Multiprocessors: p.Engines.Multiprocessors}
				for i, d := range g.MIG.Devices {
					if d.Profile == p.Name && d.Placement == pl {
						mig.Existing = &g.MIG.Devices[i]
					}
				}
				out[name] = PlannedDevice{Device: name, GPU: g, Mig: mig}
			}
		}
	}
	return out
}

// wholeGPUInstance is the MIG placement that spans a GPU (placement 0 over
// all memory slices, the largest profile), with an existing device there.
func wholeGPUInstance(g *nvdevice.GPU) *PlannedMig {
	var best *PlannedMig
	for _, p := range g.MIG.Profiles {
		for _, pl := range p.Placements {
			if pl.Start != 0 || pl.Size != nvdevice.MemorySlices {
				continue
			}
			if best == nil || p.ComputeSlices > best.computeSlices {
				best = &PlannedMig{Profile: p.Name, Placement: pl, MemoryMiB: p.MemoryMiB, Multiprocessors: p.Engines.Multiprocessors, computeSlices: p.ComputeSlices}
			}
		}
	}
	if best == nil {
		return nil
	}
	for i, d := range g.MIG.Devices {
		if d.Profile == best.Profile && d.Placement == best.Placement {
			best.Existing = &g.MIG.Devices[i]
		}
	}
	return best
}

// conflicts says whether two devices cannot be prepared for two claims at
// once: the same device, a full GPU and anything on it, or overlapping MIG
// placements on one GPU.
func conflicts(a, b PlannedDevice) bool {
	if a.GPU.UUID != b.GPU.UUID {
		return false
	}
	// Admin access is not a use of the device.
	if a.AdminAccess || b.AdminAccess {
		return false
	}
	// Shares of one GPU: the scheduler accounted for their capacity.
	if a.Share != nil && b.Share != nil && a.Device == b.Device {
		return false
	}
	if a.Mig == nil || b.Mig == nil {
		return true
	}
	return a.Mig.Placement.Overlaps(b.Mig.Placement)
}
