package allocator

import (
	"cmp"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/structured"
)

// poolKey names a driver's pool.
type poolKey struct{ driver, pool string }

// allocatedByPool groups the allocated devices' names by pool, once per
// plan: count then compares names within a node's pool instead of making a
// device ID for every published device (issue 26: at 1,000 MIG-mode nodes
// that was a third of a 64-GPU plan).
func allocatedByPool(st *state) map[poolKey]sets.Set[string] {
	out := map[poolKey]sets.Set[string]{}
	for id := range st.allocated {
		k := poolKey{id.Driver.String(), id.Pool.String()}
		if out[k] == nil {
			out[k] = sets.New[string]()
		}
		out[k].Insert(id.Device.String())
	}
	return out
}

// count fills total, free and the free GPUs per NVLink domain. A GPU is
// free when neither it nor any device sharing one of its counter sets (a
// MIG device on it) is allocated. It is an estimate for ordering only: the
// structured allocator decides.
func (n *nodeInfo) count(allocated map[poolKey]sets.Set[string], deviceDomain map[structured.DeviceID]string) {
	n.domains = map[string]int{}
	type setKey struct{ pool, set string }
	used := map[setKey]bool{}
	for _, s := range n.slices {
		inPool := allocated[poolKey{s.Spec.Driver, s.Spec.Pool.Name}]
		if inPool.Len() == 0 {
			continue
		}
		for _, d := range s.Spec.Devices {
			if !inPool.Has(d.Name) {
				continue
			}
			for _, c := range d.ConsumesCounters {
				used[setKey{s.Spec.Pool.Name, c.CounterSet}] = true
			}
		}
	}
	for _, s := range n.slices {
		if s.Spec.Driver != DriverName {
			continue
		}
		inPool := allocated[poolKey{s.Spec.Driver, s.Spec.Pool.Name}]
		for _, d := range s.Spec.Devices {
			if StringAttribute(d, "type") != "gpu" {
				continue
			}
			id := structured.MakeDeviceID(s.Spec.Driver, s.Spec.Pool.Name, d.Name)
			domain := StringAttribute(d, "nvlinkDomain")
			if domain == "" {
				domain = "node:" + n.name() + "/" + d.Name // no NVLink: a domain of its own
			}
			deviceDomain[id] = domain
			n.total++
			free := !inPool.Has(d.Name)
			for _, c := range d.ConsumesCounters {
				if used[setKey{s.Spec.Pool.Name, c.CounterSet}] {
					free = false
				}
			}
			if free {
				n.free++
				n.domains[domain]++
			} else if _, ok := n.domains[domain]; !ok {
				n.domains[domain] = 0
			}
		}
	}
}

// chooseDomains picks NVLink domains for a gang of total devices: while
// devices remain, the smallest domain that holds all of them (best fit),
// else the largest. It returns the rank of each node of the chosen domains
// (lower first); within a domain, nodes with more free GPUs come first.
func chooseDomains(nodes []*nodeInfo, total int64) map[string]int {
	type domain struct {
		name  string
		free  int
		nodes []*nodeInfo
	}
	byName := map[string]*domain{}
	var all []*domain
	for _, n := range nodes {
		for name, free := range n.domains {
			d := byName[name]
			if d == nil {
				d = &domain{name: name}
				byName[name] = d
				all = append(all, d)
			}
			d.free += free
			if free > 0 {
				d.nodes = append(d.nodes, n)
			}
		}
	}
	slices.SortFunc(all, func(a, b *domain) int {
		return cmp.Or(cmp.Compare(b.free, a.free), strings.Compare(a.name, b.name))
	})
	rank := map[string]int{}
	remaining := total
	next := 0
	for remaining > 0 && len(all) > 0 {
		// all is sorted by free descending: the best fit is the last
		// domain that still holds everything.
		pick := 0
		if int64(all[0].free) >= remaining {
			pick, _ = slices.BinarySearchFunc(all, remaining, func(d *domain, r int64) int {
				// descending order: "less" means more free than r.
				if int64(d.free) >= r {
					return -1
				}
				return 1
			})
			pick--
		}
		d := all[pick]
		if d.free == 0 {
			break
		}
		all = slices.Delete(all, pick, pick+1)
		slices.SortFunc(d.nodes, func(a, b *nodeInfo) int {
			return cmp.Or(cmp.Compare(b.domains[d.name], a.domains[d.name]), strings.Compare(a.name(), b.name()))
		})
		for _, n := range d.nodes {
			if _, ok := rank[n.name()]; !ok {
				rank[n.name()] = next
				next++
			}
		}
		remaining -= int64(d.free)
	}
	return rank
}

// rank returns up to limit candidate nodes in the strategy's order. Nodes
// with fewer free GPUs than the unit needs (by the estimate), and then
// nodes without any, come last rather than not at all, since the unit may
// ask for devices the estimate does not see (MIG devices).
func rank(nodes []*nodeInfo, strategy Strategy, preferred map[string]int, limit int, need int64) []*nodeInfo {
	used := func(n *nodeInfo) float64 {
		if n.total == 0 {
			return 0
		}
		return float64(n.total-n.free) / float64(n.total)
	}
	compare := func(a, b *nodeInfo) int {
		// Nodes that can hold the unit by the estimate first: only limit
		// nodes are tried, and a strategy's favourites (Binpack's busy
		// nodes, FewestNVLinkDomains' chosen domains) may all be too full.
		if c := cmp.Compare(boolInt(int64(a.free) < need), boolInt(int64(b.free) < need)); c != 0 {
			return c
		}
		if c := cmp.Compare(boolInt(a.free == 0), boolInt(b.free == 0)); c != 0 {
			return c
		}
		switch strategy {
		case Binpack:
			if c := cmp.Compare(used(b), used(a)); c != 0 {
				return c
			}
		case Spread:
			if c := cmp.Compare(used(a), used(b)); c != 0 {
				return c
			}
		case FewestNVLinkDomains:
			ra, oka := preferred[a.name()]
			rb, okb := preferred[b.name()]
			switch {
			case oka && okb:
				if c := cmp.Compare(ra, rb); c != 0 {
					return c
				}
			case oka:
				return -1
			case okb:
				return 1
			}
			// Outside the chosen domains: the largest free share first.
			if c := cmp.Compare(b.free, a.free); c != 0 {
				return c
			}
		}
		return strings.Compare(a.name(), b.name())
	}
	if limit >= len(nodes) {
		out := slices.Clone(nodes)
		slices.SortFunc(out, compare)
		return out
	}
	// Partial selection: keep the best limit nodes.
	out := make([]*nodeInfo, 0, limit+1)
	for _, n := range nodes {
		if len(out) == limit && compare(n, out[limit-1]) >= 0 {
			continue
		}
		i, _ := slices.BinarySearchFunc(out, n, compare)
		out = slices.Insert(out, i, n)
		if len(out) > limit {
			out = out[:limit]
		}
	}
	return out
}
