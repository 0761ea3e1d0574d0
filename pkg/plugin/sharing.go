package plugin

import (
	"fmt"
	"reflect"
	"strings"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/prepared"
)

// claimSharing is the one sharing configuration of a claim's devices on
// this node, validated against each device. One MPS daemon or one time slice
// serves the whole claim, so differing configs are refused by name.
func claimSharing(claimName string, plan []PlannedDevice) (*gpuapi.Sharing, error) {
	var out *gpuapi.Sharing
	var first PlannedDevice
	var admin, used []string
	for _, p := range plan {
		if p.AdminAccess {
			// The monitoring view: no limits, no sharing, whatever the
			// config says.
			admin = append(admin, p.Device)
			continue
		}
		used = append(used, p.Device)
		cfg := p.Config
		if cfg == nil {
			cfg = gpuapi.DefaultConfig()
		}
		var err error
		if p.Share != nil {
			err = cfg.ValidateForShare(gpuapi.ShareBounds{Device: p.Device, MemoryBytes: p.Share.MemoryBytes,
				Multiprocessors: p.Share.Multiprocessors, GPUMultiprocessors: int64(p.GPU.Engines.Multiprocessors)})
		} else {
			err = cfg.ValidateForDevice(gpuapi.DeviceFacts{Name: p.Device, MemoryBytes: plannedMemory(p)})
		}
		if err != nil {
			return nil, fmt.Errorf("claim %s: request %s: %w", claimName, strings.Join(p.Requests, ","), err)
		}
		s := cfg.Sharing
		if s == nil {
			s = &gpuapi.Sharing{Strategy: gpuapi.Exclusive}
		}
		if out == nil {
			out, first = s, p
			continue
		}
		if !reflect.DeepEqual(out, s) {
			return nil, fmt.Errorf("claim %s: requests %s and %s have different sharing configs: one claim is shared one way (split it into two claims)",
				claimName, strings.Join(first.Requests, ","), strings.Join(p.Requests, ","))
		}
	}
	// A share of a GPU is capped with MPS unless the claim chose another
	// way to share (then the status says the cap is not enforced). A share
	// of all the memory leaves nothing to others: exclusive.
	if out == nil {
		return nil, nil // nothing but admin access
	}
	for _, p := range plan {
		if p.Share != nil && p.Share.MemoryBytes < int64(p.GPU.MemoryMiB)<<20 && out.Strategy == gpuapi.Exclusive {
			mps := *out
			mps.Strategy = gpuapi.MPS
			out = &mps
			break
		}
	}
	if len(admin) > 0 && needsSharingSetup(out) {
		// Sharing is set up for a claim's devices as one set (one MPS
		// server, one time slice): admin-access devices would be in it.
		return nil, fmt.Errorf("claim %s: devices %s have admin access and %s are shared (%s): admin access gets no sharing, split the claim",
			claimName, strings.Join(admin, ","), strings.Join(used, ","), out.Strategy)
	}
	return out, nil
}

// plannedMemory is what the device offers the claim: the share's memory,
// the MIG profile's, or the whole GPU's.
func plannedMemory(p PlannedDevice) int64 {
	switch {
	case p.Share != nil:
		return p.Share.MemoryBytes
	case p.Mig != nil:
		return int64(p.Mig.MemoryMiB) << 20
	default:
		return int64(p.GPU.MemoryMiB) << 20
	}
}

// preparedDevice is the planned device as it is prepared and recorded: its
// CDI id, and what sharing needs to find it again after a restart. MIG
// instance ids, UUIDs of created devices and device nodes are filled in as
// they become known.
func preparedDevice(uid, pool string, p PlannedDevice) prepared.Device {
	cdiName := p.Device
	if p.CDIName != "" {
		cdiName = p.CDIName
	}
	d := prepared.Device{Requests: p.Requests, Pool: pool, Device: p.Device, UUID: p.GPU.UUID,
		CDIDeviceIDs: []string{cdi.QualifiedName(uid, cdiName)}, CDIDevice: p.CDIName, AdminAccess: p.AdminAccess,
		GPUUUID: p.GPU.UUID, Mig: p.Mig != nil, MemoryBytes: plannedMemory(p),
		Multiprocessors: int64(p.GPU.Engines.Multiprocessors)}
	if p.Mig != nil {
		d.Multiprocessors = int64(p.Mig.Multiprocessors)
	}
	if s := p.Share; s != nil {
		d.Share = &prepared.Share{ID: s.ID, MemoryBytes: s.MemoryBytes, Multiprocessors: s.Multiprocessors,
			GPUMultiprocessors: int64(p.GPU.Engines.Multiprocessors)}
		if s.Multiprocessors > 0 {
			d.Multiprocessors = s.Multiprocessors
		}
	}
	return d
}

// needsSharingSetup says whether preparing the claim has sharing side
// effects that the checkpoint must know of first.
func needsSharingSetup(s *gpuapi.Sharing) bool {
	return s != nil && (s.Strategy != gpuapi.Exclusive && s.Strategy != "" || s.IPC)
}
