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
	for i, p := range plan {
		cfg := p.Config
		if cfg == nil {
			cfg = gpuapi.DefaultConfig()
		}
		if err := cfg.ValidateForDevice(gpuapi.DeviceFacts{Name: p.Device, MemoryBytes: plannedMemory(p)}); err != nil {
			return nil, fmt.Errorf("claim %s: request %s: %w", claimName, strings.Join(p.Requests, ","), err)
		}
		s := cfg.Sharing
		if s == nil {
			s = &gpuapi.Sharing{Strategy: gpuapi.Exclusive}
		}
		if i == 0 {
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
	for _, p := range plan {
		if p.Share != nil && p.Share.MemoryBytes < int64(p.GPU.MemoryMiB)<<20 && out.Strategy == gpuapi.Exclusive {
			mps := *out
			mps.Strategy = gpuapi.MPS
			out = &mps
			break
		}
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
	d := prepared.Device{Requests: p.Requests, Pool: pool, Device: p.Device, UUID: p.GPU.UUID,
		CDIDeviceIDs: []string{cdi.QualifiedName(uid, p.Device)},
		GPUUUID:      p.GPU.UUID, Mig: p.Mig != nil, MemoryBytes: plannedMemory(p),
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
