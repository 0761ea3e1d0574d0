// Package gang is gpudra's gang and reservation controller. It plans the
// devices of a whole group at once with pkg/allocator, all or nothing and
// NVLink-aware, and holds them as allocated ResourceClaims:
//
//   - a GpuReservation's devices in claims it creates and owns, which pods
//     consume by naming them;
//   - a gang's devices (a Grove PodGang, or plain pods labelled
//     gpudra.dev/gang with a gang-size) in the pods' own claims, after which
//     it lifts the scheduling gate that the admission webhook put on the
//     pods, so that the scheduler binds each pod where its devices are.
//
// Waiting items are ordered per GpuQueue (FCFS, Priority with aging,
// FairShare, ShortestJobFirst) and planned strictly in order. The scheduler
// allocates too: the controller fences the devices it chose with a
// DeviceTaintRule, checks they are still free, writes, and lifts the fence.
//
// The controller works in rounds: one goroutine, triggered by changes and
// a short period, plans every waiting item in queue order. That keeps the
// queue's order and the all-or-nothing writes simple to reason about.
package gang

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/sets"
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

// PodGangs is Grove's PodGang resource.
var PodGangs = schema.GroupVersionResource{Group: "scheduler.grove.io", Version: "v1alpha1", Resource: "podgangs"}

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
	templates    cache.Store // Workload API path only

	mu sync.Mutex
	// reported holds, per gang or reservation key, the last message
	// reported, so that Events are recorded when it changes only.
	reported map[string]string
	// recent holds the items (by key) and pods (by UID) this controller
	// allocated or released in the last recentTTL: the informers lag
	// behind its own writes, and a round must not plan or report them
	// again from a stale view.
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
	switch opts.Path {
	case "":
		opts.Path = PathGates
	case PathGates, PathWorkload:
	default:
		return nil, fmt.Errorf("gang controller: path %q: want %s or %s", opts.Path, PathGates, PathWorkload)
	}
	m, err := newMetrics(opts.Registerer)
	if err != nil {
		return nil, err
	}
	celCache := cel.NewCache(100, cel.Features{})
	return &Controller{
		opts: opts, metrics: m,
		committer:  &committer{client: opts.Client, settle: opts.FenceSettle},
		conditions: newConditionWriter(opts.Client),
		cel:        celCache,
		counter:    newClassCounter(celCache),
		trigger:    make(chan struct{}, 1),
		reported:   map[string]string{},
		recent:     map[string]time.Time{},
		verdicts:   map[string]verdict{},
		handed:     map[string]handed{},
	}, nil
}

// gateIndex indexes gang pods by gang key, gated or not.
const gateIndex = "gang"

func gangIndex(obj any) ([]string, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok || !member(p) {
		return nil, nil
	}
	if name, _ := gangKey(p); name != "" {
		return []string{p.Namespace + "/" + name}, nil
	}
	return nil, nil
}

// nominatedIndex indexes pods not bound yet by the node kube-scheduler
// nominated for them.
const nominatedIndex = "nominated"

func nominatedNode(obj any) ([]string, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok || p.Spec.NodeName != "" || p.Status.NominatedNodeName == "" {
		return nil, nil
	}
	return []string{p.Status.NominatedNodeName}, nil
}

// reservationIndex indexes claims by the reservation that holds them.
const reservationIndex = "reservation"

func claimReservation(obj any) ([]string, error) {
	c, ok := obj.(*resourceapi.ResourceClaim)
	if !ok {
		return nil, nil
	}
	if r := c.Labels[gpudrav1.LabelReservation]; r != "" {
		return []string{c.Namespace + "/" + r}, nil
	}
	return nil, nil
}

// Run watches until ctx is done.
func (c *Controller) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx).WithName("gang")
	ctx = klog.NewContext(ctx, logger)
	typed := informers.NewSharedInformerFactoryWithOptions(c.opts.Client, 0, informers.WithTransform(dropUnread))
	dyn := dynamicinformer.NewDynamicSharedInformerFactory(c.opts.Dynamic, 0)
	podInf := typed.Core().V1().Pods().Informer()
	claimInf := typed.Resource().V1().ResourceClaims().Informer()
	if err := podInf.AddIndexers(cache.Indexers{gateIndex: gangIndex, nominatedIndex: nominatedNode}); err != nil {
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
	watched := []cache.SharedIndexInformer{claimInf, sliceInf, classInf, resInf, queueInf}
	if c.opts.Grove {
		pgInf := dyn.ForResource(PodGangs).Informer()
		c.podGangs = pgInf.GetStore()
		watched = append(watched, pgInf)
	}
	if c.opts.Path == PathWorkload {
		groupInf := typed.Scheduling().V1beta1().PodGroups().Informer()
		templateInf := typed.Resource().V1().ResourceClaimTemplates().Informer()
		c.podGroups, c.templates = groupInf.GetStore(), templateInf.GetStore()
		watched = append(watched, groupInf, templateInf)
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
	for inf, h := range map[cache.SharedIndexInformer]cache.ResourceEventHandler{sliceInf: sliceCount, classInf: classCount, claimInf: claimCount} {
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
	// Pods: only waiting ones, and pods that stop using claims (softly), matter.
	podKick := func(obj any) {
		p, ok := obj.(*corev1.Pod)
		switch {
		case ok && c.waits(p):
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

// conditionWorkers write pod conditions in parallel, at the client's rate.
const conditionWorkers = 4

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

func (c *Controller) claim(namespace, name string) *resourceapi.ResourceClaim {
	obj, ok, err := c.claims.GetByKey(namespace + "/" + name)
	if err != nil || !ok {
		return nil
	}
	return obj.(*resourceapi.ResourceClaim)
}

// podClaims are a pod's claims. On the Workload API path a claim still to
// be made from a template is planned from the template: the claim
// controller makes it only once the pod's PodGroup exists.
func (c *Controller) podClaims(p *corev1.Pod) ([]*resourceapi.ResourceClaim, error) {
	var template func(namespace, name string) *resourceapi.ResourceClaimTemplate
	if c.opts.Path == PathWorkload {
		template = c.template
	}
	return claimsOfPod(p, c.claim, template)
}

func (c *Controller) template(namespace, name string) *resourceapi.ResourceClaimTemplate {
	if c.templates == nil {
		return nil
	}
	obj, ok, err := c.templates.GetByKey(namespace + "/" + name)
	if err != nil || !ok {
		return nil
	}
	return obj.(*resourceapi.ResourceClaimTemplate)
}

func (c *Controller) podGang(namespace, name string) *unstructured.Unstructured {
	if c.podGangs == nil {
		return nil
	}
	obj, ok, err := c.podGangs.GetByKey(namespace + "/" + name)
	if err != nil || !ok {
		return nil
	}
	return obj.(*unstructured.Unstructured)
}

// snapshot reads the informers.
func (c *Controller) snapshot() *snapshot {
	s := &snapshot{}
	for _, o := range c.slices.List() {
		s.slices = append(s.slices, o.(*resourceapi.ResourceSlice))
	}
	for _, o := range c.classes.List() {
		s.classes = append(s.classes, o.(*resourceapi.DeviceClass))
	}
	for _, o := range c.nodes.List() {
		s.nodes = append(s.nodes, o.(*corev1.Node))
	}
	for _, o := range c.claims.List() {
		if cl := o.(*resourceapi.ResourceClaim); cl.Status.Allocation != nil {
			s.allocated = append(s.allocated, cl)
		}
	}
	s.allocated = append(s.allocated, c.handedClaims(func(namespace, name string) bool {
		obj, ok, err := c.pods.GetByKey(namespace + "/" + name)
		return err != nil || !ok || obj.(*corev1.Pod).Spec.NodeName != ""
	})...)
	return s
}

// recentTTL bounds how long the informers may lag behind the
// controller's own writes.
const recentTTL = 30 * time.Second

// remember records a key (an item, or a pod UID) as just written.
func (c *Controller) remember(key string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.recent[key] = c.opts.Now()
}

// isRecent says whether key was written within recentTTL, and forgets
// older entries.
func (c *Controller) isRecent(key string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.opts.Now()
	for k, t := range c.recent {
		if now.Sub(t) > recentTTL {
			delete(c.recent, k)
		}
	}
	_, ok := c.recent[key]
	return ok
}

// gangPods are the members of the gangs that have a pod waiting on gpudra,
// waiting or not.
func (c *Controller) gangPods() []*corev1.Pod {
	var out []*corev1.Pod
	for _, key := range c.pods.ListIndexFuncValues(gateIndex) {
		objs, _ := c.pods.ByIndex(gateIndex, key)
		if !slices.ContainsFunc(objs, func(o any) bool { return c.waits(o.(*corev1.Pod)) }) {
			continue
		}
		for _, o := range objs {
			out = append(out, o.(*corev1.Pod))
		}
	}
	return out
}

// binding names a pod kube-scheduler is binding to one of the nodes (it
// nominated the node, the pod is not bound yet) whose claims it has not all
// written yet, or "" when there is none.
func (c *Controller) binding(nodes []string) string {
	var pods []any
	for _, n := range nodes {
		objs, _ := c.pods.ByIndex(nominatedIndex, n)
		pods = append(pods, objs...)
	}
	for _, o := range pods {
		p := o.(*corev1.Pod)
		if !member(p) {
			continue
		}
		cls, err := claimsOfPod(p, c.claim, nil)
		if err != nil {
			return p.Namespace + "/" + p.Name // a claim not even made yet
		}
		for _, cl := range cls {
			if cl.Status.Allocation == nil {
				return p.Namespace + "/" + p.Name
			}
		}
	}
	return ""
}

// released says whether this controller just lifted the pod's gate (the
// informer has not seen it yet).
func (c *Controller) released(p *corev1.Pod) bool { return c.isRecent("pod/" + string(p.UID)) }

// reservationClaimsOf are the claims holding a reservation.
func (c *Controller) reservationClaimsOf(r *gpudrav1.GpuReservation) []*resourceapi.ResourceClaim {
	objs, _ := c.claims.ByIndex(reservationIndex, r.Namespace+"/"+r.Name)
	out := make([]*resourceapi.ResourceClaim, 0, len(objs))
	for _, o := range objs {
		cl := o.(*resourceapi.ResourceClaim)
		if ownedBy(cl, r) {
			out = append(out, cl)
		}
	}
	return out
}
