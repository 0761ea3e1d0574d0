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

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
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
	// Claims that already have an allocation are rejected, and so is a
	// claim given twice (in Claims or Groups).
	Claims []*resourceapi.ResourceClaim
	// Groups are claims that must land on one node together: the claims
	// of one pod, or of pods that share a claim. They are planned with
	// Claims, all or nothing.
	Groups []Group
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

// Group is a set of claims planned onto one node.
type Group struct {
	// Name says what the group is in errors (a pod's name).
	Name   string
	Claims []*resourceapi.ResourceClaim
	// Nodes, when not nil, are the only nodes the group may use (a pod's
	// node selector, or the node of a claim it already has).
	Nodes sets.Set[string]
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
// input order (Claims, then each group's claims), and the nodes chosen.
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
	if len(in.Claims) == 0 && len(in.Groups) == 0 {
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
	units, err := unitsOf(in)
	if err != nil {
		return Result{}, err
	}

	state := newState()
	for _, c := range in.Allocated {
		if c.Status.Allocation != nil {
			state.add(&c.Status.Allocation.Devices)
		}
	}
	nodes, shared := groupSlices(in)
	deviceDomain := map[structured.DeviceID]string{}
	byPool := allocatedByPool(state)
	for _, n := range nodes {
		n.count(byPool, deviceDomain)
	}
	classes := classLister(in.Classes)

	// First-fit decreasing: the biggest units pick first.
	var total int64
	for _, u := range units {
		total += u.demand
	}
	slices.SortStableFunc(units, func(a, b *unit) int { return cmp.Compare(b.demand, a.demand) })

	var preferred map[string]int // node -> rank, FewestNVLinkDomains
	if strategy == FewestNVLinkDomains {
		preferred = chooseDomains(nodes, total)
	}

	var out Result
	for _, u := range units {
		eligible := nodes
		if u.nodes != nil {
			eligible = slices.DeleteFunc(slices.Clone(nodes), func(n *nodeInfo) bool { return !u.nodes.Has(n.name()) })
		}
		candidates := rank(eligible, strategy, preferred, maxTried, u.demand)
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
				return Result{}, fmt.Errorf("%s: %w", u.name, err)
			}
			results, err := alloc.Allocate(ctx, n.node, u.claims)
			if err != nil {
				if errors.Is(err, structured.ErrFailedAllocationOnNode) {
					continue
				}
				return Result{}, fmt.Errorf("%s on node %s: %w", u.name, n.name(), err)
			}
			if len(results) != len(u.claims) {
				continue
			}
			for j, res := range results {
				state.add(&res.Devices)
				for _, r := range res.Devices.Results {
					id := structured.MakeDeviceID(r.Driver, r.Pool, r.Device)
					if d, ok := deviceDomain[id]; ok && r.ShareID == nil {
						if n.domains[d] > 0 {
							n.domains[d]--
							n.free--
						}
					}
				}
				u.results[j] = ClaimAllocation{Claim: u.claims[j], Node: n.name(), Result: res}
			}
			placed = true
			break
		}
		if !placed {
			where := fmt.Sprintf("tried %d of %d nodes", len(candidates), len(nodes))
			if u.nodes != nil {
				where = fmt.Sprintf("tried %d of the %d nodes it may use", len(candidates), len(eligible))
			}
			return Result{}, &NotFitError{Unit: u.name, Devices: u.demand,
				msg: fmt.Sprintf("%s (%d devices) does not fit: %s with strategy %s; nothing allocated", u.name, u.demand, where, strategy)}
		}
	}
	// Results in input order.
	slices.SortFunc(units, func(a, b *unit) int { return cmp.Compare(a.index, b.index) })
	for _, u := range units {
		out.Allocations = append(out.Allocations, u.results...)
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

// NotFitError says that a claim or group did not fit anywhere: the plan
// failed for want of devices, not because the input is wrong.
type NotFitError struct {
	// Unit names the claim or group.
	Unit    string
	Devices int64
	msg     string
}

func (e *NotFitError) Error() string { return e.msg }

// unit is a claim or a group, planned onto one node.
type unit struct {
	index   int
	name    string
	claims  []*resourceapi.ResourceClaim
	nodes   sets.Set[string]
	demand  int64
	results []ClaimAllocation
}

// unitsOf turns Claims and Groups into units in input order, refusing
// allocated and repeated claims.
func unitsOf(in Input) ([]*unit, error) {
	var units []*unit
	seen := sets.New[string]()
	add := func(name string, claims []*resourceapi.ResourceClaim, nodes sets.Set[string]) error {
		u := &unit{index: len(units), name: name, claims: claims, nodes: nodes, results: make([]ClaimAllocation, len(claims))}
		for _, c := range claims {
			key := claimName(c)
			if c.Status.Allocation != nil {
				return fmt.Errorf("claim %s is already allocated", key)
			}
			if seen.Has(key) {
				return fmt.Errorf("claim %s is given twice; claims shared by pods belong in one group", key)
			}
			seen.Insert(key)
			u.demand += ClaimDemand(c)
		}
		units = append(units, u)
		return nil
	}
	for _, c := range in.Claims {
		if err := add("claim "+claimName(c), []*resourceapi.ResourceClaim{c}, nil); err != nil {
			return nil, err
		}
	}
	for _, g := range in.Groups {
		if len(g.Claims) == 0 {
			continue
		}
		name := g.Name
		if name == "" {
			name = "group of claim " + claimName(g.Claims[0])
		}
		if err := add(name, g.Claims, g.Nodes); err != nil {
			return nil, err
		}
	}
	return units, nil
}

func claimName(c *resourceapi.ResourceClaim) string {
	if c.Namespace == "" {
		return c.Name
	}
	return c.Namespace + "/" + c.Name
}

// ClaimDemand estimates how many devices a claim asks for: the count of
// each exact request (the first alternative of a firstAvailable list), 1
// for a request for all devices.
func ClaimDemand(c *resourceapi.ResourceClaim) int64 {
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

// StringAttribute reads a string attribute of gpudra's driver, named with
// or without the driver's domain; "" when it has none.
func StringAttribute(d resourceapi.Device, name string) string {
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
