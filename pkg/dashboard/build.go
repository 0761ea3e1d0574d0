package dashboard

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/cel"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
	"github.com/gpudra/gpudra/pkg/top"
)

// ClusterInputs is everything Build needs, as plain objects: what the
// informers hold, the last usage reads, and the history the source keeps.
// A nil list is "not read" only where Notes say so: Build cannot tell an
// empty cluster from a forbidden resource, the source can.
type ClusterInputs struct {
	Now time.Time
	// Context names the kubeconfig context and user.
	Context       string
	Nodes         []*corev1.Node
	Slices        []*resourceapi.ResourceSlice
	Claims        []*resourceapi.ResourceClaim
	Pods          []*corev1.Pod
	DeviceClasses []*resourceapi.DeviceClass
	Queues        []*gpudrav1.GpuQueue
	Reservations  []*gpudrav1.GpuReservation
	// Usage is the last usage read per node name; UsageSource says what
	// read it ("plugin", "prometheus").
	Usage       map[string]*top.Snapshot
	UsageSource string
	// Spark is each device's recent utilization, by SparkKey(node,
	// device), oldest first (History.Sparks).
	Spark map[string][]*float64
	// Allocation is the allocation over time (from Prometheus, or what
	// the source saw); nil: none yet.
	Allocation *Allocation
	// ClaimsPartial: the claims were read in some namespaces only (or not
	// at all), so a device with no holder in Claims may still be held.
	ClaimsPartial bool
	// Workloads are KubeRay's and Kueue's objects, where served and read.
	Workloads WorkloadInputs
	// Notes say what the source could not read.
	Notes []string
}

// SparkKey is a device's key in ClusterInputs.Spark.
func SparkKey(node, device string) string { return node + "/" + device }

// DevicePluginResource is the extended resource the chart's device plugin
// mode advertises by default: a node that has it and no slices runs the
// device plugin.
const DevicePluginResource corev1.ResourceName = "nvidia.com/gpu"

// Build is the View of a cluster. It is a pure function of in (the
// DeviceClass selectors it evaluates are compiled once per expression and
// cached), so that the source rebuilds after any change without
// remembering what changed.
func Build(in ClusterInputs) *View {
	b := &builder{in: in, nodes: map[string]*nodeAcc{}, pods: make(map[string]*corev1.Pod, len(in.Pods)),
		claims: make(map[string]*resourceapi.ResourceClaim, len(in.Claims))}
	for _, p := range in.Pods {
		b.pods[p.Namespace+"/"+p.Name] = p
	}
	for _, c := range in.Claims {
		b.claims[c.Namespace+"/"+c.Name] = c
	}
	b.classes = newClassMatcher(in.DeviceClasses)
	b.addSlices()
	b.addClaims()
	b.addDevicePluginNodes()
	v := &View{Mode: "cluster", At: in.Now, Context: in.Context}
	v.Domains = b.domains(v)
	v.Queues = b.queues(v)
	v.Workloads = workloads(in.Workloads, in.Pods, b.claims)
	for _, w := range v.Workloads {
		b.seeNamespace(w.Namespace)
	}
	if in.Allocation != nil {
		v.Allocation = *in.Allocation
	} else {
		v.Allocation = Allocation{Source: "seen"}
	}
	v.Filters = b.filters(v)
	v.Notes = append(append([]string(nil), in.Notes...), usageNotes(in.Usage)...)
	return v
}

type builder struct {
	in      ClusterInputs
	nodes   map[string]*nodeAcc
	pods    map[string]*corev1.Pod
	claims  map[string]*resourceapi.ResourceClaim
	classes *classMatcher
	// namespaces seen on holders and waiting items, for the filter menu.
	namespaces map[string]bool
}

// nodeAcc gathers one node's GPUs while the slices and claims are read.
type nodeAcc struct {
	name   string
	mode   string
	gpus   map[string]*gpuAcc // by device name (gpu-0)
	byUUID map[string]*gpuAcc
}

type gpuAcc struct {
	gpu GPU
	// domain is the GPU's nvlinkDomain attribute.
	domain string
	// placements by device name.
	placements map[string]*Placement
	classes    []string
	// unhealthy: a NoSchedule or NoExecute taint on the GPU or one of its
	// MIG devices.
	unhealthy bool
	// noClaims: a device-plugin node's GPU, known only from its usage read:
	// the kubelet's device assignments are in no API object, so with no
	// process on it nothing says whether it is free.
	noClaims bool
}

func (b *builder) node(name string) *nodeAcc {
	n := b.nodes[name]
	if n == nil {
		n = &nodeAcc{name: name, gpus: map[string]*gpuAcc{}, byUUID: map[string]*gpuAcc{}}
		b.nodes[name] = n
	}
	return n
}

func (n *nodeAcc) gpu(name string) *gpuAcc {
	g := n.gpus[name]
	if g == nil {
		g = &gpuAcc{gpu: GPU{Name: name}, placements: map[string]*Placement{}}
		n.gpus[name] = g
	}
	return g
}

// poolNode is the node a pool's devices are on: gpudra names its pool
// after its node.
func sliceNode(s *resourceapi.ResourceSlice) string {
	if s.Spec.NodeName != nil && *s.Spec.NodeName != "" {
		return *s.Spec.NodeName
	}
	return s.Spec.Pool.Name
}

func attrString(d *resourceapi.Device, name resourceapi.QualifiedName) string {
	if a, ok := d.Attributes[name]; ok && a.StringValue != nil {
		return *a.StringValue
	}
	return ""
}

// addSlices reads gpudra's devices from the current generation of each
// pool: whole GPUs first, so that MIG devices find their parent by UUID.
func (b *builder) addSlices() {
	gen := map[string]int64{}
	for _, s := range b.in.Slices {
		if s.Spec.Driver == slicebuilder.DriverName {
			gen[s.Spec.Pool.Name] = max(gen[s.Spec.Pool.Name], s.Spec.Pool.Generation)
		}
	}
	current := func(s *resourceapi.ResourceSlice) bool {
		return s.Spec.Driver == slicebuilder.DriverName && s.Spec.Pool.Generation == gen[s.Spec.Pool.Name]
	}
	for _, s := range b.in.Slices {
		if !current(s) {
			continue
		}
		n := b.node(sliceNode(s))
		n.mode = "dra"
		for i := range s.Spec.Devices {
			d := &s.Spec.Devices[i]
			if attrString(d, "type") != slicebuilder.TypeMIG {
				b.addGPUDevice(n, d)
			}
		}
	}
	for _, s := range b.in.Slices {
		if !current(s) {
			continue
		}
		n := b.node(sliceNode(s))
		for i := range s.Spec.Devices {
			d := &s.Spec.Devices[i]
			if attrString(d, "type") == slicebuilder.TypeMIG {
				b.addMIGDevice(n, d)
			}
		}
	}
}

func (b *builder) addGPUDevice(n *nodeAcc, d *resourceapi.Device) {
	g := n.gpu(d.Name)
	g.gpu.UUID = attrString(d, "uuid")
	if g.gpu.UUID != "" {
		n.byUUID[g.gpu.UUID] = g
	}
	g.gpu.Model = attrString(d, "productName")
	if c, ok := d.Capacity[slicebuilder.CapacityMemory]; ok {
		g.gpu.MemoryBytes = c.Value.Value()
	}
	if a, ok := d.Attributes["migEnabled"]; ok && a.BoolValue != nil && *a.BoolValue {
		g.gpu.MIG = true
	}
	g.domain = attrString(d, "nvlinkDomain")
	b.taints(g, d.Taints)
	b.addClasses(g, d)
}

func (b *builder) addMIGDevice(n *nodeAcc, d *resourceapi.Device) {
	g := n.byUUID[attrString(d, "parentUUID")]
	if g == nil {
		// The whole GPU is not published (someone else's MIG devices on
		// it, or only existing ones offered): the card still shows.
		g = n.gpu(parentName(d.Name))
		if u := attrString(d, "parentUUID"); u != "" && g.gpu.UUID == "" {
			g.gpu.UUID = u
			n.byUUID[u] = g
		}
		if g.gpu.Model == "" {
			g.gpu.Model = attrString(d, "productName")
		}
	}
	g.gpu.MIG = true
	p := g.placement(d.Name)
	p.Profile = attrString(d, "migProfile")
	var mem int64
	if c, ok := d.Capacity[slicebuilder.CapacityMemory]; ok {
		mem = c.Value.Value()
	}
	p.Start, p.Size = placementOf(d, g.gpu.MemoryBytes, mem)
	b.taints(g, d.Taints)
	b.addClasses(g, d)
}

func (g *gpuAcc) placement(name string) *Placement {
	p := g.placements[name]
	if p == nil {
		p = &Placement{Name: name}
		g.placements[name] = p
	}
	return p
}

// taints marks a GPU unhealthy from a taint that keeps pods off.
func (b *builder) taints(g *gpuAcc, taints []resourceapi.DeviceTaint) {
	for _, t := range taints {
		if t.Effect != resourceapi.DeviceTaintEffectNoSchedule && t.Effect != resourceapi.DeviceTaintEffectNoExecute {
			continue
		}
		g.unhealthy = true
		if g.gpu.Health == "" {
			g.gpu.Health = t.Key
			if t.Value != "" {
				g.gpu.Health += "=" + t.Value
			}
		}
	}
}

func (b *builder) addClasses(g *gpuAcc, d *resourceapi.Device) {
	for _, c := range b.classes.match(d) {
		if !slices.Contains(g.classes, c) {
			g.classes = append(g.classes, c)
		}
	}
}

// claimRef is one claim's hold on one device.
type claimRef struct {
	claim  *resourceapi.ResourceClaim
	shared bool
}

// addClaims attaches each allocated claim to its devices, making the
// devices the slices did not show (slices forbidden, a node gone).
func (b *builder) addClaims() {
	for _, c := range b.in.Claims {
		if c.Status.Allocation == nil {
			continue
		}
		results := c.Status.Allocation.Devices.Results
		for i, r := range results {
			// A claim with two results on one device (two shares) holds it once.
			if r.Driver != slicebuilder.DriverName || slices.ContainsFunc(results[:i], func(o resourceapi.DeviceRequestAllocationResult) bool {
				return o.Pool == r.Pool && o.Device == r.Device && o.Driver == r.Driver
			}) {
				continue
			}
			shared := r.ShareID != nil || (r.AdminAccess != nil && *r.AdminAccess)
			b.attach(b.node(r.Pool), r.Device, b.holder(claimRef{claim: c, shared: shared}))
		}
	}
}

// attach puts a holder on a device by name (a GPU, or a MIG device on its
// GPU), making the device when nothing else showed it.
func (b *builder) attach(n *nodeAcc, device string, h Holder) {
	if strings.Contains(device, "-mig-") {
		g := n.gpu(parentName(device))
		g.gpu.MIG = true
		p, known := g.placements[device]
		if !known {
			// Seen only through the claim: its geometry from its name.
			p = g.placement(device)
			label := strings.TrimSuffix(device[len(parentName(device))+len("-mig-"):], fmt.Sprintf("-%d", nameStart(device)))
			p.Profile = strings.Replace(label, "-", ".", 1) // 3g-40gb -> 3g.40gb
			p.Start, p.Size = nameStart(device), computeSlices(label)
		}
		p.Holders = append(p.Holders, h)
		return
	}
	g := n.gpu(device)
	g.gpu.Holders = append(g.gpu.Holders, h)
}

func (b *builder) holder(ref claimRef) Holder {
	c := ref.claim
	h := Holder{Namespace: c.Namespace, Claim: c.Name, Shared: ref.shared, Reservation: c.Labels[gpudrav1.LabelReservation],
		Kubectl: kubectlClaim(c.Namespace, c.Name)}
	for _, r := range c.Status.ReservedFor {
		if r.Resource != "pods" || r.APIGroup != "" {
			continue
		}
		h.Pods = append(h.Pods, r.Name)
		if p := b.pods[c.Namespace+"/"+r.Name]; p != nil && h.Gang == "" {
			h.Gang = p.Labels[gpudrav1.LabelGang]
		}
	}
	slices.Sort(h.Pods)
	b.seeNamespace(c.Namespace)
	return h
}

func (b *builder) seeNamespace(ns string) {
	if ns == "" {
		return
	}
	if b.namespaces == nil {
		b.namespaces = map[string]bool{}
	}
	b.namespaces[ns] = true
}

// addDevicePluginNodes shows the nodes that run the device plugin (the
// extended resource, no slices), with the GPUs their usage read lists.
func (b *builder) addDevicePluginNodes() {
	for _, node := range b.in.Nodes {
		if _, dra := b.nodes[node.Name]; dra {
			continue
		}
		if q, ok := node.Status.Allocatable[DevicePluginResource]; !ok || q.IsZero() {
			continue
		}
		n := b.node(node.Name)
		n.mode = "device-plugin"
		snap := b.in.Usage[node.Name]
		if snap == nil {
			continue
		}
		for _, d := range snap.Devices {
			if d.GPU != "" {
				continue // a MIG device: drawn from its GPU's usage only
			}
			g := n.gpu(d.Name)
			g.gpu.UUID, g.gpu.Model = d.UUID, d.Model
			g.noClaims = true
			for _, h := range d.Holders {
				var pods []string
				for _, p := range h.Pods {
					// namespace/pod/container
					parts := strings.SplitN(p, "/", 3)
					if len(parts) >= 2 {
						pods = append(pods, parts[1])
						b.seeNamespace(parts[0])
					}
				}
				g.gpu.Holders = append(g.gpu.Holders, Holder{Namespace: namespaceOfPods(h.Pods), Pods: pods})
			}
		}
	}
}

func namespaceOfPods(pods []string) string {
	if len(pods) == 0 {
		return ""
	}
	ns, _, _ := strings.Cut(pods[0], "/")
	return ns
}

// finish settles a GPU's states (its own, its placements') from its
// holders, and attaches its usage.
func (b *builder) finish(node string, g *gpuAcc, snap map[string]*top.Device) GPU {
	out := g.gpu
	out.Classes = g.classes
	slices.Sort(out.Classes)
	// Two claims on one device share it (each claim holds a device once).
	if len(out.Holders) > 1 {
		for i := range out.Holders {
			out.Holders[i].Shared = true
		}
	}
	slices.SortFunc(out.Holders, compareHolders)
	whole := len(out.Holders) > 0
	var held []Placement
	for _, p := range g.placements {
		slices.SortFunc(p.Holders, compareHolders)
		if len(p.Holders) > 1 {
			for i := range p.Holders {
				p.Holders[i].Shared = true
			}
		}
		if len(p.Holders) > 0 {
			held = append(held, *p)
		}
	}
	out.Placements = make([]Placement, 0, len(g.placements))
	for _, p := range g.placements {
		q := *p
		switch {
		case len(q.Holders) > 0:
			q.State = StateAllocated
		case whole || overlapsAny(q, held):
			q.State = StateBlocked
		case b.in.ClaimsPartial:
			q.State = StateUnknown
		default:
			q.State = StateFree
		}
		q.Usage = b.usage(node, q.Name, snap)
		out.Placements = append(out.Placements, q)
	}
	slices.SortFunc(out.Placements, func(a, b Placement) int {
		return cmp.Or(cmp.Compare(a.Start, b.Start), cmp.Compare(b.Size, a.Size), cmp.Compare(a.Name, b.Name))
	})
	if len(out.Placements) == 0 {
		out.Placements = nil
	}
	if out.MIG {
		out.MemorySlices = nvdevice.MemorySlices
	}
	switch {
	case g.unhealthy:
		out.State = StateUnhealthy
	case whole:
		out.State = StateAllocated
	case len(held) > 0:
		out.State = StatePartial
	case b.in.ClaimsPartial || g.noClaims:
		out.State = StateUnknown
	default:
		out.State = StateFree
	}
	out.Usage = b.usage(node, out.Name, snap)
	out.IdleClaimed = idleClaimed(out, whole, held)
	return out
}

func compareHolders(a, b Holder) int {
	return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Claim, b.Claim), cmp.Compare(a.Local, b.Local))
}

var celCache = cel.NewCache(64, cel.Features{})
