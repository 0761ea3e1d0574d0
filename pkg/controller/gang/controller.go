// Package gang is gpudra's gang and reservation controller. It plans the
// devices of a whole group at once with pkg/allocator, all or nothing and
// NVLink-aware, and holds them as allocated ResourceClaims:
//
//   - a GpuReservation's devices in claims it creates and owns, which pods
//     consume by naming them;
//   - a gang's devices (a Grove PodGang, or plain pods labelled
//     gpudra.dev/gang with a gang-size) in the pods' own claims, after which
//     it lifts the scheduling gate that the admission webhook put on the
//     pods, so that the scheduler binds each pod where its devices are; or,
//     on the Workload API path (Options.Path), it hands the gang to
//     kube-scheduler as a PodGroup.
//
// Waiting items are ordered per GpuQueue (FCFS, Priority with aging,
// FairShare, ShortestJobFirst) and planned strictly in order. The scheduler
// allocates too: the controller fences the devices it chose with a
// DeviceTaintRule, checks they are still free, writes, and lifts the fence.
//
// The controller works in rounds: one goroutine, triggered by changes and
// a short period, plans every waiting item in queue order. That keeps the
// queue's order and the all-or-nothing writes simple to reason about.
//
// A reader can follow one part at a time:
//
//   - the core, shared by both paths: round.go (the round and idling),
//     reservations.go and gangs.go (collecting the waiting items),
//     queues.go (ordering and planning each queue), plan.go (the snapshot
//     and whether an item fits), admit.go (handing each admitted item to
//     its path), status.go and conditions.go (what the controller reports);
//   - the fence-and-write hand-off: commit.go (fence, check, write),
//     fence.go (the DeviceTaintRules), gates.go (lifting the gates of a
//     written gang: the gate path), and beside it repair.go (devices
//     allocated twice, half-written plans);
//   - the Workload API hand-off: workload.go;
//   - Grove's schema: grove.go;
//   - autoscaler.go and autoscalerwrite.go: the demand of items waiting
//     for devices, published for an autoscaler as CapacityBuffers, and
//     taken back before an item is admitted;
//   - recent.go (the controller's own writes the informers may not show
//     yet), classcount.go and counters.go (per-class device counts, shared
//     counters), metrics.go, transform.go (what the informers keep), off.go
//     (releasing gated pods when gangs are off).
package gang

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/events"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/klog/v2"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/allocator"
)

// Paths: how a gang that its queue lets go is handed to the scheduler.
// Everything before that (collecting gangs, queues, planning, statuses) is
// one core for both.
const (
	// PathGates: the controller allocates the gang's claims itself behind a
	// DeviceTaintRule fence (commit.go) and lifts the pods' scheduling gate
	// (gates.go).
	PathGates = "gates"
	// PathWorkload: the controller creates the gang's Workload and gang
	// PodGroup; kube-scheduler places all of its pods, and allocates their
	// claims, or none (workload.go). No fence and no claim write, except
	// for the claims that several of its pods share.
	PathWorkload = "workload"
)

// Options are what the controller needs.
type Options struct {
	Client  kubernetes.Interface
	Dynamic dynamic.Interface
	// Recorder records Events on reservations and gang pods; nil: none.
	Recorder events.EventRecorder
	// Registerer receives the metrics; nil: none.
	Registerer prometheus.Registerer
	// Strategy orders candidate nodes; default FewestNVLinkDomains.
	Strategy allocator.Strategy
	// FenceSettle is how long a device fence is given to reach the
	// scheduler before the devices are checked and written; default 1 s.
	FenceSettle time.Duration
	// Period between rounds when nothing changes (TTLs, aging); default 1 s.
	Period time.Duration
	// Grove: watch PodGangs (Grove's CRDs are installed).
	Grove bool
	// Path hands gangs to the scheduler: PathGates (default) or
	// PathWorkload (workload.go). Reservations are held the same way on
	// both.
	Path string
	// Now is the clock; nil: time.Now.
	Now func() time.Time
	// NodePoolLabels are the node labels that name a node's pool, tried in
	// order, for the per-pool device counts and demand; nil:
	// DefaultNodePoolLabels, empty: none (every device in pool "").
	NodePoolLabels []string
	// AutoscalerDemand publishes the demand of items waiting for devices
	// for an autoscaler (autoscaler.go): AutoscalerDemandCapacityBuffers
	// (default; where the API server serves them) or AutoscalerDemandOff.
	AutoscalerDemand string
	// Discovery tells whether CapacityBuffers are served; nil: the
	// client's.
	Discovery discovery.DiscoveryInterface
	// HandedOff, when set, is called after a gang is handed to
	// kube-scheduler (HandedClaims changed), off the controller's lock.
	HandedOff func()
}

// Controller runs on the leader only.
type Controller struct {
	opts      Options
	metrics   *metrics
	committer *committer
	// conditions writes the gang condition to pods off the round.
	conditions *conditionWriter
	cel        *cel.Cache
	trigger    chan struct{}

	pods         cache.Indexer
	claims       cache.Indexer
	slices       cache.Store
	classes      cache.Store
	nodes        cache.Store
	reservations cache.Store
	queues       cache.Store
	podGangs     cache.Store
	podGroups    cache.Store // Workload API path only
	workloads    cache.Store // Workload API path only
	templates    cache.Store // Workload API path only
	taintRules   cache.Store // DeviceTaintRules: fences (fence.go, keptfence.go)

	mu sync.Mutex
	// reported holds, per gang or reservation key, the last message
	// reported, so that Events are recorded when it changes only.
	reported map[string]string
	// recent holds this controller's own writes of the last recentTTL, by
	// kind-prefixed key (recent.go: items admitted, gates lifted,
	// PodGroups made, reservations re-queued): the informers lag behind
	// them, and a round must not plan, release or report them again from a
	// stale view.
	recent map[string]time.Time
	// handed holds, per gang key, the plan of a gang handed to
	// kube-scheduler (Workload API path) until its claims are allocated.
	handed map[string]handed
	// fresh are the claims (namespace/name) allocated since the last
	// round's double-allocation repair looked (repair.go).
	fresh sets.Set[string]
	// verdicts remembers, per item, whether it could ever fit.
	verdicts map[string]verdict
	// counter keeps the per-class device counts from the informers' events.
	counter *classCounter
	// idle says that the last round found nothing waiting and nothing in
	// flight (settled): ticks then skip rounds, and claim, slice and pod
	// events only mark the counts stale, so that an idle controller's cost
	// does not follow the cluster's size or churn (issue 26). Any event
	// about a gang, a reservation, a queue or a class runs a round.
	idle        atomic.Bool
	countsStale atomic.Bool
	// lastRound is when the last round ran (round goroutine only).
	lastRound time.Time
	// queuedDemand is the last round's demand of queued gangs and
	// reservations; deviceSeries and demandSeries the label sets last
	// set on gpudra_class_devices and gpudra_class_demand_devices, whose
	// others are deleted (round goroutine only).
	queuedDemand map[demandKey]float64
	deviceSeries map[[3]string]bool
	demandSeries map[demandKey]bool
	// autoscaler publishes the demand of items waiting for devices as
	// CapacityBuffers (nil: off); needDevices are the round's items whose
	// devices do not fit now and that nothing else holds back (round
	// goroutine only).
	autoscaler  *demandPublisher
	needDevices []*item
}

// New returns a controller; Run starts it.
func New(opts Options) (*Controller, error) {
	if opts.Client == nil || opts.Dynamic == nil {
		return nil, errors.New("gang controller: no API client")
	}
	if opts.Strategy == "" {
		opts.Strategy = allocator.FewestNVLinkDomains
	}
	if opts.FenceSettle == 0 {
		opts.FenceSettle = time.Second
	}
	if opts.Period == 0 {
		opts.Period = time.Second
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.NodePoolLabels == nil {
		opts.NodePoolLabels = DefaultNodePoolLabels
	}
	switch opts.Path {
	case "":
		opts.Path = PathGates
	case PathGates, PathWorkload:
	default:
		return nil, fmt.Errorf("gang controller: path %q: want %s or %s", opts.Path, PathGates, PathWorkload)
	}
	switch opts.AutoscalerDemand {
	case "":
		opts.AutoscalerDemand = AutoscalerDemandCapacityBuffers
	case AutoscalerDemandCapacityBuffers, AutoscalerDemandOff:
	default:
		return nil, fmt.Errorf("gang controller: autoscaler demand %q: want %s or %s", opts.AutoscalerDemand, AutoscalerDemandCapacityBuffers, AutoscalerDemandOff)
	}
	m, err := newMetrics(opts.Registerer)
	if err != nil {
		return nil, err
	}
	var autoscaler *demandPublisher
	if opts.AutoscalerDemand == AutoscalerDemandCapacityBuffers {
		autoscaler = newDemandPublisher(opts, m)
	}
	celCache := cel.NewCache(100, cel.Features{})
	return &Controller{
		autoscaler: autoscaler,
		opts:       opts, metrics: m,
		committer:  &committer{client: opts.Client, settle: opts.FenceSettle},
		conditions: newConditionWriter(opts.Client),
		cel:        celCache,
		counter:    newClassCounter(celCache, opts.NodePoolLabels...),
		trigger:    make(chan struct{}, 1),
		reported:   map[string]string{},
		recent:     map[string]time.Time{},
		verdicts:   map[string]verdict{},
		handed:     map[string]handed{},
	}, nil
}

// Run watches until ctx is done.
func (c *Controller) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx).WithName("gang")
	ctx = klog.NewContext(ctx, logger)
	typed := informers.NewSharedInformerFactoryWithOptions(c.opts.Client, 0, informers.WithTransform(dropUnread))
	dyn := dynamicinformer.NewDynamicSharedInformerFactory(c.opts.Dynamic, 0)
	podInf := typed.Core().V1().Pods().Informer()
	claimInf := typed.Resource().V1().ResourceClaims().Informer()
	if err := podInf.AddIndexers(cache.Indexers{gangMemberIndex: memberGang, nominatedIndex: nominatedNode, pendingIndex: pendingWithClaims,
		schedulingGroupIndex: namedPodGroup}); err != nil {
		return fmt.Errorf("gang controller: pod index: %w", err)
	}
	if err := claimInf.AddIndexers(cache.Indexers{reservationIndex: claimReservation, deviceIndex: claimDevices}); err != nil {
		return fmt.Errorf("gang controller: claim index: %w", err)
	}
	sliceInf := typed.Resource().V1().ResourceSlices().Informer()
	classInf := typed.Resource().V1().DeviceClasses().Informer()
	nodeInf := typed.Core().V1().Nodes().Informer()
	resInf := dyn.ForResource(gpudrav1.GpuReservations).Informer()
	queueInf := dyn.ForResource(gpudrav1.GpuQueues).Informer()
	c.pods, c.claims, c.slices, c.classes, c.nodes = podInf.GetIndexer(), claimInf.GetIndexer(), sliceInf.GetStore(), classInf.GetStore(), nodeInf.GetStore()
	c.reservations, c.queues = resInf.GetStore(), queueInf.GetStore()
	// Few objects: the fences of plans being written and of repaired
	// devices (keptfence.go).
	c.taintRules = typed.Resource().V1().DeviceTaintRules().Informer().GetStore()
	watched := []cache.SharedIndexInformer{claimInf, sliceInf, classInf, resInf, queueInf}
	if c.opts.Grove {
		pgInf := dyn.ForResource(PodGangs).Informer()
		c.podGangs = pgInf.GetStore()
		watched = append(watched, pgInf)
	}
	if c.opts.Path == PathWorkload {
		groupInf := typed.Scheduling().V1beta1().PodGroups().Informer()
		workloadInf := typed.Scheduling().V1beta1().Workloads().Informer()
		templateInf := typed.Resource().V1().ResourceClaimTemplates().Informer()
		c.podGroups, c.workloads, c.templates = groupInf.GetStore(), workloadInf.GetStore(), templateInf.GetStore()
		watched = append(watched, groupInf, workloadInf, templateInf)
	}
	for _, inf := range []cache.SharedIndexInformer{resInf, queueInf} {
		if err := inf.SetTransform(dropUnread); err != nil {
			return fmt.Errorf("gang controller: transform: %w", err)
		}
	}
	kick := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { c.kick() },
		UpdateFunc: func(any, any) { c.kick() },
		DeleteFunc: func(any) { c.kick() },
	}
	sliceCount, classCount, claimCount := c.counter.handlers(ctx)
	// A node whose pool label changed moves its devices' counts.
	nodeCount := c.counter.nodeHandler(func() { c.countsStale.Store(true) })
	for inf, h := range map[cache.SharedIndexInformer]cache.ResourceEventHandler{sliceInf: sliceCount, classInf: classCount, claimInf: claimCount, nodeInf: nodeCount} {
		if _, err := inf.AddEventHandler(h); err != nil {
			return fmt.Errorf("gang controller: event handler: %w", err)
		}
	}
	if _, err := claimInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			if cl, ok := obj.(*resourceapi.ResourceClaim); ok {
				c.noteAllocation(nil, cl)
			}
		},
		UpdateFunc: func(old, cur any) {
			o, ok1 := old.(*resourceapi.ResourceClaim)
			n, ok2 := cur.(*resourceapi.ResourceClaim)
			if ok1 && ok2 {
				c.noteAllocation(o, n)
			}
		},
	}); err != nil {
		return fmt.Errorf("gang controller: event handler: %w", err)
	}
	// Claims and slices change with every pod of the cluster: while idle
	// they only make the counts stale.
	soft := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { c.softKick() },
		UpdateFunc: func(any, any) { c.softKick() },
		DeleteFunc: func(any) { c.softKick() },
	}
	for _, inf := range watched {
		h := kick
		if inf == claimInf || inf == sliceInf {
			h = soft
		}
		if _, err := inf.AddEventHandler(h); err != nil {
			return fmt.Errorf("gang controller: event handler: %w", err)
		}
	}
	// Pods: only those waiting on gpudra, and pods that stop using claims
	// (softly), matter.
	podKick := func(obj any) {
		p, ok := obj.(*corev1.Pod)
		switch {
		case ok && c.waitsOnGpudra(p):
			c.kick()
		case ok && len(p.Spec.ResourceClaims) > 0:
			c.softKick()
		}
	}
	if _, err := podInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: podKick, UpdateFunc: func(_, obj any) { podKick(obj) }, DeleteFunc: podKick,
	}); err != nil {
		return fmt.Errorf("gang controller: event handler: %w", err)
	}
	typed.Start(ctx.Done())
	dyn.Start(ctx.Done())
	defer typed.Shutdown()
	defer dyn.Shutdown()
	for typ, ok := range typed.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return fmt.Errorf("gang controller: %v cache did not sync: %w", typ, ctx.Err())
		}
	}
	for gvr, ok := range dyn.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return fmt.Errorf("gang controller: %v cache did not sync (are gpudra's CRDs installed?): %w", gvr, ctx.Err())
		}
	}
	if err := sweepFences(ctx, c.opts.Client, c.opts.Now(), 0); err != nil {
		logger.Error(err, "Sweep device fences left by an earlier leader")
	}
	c.committer.binding = c.binding
	go c.conditions.run(ctx, conditionWorkers)
	logger.Info("Planning gangs and reservations", "path", c.opts.Path, "strategy", c.opts.Strategy, "grove", c.opts.Grove)
	ticker := time.NewTicker(c.opts.Period)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-c.trigger:
		case <-ticker.C:
			if c.idleTick(ctx) {
				continue
			}
		}
		start := time.Now()
		err := c.round(ctx)
		c.metrics.roundSeconds.Observe(time.Since(start).Seconds())
		if err != nil && ctx.Err() == nil {
			logger.Error(err, "Round failed; trying again")
		}
	}
}

// softKick is a change that needs a round only while the controller is not
// idle; it always makes the per-class counts stale.
func (c *Controller) softKick() {
	c.countsStale.Store(true)
	if !c.idle.Load() {
		c.kick()
	}
}

// kick asks for a round; kicks during a round coalesce into one more.
func (c *Controller) kick() {
	select {
	case c.trigger <- struct{}{}:
	default:
	}
}
