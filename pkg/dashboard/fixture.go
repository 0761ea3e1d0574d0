package dashboard

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"time"
)

// fixtureEpoch is the fixture's clock: a fixed time, so that a seed gives
// the same View byte for byte.
var fixtureEpoch = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

// h100Placements are an H100 80GB's MIG profiles at every placement the
// driver allows (start and size in memory slices), as the plugin publishes
// them: the page must draw them all, free, allocated or blocked.
var h100Placements = []struct {
	profile     string
	start, size int
}{
	{"7g.80gb", 0, 8},
	{"4g.40gb", 0, 4},
	{"3g.40gb", 0, 4}, {"3g.40gb", 4, 4},
	{"2g.20gb", 0, 2}, {"2g.20gb", 2, 2}, {"2g.20gb", 4, 2},
	{"1g.20gb", 0, 2}, {"1g.20gb", 2, 2}, {"1g.20gb", 4, 2}, {"1g.20gb", 6, 2},
	{"1g.10gb", 0, 1}, {"1g.10gb", 1, 1}, {"1g.10gb", 2, 1}, {"1g.10gb", 3, 1},
	{"1g.10gb", 4, 1}, {"1g.10gb", 5, 1}, {"1g.10gb", 6, 1},
}

// migLayouts are the allocated placements (indexes into h100Placements) a
// MIG GPU of the fixture may have; the first is none.
var migLayouts = [][]int{{}, {2, 6}, {3, 11, 12}, {4, 5, 15, 16}, {1}}

var fixtureNamespaces = []string{"inference", "ml-research", "team-vision", "training"}

const fixtureMemory = 80 * 1024 * 1024 * 1024

// FixtureView is a made-up fleet of nodes x gpusPerNode H100s, the same for
// the same seed: NVLink domains of 16 nodes (the last nodes in none),
// whole-GPU claims with pods, MIG GPUs with allocated and blocked
// placements, unhealthy and idle-but-claimed GPUs, usage with sparklines
// (some nodes unread), queues with gangs, reservations and a pending pod,
// and six hours of allocation. Tests and the first-paint benchmark draw it.
func FixtureView(nodes, gpusPerNode int, seed int64) *View {
	rng := rand.New(rand.NewPCG(uint64(seed), 37))
	v := &View{
		At:      fixtureEpoch,
		Mode:    "cluster",
		Context: "fixture (admin)",
		Filters: Filters{
			Classes:    []string{"gpu.gpudra.dev", "mig.gpudra.dev"},
			Namespaces: slices.Clone(fixtureNamespaces),
			States:     []string{StateFree, StateAllocated, StatePartial, StateUnhealthy},
		},
	}
	claims := 0
	var domain *Domain
	for n := range nodes {
		name := fmt.Sprintf("node-%04d", n)
		domainName := fmt.Sprintf("nvl-%02d", n/16)
		if n >= nodes-nodes/10 {
			// The last tenth have no NVLink: last, as Build orders them.
			domainName = ""
		}
		if domain == nil || domain.Name != domainName {
			v.Domains = append(v.Domains, Domain{Name: domainName})
			domain = &v.Domains[len(v.Domains)-1]
		}
		node := Node{
			Name:    name,
			Mode:    "dra",
			Kubectl: "kubectl get resourceslices --field-selector spec.nodeName=" + name,
		}
		readUsage := n%7 != 6
		if readUsage {
			node.UsageSource = "plugin"
		}
		for i := range gpusPerNode {
			g := fixtureGPU(rng, n, i, &claims, readUsage)
			v.Summary.GPUs++
			switch g.State {
			case StateAllocated, StatePartial:
				v.Summary.Allocated++
			case StateFree:
				v.Summary.Free++
			case StateUnhealthy:
				v.Summary.Unhealthy++
			}
			if g.IdleClaimed {
				v.Summary.IdleClaimed++
			}
			node.GPUs = append(node.GPUs, g)
		}
		domain.Nodes = append(domain.Nodes, node)
		v.Filters.Nodes = append(v.Filters.Nodes, name)
		v.Summary.Nodes++
	}
	v.Queues = fixtureQueues(&v.Summary)
	v.Allocation = fixtureAllocation(rng)
	return v
}

func fixtureGPU(rng *rand.Rand, node, index int, claims *int, readUsage bool) GPU {
	g := GPU{
		Name:        fmt.Sprintf("gpu-%d", index),
		UUID:        fmt.Sprintf("GPU-%08x-%04x-4%03x-8000-%012x", node, index, node%4096, uint64(node)<<8|uint64(index)),
		Model:       "NVIDIA H100 80GB HBM3",
		MemoryBytes: fixtureMemory,
		State:       StateFree,
		Classes:     []string{"gpu.gpudra.dev"},
	}
	roll := rng.IntN(100)
	switch {
	case roll < 3:
		g.State = StateUnhealthy
		g.Health = "gpu.gpudra.dev/xid=79: GPU has fallen off the bus"
	case roll < 18:
		fixtureMIG(rng, &g, node, claims)
	case roll < 63:
		g.State = StateAllocated
		g.Holders = []Holder{fixtureHolder(rng, claims, 1+rng.IntN(2))}
	}
	if !readUsage {
		return g
	}
	idle := g.State == StateAllocated && rng.IntN(6) == 0
	var util float64
	switch {
	case g.State == StateAllocated && !idle, g.State == StatePartial:
		util = float64(20 + rng.IntN(80))
	}
	used := 0.6e9
	if g.State == StateAllocated || g.State == StatePartial {
		used = float64(10+rng.IntN(65)) * 1e9
	}
	total := float64(fixtureMemory)
	u := &Usage{Utilization: &util, MemoryUsedBytes: &used, MemoryTotalBytes: &total}
	for i := range SparkPoints {
		var p *float64
		if i != 3 || node%5 != 0 { // one missed read on some nodes
			x := max(0, min(100, util+float64(rng.IntN(30))-15))
			if util == 0 {
				x = 0
			}
			p = &x
		}
		u.Spark = append(u.Spark, p)
	}
	g.Usage = u
	g.IdleClaimed = idle
	return g
}

// fixtureMIG makes g a MIG GPU with one of migLayouts allocated; the
// placements that overlap an allocated one are blocked.
func fixtureMIG(rng *rand.Rand, g *GPU, node int, claims *int) {
	g.MIG = true
	g.MemorySlices = 8
	g.Classes = []string{"mig.gpudra.dev"}
	layout := migLayouts[rng.IntN(len(migLayouts))]
	for i, p := range h100Placements {
		pl := Placement{
			Name:    fmt.Sprintf("%s-mig-%s-%d", g.Name, p.profile, p.start),
			Profile: p.profile,
			Start:   p.start,
			Size:    p.size,
			State:   StateFree,
		}
		if slices.Contains(layout, i) {
			pl.State = StateAllocated
			pl.Holders = []Holder{fixtureHolder(rng, claims, 1)}
			util := float64(rng.IntN(100))
			pl.Usage = &Usage{Utilization: &util}
		}
		g.Placements = append(g.Placements, pl)
	}
	for i := range g.Placements {
		p := &g.Placements[i]
		if p.State != StateFree {
			continue
		}
		for _, j := range layout {
			a := h100Placements[j]
			if p.Start < a.start+a.size && a.start < p.Start+p.Size {
				p.State = StateBlocked
				break
			}
		}
	}
	if len(layout) > 0 {
		g.State = StatePartial
	}
}

func fixtureHolder(rng *rand.Rand, claims *int, pods int) Holder {
	*claims++
	ns := fixtureNamespaces[rng.IntN(len(fixtureNamespaces))]
	h := Holder{
		Namespace: ns,
		Claim:     fmt.Sprintf("job-%05d-gpu", *claims),
		Kubectl:   fmt.Sprintf("kubectl get resourceclaim -n %s job-%05d-gpu -o yaml", ns, *claims),
	}
	for p := range pods {
		h.Pods = append(h.Pods, fmt.Sprintf("job-%05d-worker-%d", *claims, p))
	}
	if *claims%9 == 0 {
		h.Gang = fmt.Sprintf("job-%05d", *claims)
	}
	if *claims%13 == 0 {
		h.Reservation = fmt.Sprintf("res-%05d", *claims)
	}
	return h
}

func fixtureQueues(s *Summary) []Queue {
	at := func(d time.Duration) *time.Time { t := fixtureEpoch.Add(d); return &t }
	queues := []Queue{
		{Name: "", Policy: "FCFS", Items: []QueueItem{{
			Kind: "Pod", Namespace: "team-vision", Name: "eval-7d9f", Devices: 1,
			Reason: "Unschedulable", Message: "0/1000 nodes are available: 1000 cannot allocate all claims.",
			Since: at(-3 * time.Minute), Kubectl: "kubectl describe pod -n team-vision eval-7d9f",
		}}},
		{Name: "default", Policy: "FCFS", Exists: true, Kubectl: "kubectl get gpuqueue default -o yaml", Items: []QueueItem{
			{Kind: "Gang", Namespace: "training", Name: "llama-ft", Position: 1, Devices: 64, Reason: "Queued",
				Message: "position 1 in queue default: waiting for 64 GPUs in one NVLink domain", Since: at(-42 * time.Minute),
				Duration: "2h", EstimatedStart: at(0), Kubectl: "kubectl get pods -n training -l gpudra.dev/gang=llama-ft"},
			{Kind: "GpuReservation", Namespace: "ml-research", Name: "sweep-a", Position: 2, Devices: 8, Reason: "Queued",
				Message: "behind 1 item", Since: at(-30 * time.Minute), Duration: "30m", EstimatedStart: at(2 * time.Hour),
				Kubectl: "kubectl get gpureservation -n ml-research sweep-a -o yaml"},
			{Kind: "Gang", Namespace: "inference", Name: "bench-b", Position: 3, Devices: 16, Reason: "Queued",
				Message: "position 3 in queue default: behind 2 items", Since: at(-5 * time.Minute),
				Kubectl: "kubectl get pods -n inference -l gpudra.dev/gang=bench-b"},
		}},
		{Name: "research", Policy: "Priority", Exists: true, Kubectl: "kubectl get gpuqueue research -o yaml"},
	}
	for _, q := range queues {
		s.Waiting += len(q.Items)
	}
	return queues
}

func fixtureAllocation(rng *rand.Rand) Allocation {
	const step = 5 * time.Minute
	a := Allocation{Source: "seen", StepSeconds: int(step.Seconds())}
	for i, owner := range fixtureNamespaces {
		s := AllocationSeries{Owner: owner}
		level := float64(20 + 15*i)
		for p := range 72 {
			level = max(0, level+float64(rng.IntN(9)-4))
			used := float64(int(level * (0.5 + 0.4*rng.Float64())))
			s.Points = append(s.Points, AllocationPoint{
				At:        fixtureEpoch.Add(-time.Duration(71-p) * step),
				Allocated: level,
				Used:      &used,
			})
		}
		a.Series = append(a.Series, s)
	}
	return a
}
