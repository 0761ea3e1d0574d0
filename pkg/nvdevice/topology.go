package nvdevice

import (
	"fmt"
	"strings"
)

// FabricInfo is what NVML's GetGpuFabricInfo reports for one GPU.
type FabricInfo struct {
	// ClusterUUID is all zeros on systems without multi-node NVLink (HGX H100).
	ClusterUUID [16]byte
	CliqueID    uint32
}

// Clique returns "<clusterUUID>.<cliqueId>", or "" when the cluster UUID is
// zero, which is how NVML says the GPU is not part of a multi-node fabric.
func (f FabricInfo) Clique() string {
	if f.ClusterUUID == [16]byte{} {
		return ""
	}
	u := f.ClusterUUID
	return fmt.Sprintf("%x-%x-%x-%x-%x.%d", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16], f.CliqueID)
}

// AssignNVLinkDomains fills NVLink.Domain and NVLink.FabricClique of every GPU
// from the links the GPUs report and their fabric info (keyed by GPU UUID;
// missing entries mean "no fabric").
//
// A multi-node fabric clique wins when the cluster UUID is non-zero.
// Otherwise GPUs whose active links reach a common NVSwitch, or each other,
// form one intra-node domain, "nvlink-<UUID of its lowest-index GPU>", a name
// stable across restarts and unique across nodes. A GPU
// without active links has no domain.
func AssignNVLinkDomains(gpus []GPU, fabric map[string]FabricInfo) {
	parent := map[string]string{}
	var find func(string) string
	find = func(x string) string {
		p, ok := parent[x]
		if !ok || p == x {
			parent[x] = x
			return x
		}
		r := find(p)
		parent[x] = r
		return r
	}
	union := func(a, b string) {
		ra, rb := find(a), find(b)
		if ra != rb {
			parent[ra] = rb
		}
	}
	key := func(busID string) string { return strings.ToLower(busID) }

	for _, g := range gpus {
		for _, l := range g.NVLink.Links {
			if l.Active && l.RemoteBusID != "" {
				union(key(g.PCI.BusID), key(l.RemoteBusID))
			}
		}
	}
	// Name each component after its lowest-index GPU.
	anchor := map[string]GPU{}
	for _, g := range gpus {
		if g.NVLink.ActiveLinks() == 0 {
			continue
		}
		root := find(key(g.PCI.BusID))
		if a, ok := anchor[root]; !ok || g.Index < a.Index {
			anchor[root] = g
		}
	}
	for i := range gpus {
		g := &gpus[i]
		g.NVLink.Domain, g.NVLink.FabricClique = "", ""
		if clique := fabric[g.UUID].Clique(); clique != "" {
			g.NVLink.FabricClique = clique
			g.NVLink.Domain = clique
			continue
		}
		if g.NVLink.ActiveLinks() == 0 {
			continue
		}
		g.NVLink.Domain = "nvlink-" + strings.TrimPrefix(anchor[find(key(g.PCI.BusID))].UUID, "GPU-")
	}
}
