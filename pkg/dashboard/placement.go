package dashboard

import (
	"math"
	"strconv"
	"strings"

	resourceapi "k8s.io/api/resource/v1"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// Where a MIG device sits on its GPU's memory slices, from what its slice
// publishes, or from its name alone where only a claim shows it.

// memorySlicePrefix names the counters of a GPU's memory slices
// (slicebuilder: memory-slice-N).
const memorySlicePrefix = "memory-slice-"

// placementOf is where a MIG device sits on its GPU's memory slices: the
// memory-slice counters it consumes; for a device that consumes none (an
// existing MIG device, published as it is), its name's start and its
// memory's share of the GPU's.
func placementOf(d *resourceapi.Device, gpuMemory, memory int64) (start, size int) {
	lo, hi := math.MaxInt, -1
	for _, c := range d.ConsumesCounters {
		for name := range c.Counters {
			if rest, ok := strings.CutPrefix(name, memorySlicePrefix); ok {
				if i, err := strconv.Atoi(rest); err == nil {
					lo, hi = min(lo, i), max(hi, i)
				}
			}
		}
	}
	if hi >= 0 {
		return lo, hi - lo + 1
	}
	start = nameStart(d.Name)
	size = 1
	if gpuMemory > 0 && memory > 0 {
		size = max(1, int(math.Round(float64(memory)*nvdevice.MemorySlices/float64(gpuMemory))))
	}
	return start, size
}

// nameStart is the placement start in a MIG device's name
// (gpu-0-mig-3g-40gb-4 -> 4).
func nameStart(name string) int {
	i := strings.LastIndexByte(name, '-')
	n, err := strconv.Atoi(name[i+1:])
	if err != nil {
		return 0
	}
	return n
}

// parentName is a MIG device's GPU's name (gpu-0-mig-3g-40gb-4 -> gpu-0).
func parentName(name string) string {
	if i := strings.Index(name, "-mig-"); i >= 0 {
		return name[:i]
	}
	return name
}

// computeSlices is the memory slices of a profile known only by its name
// label (a device seen only through a claim): from its compute slices, as
// the H100 family lays them out (1g: 1, 2g: 2, 3g and 4g: 4, 7g: 8). A 1g
// profile with twice the memory (1g.20gb) takes 2 but is drawn as 1: the
// label does not say.
func computeSlices(profileLabel string) int {
	g, _, _ := strings.Cut(profileLabel, "g")
	switch g {
	case "2":
		return 2
	case "3", "4":
		return 4
	case "7":
		return 8
	default:
		return 1
	}
}

func overlapsAny(p Placement, held []Placement) bool {
	for _, h := range held {
		if p.Start < h.Start+h.Size && h.Start < p.Start+p.Size {
			return true
		}
	}
	return false
}
