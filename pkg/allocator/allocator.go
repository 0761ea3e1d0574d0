// Package allocator plans device allocations for a set of ResourceClaims at
// once (a gang, a reservation) over the cluster's ResourceSlices, with the
// scheduler's own structured allocator
// (k8s.io/dynamic-resource-allocation/structured) doing the per-node
// matching, so that CEL selectors, constraints, counters, consumable
// capacity and firstAvailable mean exactly what they mean to the scheduler.
//
// On top of it the planner chooses nodes by a strategy (Binpack, Spread,
// FewestNVLinkDomains) and is all-or-nothing: either every claim gets
// devices or Plan fails with an error naming the claim that did not fit.
//
// Plan is pure apart from the structured allocator: it makes no API calls
// and does not modify its input. Every search is bounded: each claim tries
// at most MaxNodesTried candidate nodes, in the strategy's order.
package allocator

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/utils/ptr"
)

// DriverName is gpudra's DRA driver.
const DriverName = "gpu.gpudra.dev"

// NVLinkDomainAttribute is the device attribute that names a GPU's NVLink
// domain (GPUs of one NVSwitch fabric or one multi-node clique share it).
const NVLinkDomainAttribute resourceapi.QualifiedName = DriverName + "/nvlinkDomain"

// Strategy chooses the order in which candidate nodes are tried.
type Strategy string

const (
	// Binpack fills the most-used nodes first.
	Binpack Strategy = "Binpack"
	// Spread tries the least-used nodes first.
	Spread Strategy = "Spread"
	// FewestNVLinkDomains packs the claims' devices into as few NVLink
	// domains, then as few nodes, as possible.
	FewestNVLinkDomains Strategy = "FewestNVLinkDomains"
)

// DefaultMaxNodesTried bounds how many nodes one claim is tried on.
const DefaultMaxNodesTried = 32

// DefaultFeatures are the DRA features a 1.37 scheduler runs with by
// default: GA (admin access, device taints, prioritized list, binding
// conditions and device status) and beta (partitionable devices, consumable
// capacity).
var DefaultFeatures = structured.Features{
	AdminAccess:            true,
	ConsumableCapacity:     true,
	DeviceBindingAndStatus: true,
	DeviceTaints:           true,
	PartitionableDevices:   true,
	PrioritizedList:        true,
}

// Input is everything Plan looks at.
type Input struct {
	// Claims are planned together, all or nothing. Plan them in the count
	// form: one request with count N (with a matchAttribute constraint if
	// the devices must share an attribute), not N requests tied by
	// matchAttribute, which makes the structured allocator's search explode.
	// Claims that already have an allocation are rejected.
	Claims []*resourceapi.ResourceClaim
	// Slices are the cluster's ResourceSlices (resource.k8s.io/v1).
	Slices []*resourceapi.ResourceSlice
	// Classes are the cluster's DeviceClasses.
	Classes []*resourceapi.DeviceClass
	// Allocated are the claims already allocated: their devices (and the
	// capacity they consume) are in use. Unallocated claims are ignored.
	Allocated []*resourceapi.ResourceClaim
	// Nodes are the candidate nodes. When empty, one bare Node per node
	// name that the slices mention is used.
	Nodes []*v1.Node
	// Strategy defaults to FewestNVLinkDomains.
	Strategy Strategy
	// MaxNodesTried bounds the nodes tried per claim (DefaultMaxNodesTried
	// when zero).
	MaxNodesTried int
	// Features default to DefaultFeatures when zero.
	Features *structured.Features
	// CELCache is reused across calls when set.
	CELCache *cel.Cache
}

// ClaimAllocation is the plan for one claim.
type ClaimAllocation struct {
	// Claim is the input claim (not modified).
	Claim *resourceapi.ResourceClaim
	// Node is the node whose devices the claim gets.
	Node string
	// Result is what to write into the claim's status.allocation.
	Result resourceapi.AllocationResult
}

// Result is the result of planning: one allocation per input claim, in
// input order, and the nodes chosen.
type Result struct {
	Allocations []ClaimAllocation
	// Nodes are the distinct chosen nodes, sorted.
	Nodes []string
	// NVLinkDomains are the distinct NVLink domains of the allocated
	// devices, sorted.
	NVLinkDomains []string
}

// nodeInfo is what the planner knows of one node.
type nodeInfo struct {
	node   *v1.Node
	slices []*resourceapi.ResourceSlice
	total  int // whole GPUs (devices with an NVLink domain or type gpu)
	free   int
	// domains maps NVLink domain to free whole GPUs on this node.
	domains map[string]int
}

func (n *nodeInfo) name() string { return n.node.Name }

// Plan plans every claim of in.Claims or none.
func Plan(ctx context.Context, in Input) (Result, error) {
	if len(in.Claims) == 0 {
		return Result{}, nil
	}
	features := DefaultFeatures
	if in.Features != nil {
		features = *in.Features
	}
	maxTried := in.MaxNodesTried
	if maxTried <= 0 {
		maxTried = DefaultMaxNodesTried
	}
	strategy := in.Strategy
	if strategy == "" {
		strategy = FewestNVLinkDomains
	}
	switch strategy {
	case Binpack, Spread, FewestNVLinkDomains:
	default:
		return Result{}, fmt.Errorf("unknown strategy %q", strategy)
	}
	cache := in.CELCache
	if cache == nil {
		cache = cel.NewCache(100, cel.Features{})
	}
	for _, c := range in.Claims {
		if c.Status.Allocation != nil {
			return Result{}, fmt.Errorf("claim %s is already allocated", claimName(c))
		}
	}

	state := newState()
	for _, c := range in.Allocated {
		if c.Status.Allocation != nil {
			state.add(&c.Status.Allocation.Devices)
		}
	}
	nodes, shared := groupSlices(in)
	byName := make(map[string]*nodeInfo, len(nodes))
	deviceDomain := map[structured.DeviceID]string{}
	for _, n := range nodes {
		byName[n.name()] = n
		n.count(state, deviceDomain)
	}
	classes := classLister(in.Classes)

	// First-fit decreasing: the biggest claims pick first.
	order := make([]int, len(in.Claims))
	for i := range order {
		order[i] = i
	}
	demand := make([]int64, len(in.Claims))
	var total int64
	for i, c := range in.Claims {
		demand[i] = claimDemand(c)
		total += demand[i]
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(demand[b], demand[a]) })

	var preferred map[string]int // node -> rank, FewestNVLinkDomains
	if strategy == FewestNVLinkDomains {
		preferred = chooseDomains(nodes, total)
	}

	out := Result{Allocations: make([]ClaimAllocation, len(in.Claims))}
	for _, i := range order {
		claim := in.Claims[i]
		candidates := rank(nodes, strategy, preferred, maxTried)
		var placed bool
		for _, n := range candidates {
			if err := ctx.Err(); err != nil {
				return Result{}, err
			}
			nodeSlices := n.slices
			if len(shared) > 0 {
				nodeSlices = append(slices.Clip(n.slices), shared...)
			}
			alloc, err := structured.NewAllocator(ctx, features, state.snapshot(), classes, nodeSlices, cache)
			if err != nil {
				return Result{}, fmt.Errorf("claim %s: %w", claimName(claim), err)
			}
			results, err := alloc.Allocate(ctx, n.node, []*resourceapi.ResourceClaim{claim})
			if err != nil {
				if errors.Is(err, structured.ErrFailedAllocationOnNode) {
					continue
				}
				return Result{}, fmt.Errorf("claim %s on node %s: %w", claimName(claim), n.name(), err)
			}
			if len(results) != 1 {
				continue
			}
			res := results[0]
			state.add(&res.Devices)
			for _, r := range res.Devices.Results {
				id := structured.MakeDeviceID(r.Driver, r.Pool, r.Device)
				if d, ok := deviceDomain[id]; ok && r.ShareID == nil {
					owner := byName[n.name()]
					if owner.domains[d] > 0 {
						owner.domains[d]--
						owner.free--
					}
				}
			}
			out.Allocations[i] = ClaimAllocation{Claim: claim, Node: n.name(), Result: res}
			placed = true
			break
		}
		if !placed {
			return Result{}, fmt.Errorf("claim %s (%d devices) does not fit: tried %d of %d nodes with strategy %s; nothing allocated",
				claimName(claim), demand[i], len(candidates), len(nodes), strategy)
		}
	}

	nodeSet, domainSet := sets.New[string](), sets.New[string]()
	for _, a := range out.Allocations {
		nodeSet.Insert(a.Node)
		for _, r := range a.Result.Devices.Results {
			if d, ok := deviceDomain[structured.MakeDeviceID(r.Driver, r.Pool, r.Device)]; ok {
				domainSet.Insert(d)
			}
		}
	}
	out.Nodes = sets.List(nodeSet)
	out.NVLinkDomains = sets.List(domainSet)
	return out, nil
}

func claimName(c *resourceapi.ResourceClaim) string {
	if c.Namespace == "" {
		return c.Name
	}
	return c.Namespace + "/" + c.Name
}

// claimDemand estimates how many devices a claim asks for: the count of
// each exact request (the first alternative of a firstAvailable list), 1
// for a request for all devices.
func claimDemand(c *resourceapi.ResourceClaim) int64 {
	var n int64
	for _, r := range c.Spec.Devices.Requests {
		switch {
		case r.Exactly != nil:
			n += requestCount(r.Exactly.AllocationMode, r.Exactly.Count)
		case len(r.FirstAvailable) > 0:
			n += requestCount(r.FirstAvailable[0].AllocationMode, r.FirstAvailable[0].Count)
		}
	}
	return n
}

func requestCount(mode resourceapi.DeviceAllocationMode, count int64) int64 {
	if mode == resourceapi.DeviceAllocationModeAll {
		return 1
	}
	return max(count, 1)
}

// groupSlices splits the slices by node; slices not bound to one node
// (allNodes, nodeSelector) are offered to every node.
func groupSlices(in Input) ([]*nodeInfo, []*resourceapi.ResourceSlice) {
	byNode := map[string][]*resourceapi.ResourceSlice{}
	var shared []*resourceapi.ResourceSlice
	var names []string
	for _, s := range in.Slices {
		name := ptr.Deref(s.Spec.NodeName, "")
		if name == "" {
			shared = append(shared, s)
			continue
		}
		if _, ok := byNode[name]; !ok {
			names = append(names, name)
		}
		byNode[name] = append(byNode[name], s)
	}
	var nodes []*nodeInfo
	if len(in.Nodes) > 0 {
		for _, n := range in.Nodes {
			nodes = append(nodes, &nodeInfo{node: n, slices: byNode[n.Name]})
		}
	} else {
		slices.Sort(names)
		for _, name := range names {
			nodes = append(nodes, &nodeInfo{node: &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}, slices: byNode[name]})
		}
	}
	return nodes, shared
}

// count fills total, free and the free GPUs per NVLink domain. A GPU is
// free when neither it nor any device sharing one of its counter sets (a
// MIG device on it) is allocated. It is an estimate for ordering only: the
// structured allocator decides.
func (n *nodeInfo) count(st *state, deviceDomain map[structured.DeviceID]string) {
	n.domains = map[string]int{}
	type setKey struct{ pool, set string }
	used := map[setKey]bool{}
	for _, s := range n.slices {
		for _, d := range s.Spec.Devices {
			if !st.allocated.Has(structured.MakeDeviceID(s.Spec.Driver, s.Spec.Pool.Name, d.Name)) {
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
		for _, d := range s.Spec.Devices {
			if attrString(d, "type") != "gpu" {
				continue
			}
			id := structured.MakeDeviceID(s.Spec.Driver, s.Spec.Pool.Name, d.Name)
			domain := attrString(d, "nvlinkDomain")
			if domain == "" {
				domain = "node:" + n.name() + "/" + d.Name // no NVLink: a domain of its own
			}
			deviceDomain[id] = domain
			n.total++
			free := !st.allocated.Has(id)
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
// without a free GPU (by the estimate) come last, since the claim may ask
// for other devices the estimate does not see.
func rank(nodes []*nodeInfo, strategy Strategy, preferred map[string]int, limit int) []*nodeInfo {
	used := func(n *nodeInfo) float64 {
		if n.total == 0 {
			return 0
		}
		return float64(n.total-n.free) / float64(n.total)
	}
	compare := func(a, b *nodeInfo) int {
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

// attrString reads a string attribute of gpudra's driver, named with or
// without the driver's domain.
func attrString(d resourceapi.Device, name string) string {
	a, ok := d.Attributes[resourceapi.QualifiedName(name)]
	if !ok {
		a, ok = d.Attributes[resourceapi.QualifiedName(DriverName+"/"+name)]
	}
	if !ok || a.StringValue == nil {
		return ""
	}
	return *a.StringValue
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// state is the scheduler's view of what is in use.
type state struct {
	allocated sets.Set[structured.DeviceID]
	shared    sets.Set[structured.SharedDeviceID]
	capacity  structured.ConsumedCapacityCollection
}

func newState() *state {
	return &state{
		allocated: sets.New[structured.DeviceID](),
		shared:    sets.New[structured.SharedDeviceID](),
		capacity:  structured.NewConsumedCapacityCollection(),
	}
}

// add records an allocation's devices as the scheduler's allocated-devices
// tracker does: exclusive devices by ID, shared ones by share ID plus their
// consumed capacity; admin access uses nothing.
func (s *state) add(res *resourceapi.DeviceAllocationResult) {
	for _, r := range res.Results {
		if ptr.Deref(r.AdminAccess, false) {
			continue
		}
		id := structured.MakeDeviceID(r.Driver, r.Pool, r.Device)
		if r.ShareID != nil {
			s.shared.Insert(structured.MakeSharedDeviceID(id, r.ShareID))
			if r.ConsumedCapacity != nil {
				s.capacity.Insert(structured.NewDeviceConsumedCapacity(id, r.ConsumedCapacity))
			}
			continue
		}
		s.allocated.Insert(id)
	}
}

// snapshot hands the allocator the current state. The allocator only reads
// it during one Allocate, and a fresh allocator is made per attempt (it
// caches available counters), so no copy is needed.
func (s *state) snapshot() structured.AllocatedState {
	return structured.AllocatedState{
		AllocatedDevices:         s.allocated,
		AllocatedSharedDeviceIDs: s.shared,
		AggregatedCapacity:       s.capacity,
	}
}

// classLister is a structured.DeviceClassLister over a fixed list.
type classLister []*resourceapi.DeviceClass

func (l classLister) List() ([]*resourceapi.DeviceClass, error) { return l, nil }

func (l classLister) Get(name string) (*resourceapi.DeviceClass, error) {
	for _, c := range l {
		if c.Name == name {
			return c, nil
		}
	}
	return nil, apierrors.NewNotFound(resourceapi.Resource("deviceclasses"), name)
}
