package deviceplugin

import (
	"sort"
	"strconv"
)

// PreferredAllocation picks size device IDs out of available for one
// container, from the devices the resource advertises (its topology). Pure.
//
//   - The must-include IDs come first, always.
//   - The rest is packed: kept within one NVLink domain if any domain has
//     enough free devices (the must-include devices' domain first, then the
//     domain with the fewest free devices that still fits, so that large
//     domains stay whole for large requests); within it the same rule picks
//     a NUMA node, then a GPU (for MIG devices). When no domain fits, whole
//     domains are taken largest first, to span as few as possible.
//   - Replicas (time-slicing, MPS) are spread over distinct GPUs, the GPU
//     with the most free replicas first: two replicas of one GPU are not
//     two GPUs.
//
// IDs in available the resource does not know are never picked; fewer than
// size IDs come back when too few are available.
func PreferredAllocation(devices []Device, available, mustInclude []string, size int) []string {
	byID := make(map[string]Device, len(devices))
	order := make(map[string]int, len(devices))
	for i, d := range devices {
		byID[d.ID] = d
		order[d.ID] = i
	}
	var result []string
	chosen := map[string]bool{}
	var must []Device
	for _, id := range mustInclude {
		if chosen[id] {
			continue
		}
		chosen[id] = true
		result = append(result, id)
		if d, ok := byID[id]; ok {
			must = append(must, d)
		}
	}
	need := size - len(result)
	if need <= 0 {
		return result
	}
	var free []Device
	for _, id := range available {
		d, ok := byID[id]
		if !ok || chosen[id] {
			continue
		}
		chosen[id] = true
		free = append(free, d)
	}
	sort.SliceStable(free, func(i, j int) bool { return order[free[i].ID] < order[free[j].ID] })
	levels := []func(Device) string{
		func(d Device) string { return d.NVLinkDomain },
		func(d Device) string { return strconv.Itoa(d.NUMANode) },
	}
	replicas := len(free) > 0 && free[0].Replicated()
	if !replicas {
		levels = append(levels, func(d Device) string { return d.GPUUUID })
	}
	for _, d := range pick(free, need, levels, must, replicas) {
		result = append(result, d.ID)
	}
	return result
}

// pick takes k of cands (in their order), packing level by level.
func pick(cands []Device, k int, levels []func(Device) string, must []Device, replicas bool) []Device {
	if k <= 0 {
		return nil
	}
	if k >= len(cands) {
		return spread(cands, replicas)
	}
	if len(levels) == 0 {
		return spread(cands, replicas)[:k]
	}
	key := levels[0]
	type group struct {
		key  string
		devs []Device
	}
	var groups []*group
	index := map[string]*group{}
	for _, d := range cands {
		g, ok := index[key(d)]
		if !ok {
			g = &group{key: key(d)}
			index[g.key] = g
			groups = append(groups, g)
		}
		g.devs = append(g.devs, d)
	}
	// The must-include devices' group, when they are all in one.
	affinity, single := "", true
	for i, d := range must {
		if i == 0 {
			affinity = key(d)
		} else if key(d) != affinity {
			single = false
		}
	}
	var out []Device
	remaining := groups
	for k > 0 && len(remaining) > 0 {
		var best *group
		for _, g := range remaining {
			if len(g.devs) < k {
				continue
			}
			if len(must) > 0 && single && g.key == affinity {
				best = g
				break
			}
			if best == nil || len(g.devs) < len(best.devs) {
				best = g
			}
		}
		if best != nil {
			return append(out, pick(best.devs, k, levels[1:], must, replicas)...)
		}
		// Nothing fits: take the largest group whole and go on.
		largest := 0
		for i, g := range remaining {
			if len(g.devs) > len(remaining[largest].devs) {
				largest = i
			}
		}
		g := remaining[largest]
		out = append(out, spread(g.devs, replicas)...)
		k -= len(g.devs)
		remaining = append(remaining[:largest:largest], remaining[largest+1:]...)
	}
	return out
}

// spread orders replicas round-robin over their GPUs, the GPU with the most
// replicas first; other devices keep their order.
func spread(devs []Device, replicas bool) []Device {
	if !replicas {
		return devs
	}
	var gpus []string
	per := map[string][]Device{}
	for _, d := range devs {
		if _, ok := per[d.UUID]; !ok {
			gpus = append(gpus, d.UUID)
		}
		per[d.UUID] = append(per[d.UUID], d)
	}
	sort.SliceStable(gpus, func(i, j int) bool { return len(per[gpus[i]]) > len(per[gpus[j]]) })
	out := make([]Device, 0, len(devs))
	for round := 0; len(out) < len(devs); round++ {
		for _, g := range gpus {
			if round < len(per[g]) {
				out = append(out, per[g][round])
			}
		}
	}
	return out
}
