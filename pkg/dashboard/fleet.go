package dashboard

import (
	"cmp"
	"fmt"
	"slices"
	"sort"
	"strings"

	"github.com/gpudra/gpudra/pkg/slicebuilder"
	"github.com/gpudra/gpudra/pkg/top"
)

// The View's top level from the settled GPUs: nodes grouped by NVLink
// domain with the summary, the filter menus, and the usage notes.

// domains groups the nodes by the NVLink domain most of their GPUs are in.
func (b *builder) domains(v *View) []Domain {
	byDomain := map[string][]Node{}
	names := make([]string, 0, len(b.nodes))
	for name := range b.nodes {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		n := b.nodes[name]
		var devs map[string]*top.Device
		snap := b.in.Usage[name]
		if snap != nil {
			devs = make(map[string]*top.Device, len(snap.Devices))
			for i := range snap.Devices {
				devs[snap.Devices[i].Name] = &snap.Devices[i]
			}
		}
		node := Node{Name: name, Mode: n.mode, Kubectl: kubectlNodeSlices(name)}
		if snap != nil {
			node.UsageSource = b.in.UsageSource
		}
		votes := map[string]int{}
		node.GPUs = make([]GPU, 0, len(n.gpus))
		for _, g := range n.gpus {
			gpu := b.finish(name, g, devs)
			node.GPUs = append(node.GPUs, gpu)
			if g.domain != "" {
				votes[g.domain]++
			}
			v.Summary.GPUs++
			switch {
			case gpu.State == StateUnhealthy:
				v.Summary.Unhealthy++
			case gpu.State == StateFree:
				v.Summary.Free++
			case gpu.State == StateUnknown:
				v.Summary.Unknown++
			}
			if len(gpu.Holders) > 0 || slices.ContainsFunc(gpu.Placements, func(p Placement) bool { return len(p.Holders) > 0 }) {
				v.Summary.Allocated++
			}
			if gpu.IdleClaimed {
				v.Summary.IdleClaimed++
			}
		}
		slices.SortFunc(node.GPUs, func(a, b GPU) int {
			return cmp.Or(cmp.Compare(slicebuilder.GPUMinor(a.Name), slicebuilder.GPUMinor(b.Name)), cmp.Compare(a.Name, b.Name))
		})
		domain := ""
		for d, n := range votes {
			if n > votes[domain] || (n == votes[domain] && d < domain) {
				domain = d
			}
		}
		byDomain[domain] = append(byDomain[domain], node)
		v.Summary.Nodes++
	}
	out := make([]Domain, 0, len(byDomain))
	for name, nodes := range byDomain {
		out = append(out, Domain{Name: name, Nodes: nodes})
	}
	slices.SortFunc(out, func(a, b Domain) int {
		if (a.Name == "") != (b.Name == "") {
			if a.Name == "" {
				return 1
			}
			return -1
		}
		return cmp.Compare(a.Name, b.Name)
	})
	return out
}

func (b *builder) filters(v *View) Filters {
	f := Filters{States: []string{StateFree, StatePartial, StateAllocated, StateBlocked, StateUnhealthy}}
	if v.Summary.Unknown > 0 {
		f.States = append(f.States, StateUnknown)
	}
	classes := map[string]bool{}
	for _, d := range v.Domains {
		for _, n := range d.Nodes {
			f.Nodes = append(f.Nodes, n.Name)
			for _, g := range n.GPUs {
				for _, c := range g.Classes {
					classes[c] = true
				}
			}
		}
	}
	slices.Sort(f.Nodes)
	for c := range classes {
		f.Classes = append(f.Classes, c)
	}
	slices.Sort(f.Classes)
	for ns := range b.namespaces {
		f.Namespaces = append(f.Namespaces, ns)
	}
	slices.Sort(f.Namespaces)
	return f
}

// usageNotes are the nodes' usage notes, each text once with the nodes
// that said it: a thousand plugins without attribution make one note.
func usageNotes(usage map[string]*top.Snapshot) []string {
	byText := map[string][]string{}
	for node, s := range usage {
		if s == nil {
			continue
		}
		for _, n := range s.Notes {
			byText[n] = append(byText[n], node)
		}
	}
	out := make([]string, 0, len(byText))
	for text, nodes := range byText {
		slices.Sort(nodes)
		switch {
		case len(nodes) == 1:
			out = append(out, nodes[0]+": "+text)
		case len(nodes) <= 3:
			out = append(out, strings.Join(nodes, ", ")+": "+text)
		default:
			out = append(out, fmt.Sprintf("%d nodes (%s, ...): %s", len(nodes), strings.Join(nodes[:3], ", "), text))
		}
	}
	slices.Sort(out)
	return out
}
