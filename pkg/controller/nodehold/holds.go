// Package nodehold tells cluster autoscalers not to remove a node that holds
// gpudra devices in use. Karpenter's consolidation and Cluster Autoscaler's
// scale-down know nothing of ResourceClaims: a node whose GPUs are
// allocated to a held GpuReservation (claims no pod uses yet), to a gang
// whose gates are being lifted, to a pod being evicted or moved, or to the
// claims an MPS server serves, looks empty or movable to them. Both skip a
// node that carries their annotation (KarpenterDoNotDisrupt,
// ClusterAutoscalerScaleDownDisabled) set to "true"; the controller sets
// both on every node that holds gpudra devices in use, with its own Marker
// beside them, and removes what it set once the node holds nothing.
//
// holds.go is the pure part: which nodes hold devices in use, and why.
// marks.go: the annotation changes a node needs. controller.go: the
// informers, the rounds and the writes.
package nodehold

import (
	"fmt"
	"slices"
	"strings"

	resourceapi "k8s.io/api/resource/v1"

	"github.com/gpudra/gpudra/pkg/allocator"
)

// Hold is why a node holds gpudra devices in use: the claims (namespace/
// name, sorted) allocated devices there, and the claims planned there for a
// gang being admitted on the Workload API path (kube-scheduler has not
// written their allocations yet).
type Hold struct {
	Allocated []string
	Planned   []string
}

// reasonNames is how many claims a reason names; the rest are counted.
const reasonNames = 3

// Reason is the hold in a line, for the node's Marker annotation and the
// logs: how many claims, and the first few by name.
func (h *Hold) Reason() string {
	var parts []string
	if n := len(h.Allocated); n > 0 {
		parts = append(parts, fmt.Sprintf("%s allocated: %s", plural(n, "gpu.gpudra.dev claim"), names(h.Allocated)))
	}
	if n := len(h.Planned); n > 0 {
		parts = append(parts, fmt.Sprintf("%s planned for a gang being admitted: %s", plural(n, "claim"), names(h.Planned)))
	}
	return strings.Join(parts, "; ")
}

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

func names(keys []string) string {
	if len(keys) <= reasonNames {
		return strings.Join(keys, ", ")
	}
	return strings.Join(keys[:reasonNames], ", ") + fmt.Sprintf(", and %d more", len(keys)-reasonNames)
}

// NodesHeld says which nodes hold gpudra devices in use, and why. A claim
// holds the nodes of its allocation's gpu.gpudra.dev results: each node
// publishes its devices in a pool named after it (pkg/slicebuilder), so
// the pool is the node, and the allocation's nodeSelector (the same node,
// or none) adds nothing. That covers every claim gpudra devices are in
// use by: prepared claims, claims of pods being evicted or moved (allocated
// until the pod is gone), a held reservation's claims (allocated, no pod),
// a gang's claims on the gate path (written before its gates are lifted),
// and the claims an MPS server serves (it serves allocated claims only).
// Claims of other drivers, and results of other drivers in a claim, hold
// nothing.
//
// planned are the claims of gangs handed to kube-scheduler (gang.Controller
// HandedClaims), with their planned allocations: they hold their planned
// nodes until kube-scheduler allocates them, after which the allocation
// counts instead.
func NodesHeld(allocated, planned []*resourceapi.ResourceClaim) map[string]*Hold {
	holds := map[string]*Hold{}
	hold := func(node string) *Hold {
		h := holds[node]
		if h == nil {
			h = &Hold{}
			holds[node] = h
		}
		return h
	}
	isAllocated := map[string]bool{}
	for _, cl := range allocated {
		nodes := ClaimNodes(cl)
		if len(nodes) == 0 {
			continue
		}
		key := cl.Namespace + "/" + cl.Name
		isAllocated[key] = true
		for _, n := range nodes {
			h := hold(n)
			h.Allocated = append(h.Allocated, key)
		}
	}
	for _, cl := range planned {
		key := cl.Namespace + "/" + cl.Name
		if isAllocated[key] {
			continue
		}
		for _, n := range ClaimNodes(cl) {
			h := hold(n)
			if !slices.Contains(h.Planned, key) {
				h.Planned = append(h.Planned, key)
			}
		}
	}
	for _, h := range holds {
		slices.Sort(h.Allocated)
		slices.Sort(h.Planned)
	}
	return holds
}

// ClaimNodes are the nodes (pools) of a claim's gpu.gpudra.dev allocation
// results, each once, in order; none for a claim not allocated.
func ClaimNodes(cl *resourceapi.ResourceClaim) []string {
	if cl == nil || cl.Status.Allocation == nil {
		return nil
	}
	var nodes []string
	for _, r := range cl.Status.Allocation.Devices.Results {
		if r.Driver == allocator.DriverName && r.Pool != "" && !slices.Contains(nodes, r.Pool) {
			nodes = append(nodes, r.Pool)
		}
	}
	return nodes
}
