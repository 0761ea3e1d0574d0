package gang

import (
	"fmt"
	"slices"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/utils/ptr"
)

// A partitionable GPU's devices (the whole GPU and its MIG placements)
// consume shared counters of their pool: two of them can be allocated to
// two claims as long as the counters hold. Device names alone cannot tell a
// fence or a check which devices a plan collides with.

// counterSet names one counter set of a pool.
type counterSet struct{ driver, pool, set string }

// counterIndex reads the slices once: what each device consumes, which
// devices consume each counter set, and each counter's capacity.
type counterIndex struct {
	capacity map[counterSet]map[string]resource.Quantity
	consumes map[deviceRef]map[counterSet]map[string]resource.Quantity
	bySet    map[counterSet][]deviceRef
}

func newCounterIndex(slices []*resourceapi.ResourceSlice) *counterIndex {
	x := &counterIndex{capacity: map[counterSet]map[string]resource.Quantity{},
		consumes: map[deviceRef]map[counterSet]map[string]resource.Quantity{}, bySet: map[counterSet][]deviceRef{}}
	for _, s := range slices {
		for _, cs := range s.Spec.SharedCounters {
			key := counterSet{s.Spec.Driver, s.Spec.Pool.Name, cs.Name}
			caps := map[string]resource.Quantity{}
			for name, c := range cs.Counters {
				caps[name] = c.Value
			}
			x.capacity[key] = caps
		}
		for _, d := range s.Spec.Devices {
			ref := deviceRef{s.Spec.Driver, s.Spec.Pool.Name, d.Name}
			for _, cc := range d.ConsumesCounters {
				key := counterSet{s.Spec.Driver, s.Spec.Pool.Name, cc.CounterSet}
				if x.consumes[ref] == nil {
					x.consumes[ref] = map[counterSet]map[string]resource.Quantity{}
				}
				use := map[string]resource.Quantity{}
				for name, c := range cc.Counters {
					use[name] = c.Value
				}
				x.consumes[ref][key] = use
				x.bySet[key] = append(x.bySet[key], ref)
			}
		}
	}
	return x
}

// siblings are the devices, other than the given ones, that share a
// counter set with one of them: the whole GPU of a planned MIG placement,
// the placements of a planned whole GPU, and the other placements of the
// same GPU. A fence must cover them, or the scheduler could allocate a
// placement whose memory slices a planned one needs.
func (x *counterIndex) siblings(devices []deviceRef) []deviceRef {
	own := map[deviceRef]bool{}
	for _, d := range devices {
		own[d] = true
	}
	seen := map[deviceRef]bool{}
	var out []deviceRef
	for _, d := range devices {
		for set := range x.consumes[d] {
			for _, s := range x.bySet[set] {
				if !own[s] && !seen[s] {
					seen[s] = true
					out = append(out, s)
				}
			}
		}
	}
	slices.SortFunc(out, func(a, b deviceRef) int {
		return strings.Compare(a.pool+"/"+a.device, b.pool+"/"+b.device)
	})
	return out
}

// overdrawn says which counter the devices, allocated together, consume
// beyond its capacity ("" when none does).
func (x *counterIndex) overdrawn(devices []deviceRef) string {
	bySet := map[counterSet][]deviceRef{}
	for _, d := range devices {
		for set := range x.consumes[d] {
			bySet[set] = append(bySet[set], d)
		}
	}
	var over []string
	for set, ds := range bySet {
		if o := x.overdrawnIn(set, ds); o != "" {
			over = append(over, o)
		}
	}
	slices.Sort(over)
	return strings.Join(over, ", ")
}

// overdrawnIn is overdrawn for one counter set: the devices' consumption
// of it against its capacity.
func (x *counterIndex) overdrawnIn(set counterSet, devices []deviceRef) string {
	sum := map[string]*resource.Quantity{}
	for _, d := range devices {
		for name, q := range x.consumes[d][set] {
			if sum[name] == nil {
				sum[name] = ptr.To(resource.Quantity{})
			}
			sum[name].Add(q)
		}
	}
	var over []string
	for name, used := range sum {
		if capacity, ok := x.capacity[set][name]; ok && used.Cmp(capacity) > 0 {
			over = append(over, fmt.Sprintf("counter %s of %s/%s (%s used of %s)", name, set.pool, set.set, used.String(), capacity.String()))
		}
	}
	slices.Sort(over)
	return strings.Join(over, ", ")
}
