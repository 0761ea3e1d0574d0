package deviceplugin

import (
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// baseDevices are the devices of each resource before replication, by the
// MIG strategy, with the rules of NVIDIA's plugin (internal/rm/device_map.go):
//
//   - none: every GPU under the GPU resource name, a GPU in MIG mode
//     included (as a whole GPU: the container gets its device nodes).
//   - single: if no GPU is in MIG mode, the whole GPUs; otherwise the MIG
//     devices under the GPU resource name, which needs every GPU in MIG
//     mode, each with at least one MIG device, and every MIG device of one
//     profile. Anything else is an error naming the GPUs and profiles.
//   - mixed: the GPUs with MIG mode off under the GPU resource name, and
//     the MIG devices under one resource per profile; a GPU in MIG mode
//     without MIG devices adds nothing.
func baseDevices(inv *nvdevice.Inventory, strategy, gpuName string) (map[string][]Device, error) {
	base := map[string][]Device{}
	switch strategy {
	case MigStrategyNone:
		for i := range inv.GPUs {
			base[gpuName] = append(base[gpuName], gpuDevice(&inv.GPUs[i]))
		}
	case MigStrategySingle, MigStrategyMixed:
		if strategy == MigStrategySingle {
			if err := checkSingle(inv); err != nil {
				return nil, err
			}
		}
		for i := range inv.GPUs {
			g := &inv.GPUs[i]
			if !g.MIG.Enabled {
				base[gpuName] = append(base[gpuName], gpuDevice(g))
				continue
			}
			for j := range g.MIG.Devices {
				m := &g.MIG.Devices[j]
				// single: every MIG device is a GPU; mixed: one resource
				// per profile.
				name := gpuName
				if strategy == MigStrategyMixed {
					name = MigResourceName(m.Profile)
				}
				base[name] = append(base[name], migDevice(g, m))
			}
		}
	default:
		return nil, fmt.Errorf("flags.migStrategy: unknown strategy %q", strategy)
	}
	return base, nil
}

// checkSingle says why a node does not fit the single strategy, in NVIDIA's
// order: a GPU in MIG mode without MIG devices, MIG devices of more than one
// kind (NVIDIA compares the MIG devices' attributes: the profile and its
// memory here), GPUs with MIG mode on and off.
func checkSingle(inv *nvdevice.Inventory) error {
	var errs []error
	var empty, migOn, migOff []string
	type kind struct {
		profile string
		mib     uint64
	}
	kinds := map[kind][]string{}
	for i := range inv.GPUs {
		g := &inv.GPUs[i]
		if !g.MIG.Enabled {
			migOff = append(migOff, gpuRef(g))
			continue
		}
		migOn = append(migOn, gpuRef(g))
		if len(g.MIG.Devices) == 0 {
			empty = append(empty, gpuRef(g))
		}
		seen := map[kind]bool{}
		for _, m := range g.MIG.Devices {
			k := kind{m.Profile, m.MemoryMiB}
			if !seen[k] {
				seen[k] = true
				kinds[k] = append(kinds[k], "GPU "+strconv.Itoa(g.Index))
			}
		}
	}
	if len(empty) > 0 {
		errs = append(errs, fmt.Errorf("%s in MIG mode without MIG devices: configure them (nvidia-smi mig, the GPU operator's MIG manager) or turn MIG mode off", strings.Join(empty, ", ")))
	}
	if len(kinds) > 1 {
		profiles := map[string]int{}
		for k := range kinds {
			profiles[k.profile]++
		}
		var parts []string
		for k, gpus := range kinds {
			label := k.profile
			if profiles[k.profile] > 1 {
				label = fmt.Sprintf("%s (%d MiB)", k.profile, k.mib)
			}
			parts = append(parts, fmt.Sprintf("%s on %s", label, strings.Join(gpus, ", ")))
		}
		sort.Strings(parts)
		errs = append(errs, fmt.Errorf("MIG devices of more than one profile: %s; single needs one profile on every GPU (use \"mixed\" for one resource per profile)", strings.Join(parts, "; ")))
	}
	if len(migOn) > 0 && len(migOff) > 0 && len(kinds) > 0 {
		errs = append(errs, fmt.Errorf("%s in MIG mode but %s not: single needs every GPU in the same MIG mode (use \"mixed\")", strings.Join(migOn, ", "), strings.Join(migOff, ", ")))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("flags.migStrategy: %q does not fit this node: %w", MigStrategySingle, err)
	}
	return nil
}

func gpuRef(g *nvdevice.GPU) string { return fmt.Sprintf("GPU %d (%s)", g.Index, g.UUID) }
