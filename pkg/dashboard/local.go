package dashboard

import (
	"cmp"
	"context"
	"strconv"
	"strings"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/klog/v2"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/controller/queue"
	"github.com/gpudra/gpudra/pkg/local"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/top"
)

// LocalInputs is what BuildLocal needs: one read of the machine.
type LocalInputs struct {
	Now time.Time
	// Snapshot is the machine's telemetry read (top.FromMachine, without
	// the state: holders come from State); nil: not read.
	Snapshot *top.Snapshot
	// State is gpudra local's state (nil: none, or not readable).
	State *local.State
	// Order is the waiters in the order they would be granted (nil:
	// LocalOrder of State).
	Order []local.Waiter
	// Slices are the machine's devices as gpudra local publishes them
	// (local.Machine.Slices): every MIG placement, free ones included.
	// nil: the devices Snapshot lists.
	Slices []*resourceapi.ResourceSlice
	Spark  map[string][]*float64
	// Allocation over time (nil: none yet).
	Allocation *Allocation
	Notes      []string
}

// BuildLocal is the View of one machine: its GPUs with their MIG
// placements and the local allocations holding them, and the machine's
// queue: holders (Holding, position 0), then the waiters in grant order
// with their estimated starts (gpudra local ps's). Pure, as Build.
func BuildLocal(in LocalInputs) *View {
	node := "localhost"
	switch {
	case len(in.Slices) > 0:
		node = sliceNode(in.Slices[0])
	case in.Snapshot != nil && in.Snapshot.Node != "":
		node = in.Snapshot.Node
	}
	ci := ClusterInputs{Now: in.Now, Slices: in.Slices, Spark: in.Spark}
	if in.Snapshot != nil {
		ci.Usage, ci.UsageSource = map[string]*top.Snapshot{node: in.Snapshot}, in.Snapshot.Source
	}
	b := &builder{in: ci, nodes: map[string]*nodeAcc{}, classes: newClassMatcher(nil)}
	n := b.node(node)
	b.addSlices()
	if len(in.Slices) == 0 && in.Snapshot != nil {
		snapshotDevices(n, in.Snapshot)
	}
	if in.State != nil {
		for _, a := range in.State.Allocations {
			h := Holder{Local: a.Name, User: a.User, PID: a.Holder.PID, Shared: a.Share != ""}
			for _, d := range a.Devices {
				b.attach(n, d.Name, h)
			}
		}
	}
	v := &View{Mode: "local", At: in.Now, Context: node}
	v.Domains = b.domains(v)
	for i := range v.Domains {
		for j := range v.Domains[i].Nodes {
			nd := &v.Domains[i].Nodes[j]
			nd.Mode, nd.Kubectl = "", "" // no cluster to ask
		}
	}
	v.Queues = []Queue{localQueue(in, v.Summary.GPUs)}
	v.Summary.Waiting = len(v.Queues[0].Items) - holdingItems(v.Queues[0].Items)
	v.Filters = b.filters(v)
	if in.Allocation != nil {
		v.Allocation = *in.Allocation
	} else {
		v.Allocation = Allocation{Source: "seen", Series: []AllocationSeries{}}
	}
	v.Notes = append([]string(nil), in.Notes...)
	if in.Snapshot != nil {
		v.Notes = append(v.Notes, in.Snapshot.Notes...)
	}
	return v
}

func holdingItems(items []QueueItem) int {
	n := 0
	for _, it := range items {
		if it.Holding {
			n++
		}
	}
	return n
}

// snapshotDevices makes the GPUs and MIG devices a telemetry read lists,
// when the machine's slices are not given.
func snapshotDevices(n *nodeAcc, s *top.Snapshot) {
	for _, d := range s.Devices {
		if d.GPU != "" || strings.Contains(d.Name, "-mig-") {
			continue
		}
		g := n.gpu(d.Name)
		g.gpu.UUID, g.gpu.Model = d.UUID, d.Model
		if d.MemoryTotalBytes != nil {
			g.gpu.MemoryBytes = int64(*d.MemoryTotalBytes)
		}
	}
	for _, d := range s.Devices {
		if !strings.Contains(d.Name, "-mig-") {
			continue
		}
		g := n.gpu(parentName(d.Name))
		g.gpu.MIG = true
		p := g.placement(d.Name)
		p.Profile = d.Profile
		label := strings.TrimSuffix(d.Name[len(parentName(d.Name))+len("-mig-"):], "-"+strconv.Itoa(nameStart(d.Name)))
		p.Start, p.Size = nameStart(d.Name), computeSlices(label)
	}
}

// localQueue is the machine's one queue: holders, then the waiters in
// order with gpudra local ps's estimates, then failed requests their
// requesters have not yet seen.
func localQueue(in LocalInputs, gpus int) Queue {
	q := Queue{Name: "local", Policy: string(gpudrav1.FCFS), Exists: true, Items: []QueueItem{}}
	if in.State == nil {
		return q
	}
	q.Policy = cmp.Or(in.State.Policy, q.Policy)
	order := in.Order
	if order == nil {
		order = LocalOrder(in.State, in.Now)
	}
	byName := map[string]local.Request{}
	for _, a := range in.State.Allocations {
		byName[a.Name] = a.Request
	}
	for _, w := range in.State.Waiters {
		byName[w.Name] = w.Request
	}
	for _, r := range local.Ps(in.State, order, in.Now, gpus) {
		since := r.Since
		it := QueueItem{Kind: "Local", Name: r.Name, User: r.User, Since: &since, Position: r.Position, EstimatedStart: r.EstimatedStart}
		if req := byName[r.Name]; req.Duration != nil {
			it.Duration = req.Duration.String()
		}
		switch r.State {
		case "Allocated", "Reserved":
			it.Holding, it.Devices, it.Reason = true, int64(len(r.UUIDs)), r.State
		case "Failed":
			it.Reason, it.Message = "Failed", r.Error
		default:
			it.Devices = local.DevicesAsked(byName[r.Name].Devices.Requests)
		}
		q.Items = append(q.Items, it)
	}
	return q
}

// LocalOrder is the waiters in the order gpudra local grants them, by the
// machine's policy (users stand in for namespaces), failed ones left out:
// what local.Local.Order says, without opening the state for writing.
func LocalOrder(s *local.State, now time.Time) []local.Waiter {
	policy := queue.Policy{Name: gpudrav1.QueuePolicy(s.Policy), AgingPerMinute: 1, DefaultShare: 1}
	if policy.Name == "" {
		policy.Name = gpudrav1.FCFS
	}
	held := map[string]int64{}
	for _, a := range s.Allocations {
		held[a.User] += int64(len(a.Devices))
	}
	byKey := map[string]local.Waiter{}
	items := make([]queue.Item, 0, len(s.Waiters))
	for _, w := range s.Waiters {
		if w.Error != "" {
			continue
		}
		byKey[w.Name] = w
		items = append(items, queue.Item{Key: w.Name, Namespace: w.User, Priority: w.Priority, QueuedAt: w.QueuedAt,
			Duration: w.Duration, Devices: local.DevicesAsked(w.Request.Devices.Requests)})
	}
	out := make([]local.Waiter, 0, len(items))
	for _, it := range queue.Order(policy, items, now, held) {
		out = append(out, byKey[it.Key])
	}
	return out
}

// LocalConfig is what a LocalSource reads: the GPU backend's telemetry
// and gpudra local's state, read only.
type LocalConfig struct {
	Telemetry nvdevice.TelemetryReader
	// Node is the machine's name; Backend the backend's ("nvml", "sim").
	Node, Backend string
	// StateDir is gpudra local's state (local.DefaultStateDir).
	StateDir string
	// UserOf is a PID's owner (top.ProcUser); nil: not told.
	UserOf func(pid int) string
	// Slices are the machine's devices as local publishes them (nil: those
	// the telemetry lists).
	Slices []*resourceapi.ResourceSlice
	// Order orders the waiters (nil: LocalOrder).
	Order func(*local.State) []local.Waiter
	// Interval is the time between reads (2 s).
	Interval time.Duration
	Now      func() time.Time
}

// LocalSource keeps the View of one machine, read every interval.
type LocalSource struct {
	cfg  LocalConfig
	pub  *Publisher
	hist *History
}

// NewLocalSource returns the source; Run (or Refresh) reads the machine.
func NewLocalSource(cfg LocalConfig) *LocalSource {
	if cfg.Interval <= 0 {
		cfg.Interval = 2 * time.Second
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.StateDir == "" {
		cfg.StateDir = local.DefaultStateDir
	}
	initial := &View{Mode: "local", At: cfg.Now(), Context: cfg.Node, Domains: []Domain{}, Queues: []Queue{},
		Allocation: Allocation{Source: "seen", Series: []AllocationSeries{}},
		Filters:    Filters{States: []string{StateFree, StatePartial, StateAllocated, StateBlocked, StateUnhealthy}},
		Notes:      []string{"reading the machine..."}}
	return &LocalSource{cfg: cfg, pub: NewPublisher(initial), hist: NewHistory(0, 0)}
}

// Current implements Source.
func (s *LocalSource) Current() (*View, <-chan struct{}) { return s.pub.Current() }

// Run reads the machine every interval until ctx is done.
func (s *LocalSource) Run(ctx context.Context) error {
	t := time.NewTicker(s.cfg.Interval)
	defer t.Stop()
	for {
		s.Refresh(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// Refresh reads the machine once and publishes its View. A failed read
// is a note: the rest still shows.
func (s *LocalSource) Refresh(ctx context.Context) {
	now := s.cfg.Now()
	in := LocalInputs{Now: now, Slices: s.cfg.Slices}
	if s.cfg.Telemetry != nil {
		samples, err := s.cfg.Telemetry.Telemetry(ctx)
		if err != nil {
			klog.FromContext(ctx).V(2).Info("Telemetry read failed", "err", err)
			in.Notes = append(in.Notes, "usage: read the GPUs' telemetry: "+err.Error())
		} else {
			in.Snapshot = top.FromMachine(samples, s.cfg.Node, s.cfg.Backend, nil, s.cfg.UserOf, now)
			s.hist.RecordUsage(map[string]*top.Snapshot{s.nodeName(): in.Snapshot})
		}
	}
	state, err := top.ReadLocalState(s.cfg.StateDir)
	if err != nil {
		in.Notes = append(in.Notes, err.Error()+": holders and waiters not shown")
	}
	in.State = state
	if state != nil && s.cfg.Order != nil {
		in.Order = s.cfg.Order(state)
	}
	in.Spark = s.hist.Sparks()
	v := BuildLocal(in)
	s.hist.Observe(v)
	v.Allocation = s.hist.Allocation()
	s.pub.Publish(v)
}

// nodeName is the node BuildLocal files the devices under.
func (s *LocalSource) nodeName() string {
	if len(s.cfg.Slices) > 0 {
		return sliceNode(s.cfg.Slices[0])
	}
	return cmp.Or(s.cfg.Node, "localhost")
}
