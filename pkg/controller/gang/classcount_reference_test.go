package gang

import (
	"context"
	"slices"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"
)

// The count from scratch: what the controller did before it kept counts
// from events (issue 26), kept as the reference TestClassCounterEqualsFromScratch
// holds classCounter to, and for BenchmarkCountByClass1000MigNodes.

// classCounts counts, per DeviceClass, the devices that match it: free,
// held by a reservation's unused claim, or allocated otherwise. Devices
// partly used through shared counters (a GPU with a MIG device in use)
// count as allocated. Only exact use is counted: a shared device is free.

func countByClass(ctx context.Context, cache *cel.Cache, classes []*resourceapi.DeviceClass, resourceSlices []*resourceapi.ResourceSlice,
	allocated []*resourceapi.ResourceClaim, heldClaims sets.Set[string], known *classMatches) map[string]classCount {
	if known == nil {
		known = newClassMatches()
	}
	defer known.prune()
	state := map[devKey]string{}
	for _, c := range allocated {
		if c.Status.Allocation == nil {
			continue
		}
		s := "allocated"
		if heldClaims.Has(c.Namespace+"/"+c.Name) && len(c.Status.ReservedFor) == 0 {
			s = "held"
		}
		for _, r := range c.Status.Allocation.Devices.Results {
			// A device two claims allocated counts as allocated if either is.
			if k := (devKey{r.Driver, r.Pool, r.Device}); r.ShareID == nil && state[k] != "allocated" {
				state[k] = s
			}
		}
	}
	usedSets := sets.New[setKey]()
	for _, sl := range resourceSlices {
		for _, d := range sl.Spec.Devices {
			if _, ok := state[devKey{sl.Spec.Driver, sl.Spec.Pool.Name, d.Name}]; ok {
				for _, cc := range d.ConsumesCounters {
					usedSets.Insert(setKey{sl.Spec.Driver, sl.Spec.Pool.Name, cc.CounterSet})
				}
			}
		}
	}
	out := map[string]classCount{}
	for _, class := range classes {
		var cnt classCount
		for _, sl := range resourceSlices {
			for _, d := range sl.Spec.Devices {
				if !known.match(ctx, cache, class, sl, d) {
					continue
				}
				switch s := state[devKey{sl.Spec.Driver, sl.Spec.Pool.Name, d.Name}]; {
				case s == "held":
					cnt.held++
				case s == "allocated":
					cnt.allocated++
				case slices.ContainsFunc(d.ConsumesCounters, func(cc resourceapi.DeviceCounterConsumption) bool {
					return usedSets.Has(setKey{sl.Spec.Driver, sl.Spec.Pool.Name, cc.CounterSet})
				}):
					cnt.allocated++
				default:
					cnt.free++
				}
			}
		}
		out[class.Name] = cnt
	}
	return out
}

// classMatches remembers which devices each class selects, per version of
// the class and of the device's slice: the per-class counts run every 15 s,
// and evaluating every class's CEL on every device each time was the
// controller's largest idle cost on a large cluster (issue 26). Entries not
// used by a count are dropped after it.
type classMatches struct {
	eval func(ctx context.Context, cache *cel.Cache, class *resourceapi.DeviceClass, driver string, d resourceapi.Device) bool
	m    map[matchKey]bool
	used map[matchKey]bool
}

type matchKey struct {
	class, slice     types.UID
	classRV, sliceRV string
	device           string
}

func newClassMatches() *classMatches {
	return &classMatches{eval: matches, m: map[matchKey]bool{}, used: map[matchKey]bool{}}
}

func (c *classMatches) match(ctx context.Context, cache *cel.Cache, class *resourceapi.DeviceClass, sl *resourceapi.ResourceSlice, d resourceapi.Device) bool {
	key := matchKey{class: class.UID, classRV: class.ResourceVersion, slice: sl.UID, sliceRV: sl.ResourceVersion, device: d.Name}
	ok, known := c.m[key]
	if !known || key.classRV == "" || key.sliceRV == "" {
		ok = c.eval(ctx, cache, class, sl.Spec.Driver, d)
		c.m[key] = ok
	}
	c.used[key] = true
	return ok
}

// prune forgets what the last count did not use (old versions, gone slices).
func (c *classMatches) prune() {
	for k := range c.m {
		if !c.used[k] {
			delete(c.m, k)
		}
	}
	c.used = map[matchKey]bool{}
}
