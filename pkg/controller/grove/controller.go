// Package grove watches the ResourceClaims that Grove (the PodCliqueSet
// operator) creates for resourceSharing, tracks each sharing group's
// consumers, and reports with Events and metrics when a group cannot work.
// Analyze is the pure heart; the Controller feeds it from informers and
// reports what changed. docs/sharing-groups.md describes both.
package grove

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	resourcelisters "k8s.io/client-go/listers/resource/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/events"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
)

// ActionShare is the action of the controller's Events.
const ActionShare = "Share"

// Options are what the controller needs from the gpudra controller process.
type Options struct {
	Client kubernetes.Interface
	// Recorder records Events on claims and their Grove owners; nil: none.
	Recorder events.EventRecorder
	// Registerer receives the controller's metrics; nil: none.
	Registerer prometheus.Registerer
	// PendingGrace is how long a consumer may stay unschedulable on claims
	// before it is reported; zero: DefaultPendingGrace.
	PendingGrace time.Duration
	// Workers syncing claims; zero: 2.
	Workers int
	// ResyncPeriod of the informers; zero: none.
	ResyncPeriod time.Duration
	// Now is the clock; nil: time.Now.
	Now func() time.Time
}

// Controller tracks Grove sharing groups. It runs on the leader only.
type Controller struct {
	opts    Options
	metrics *metrics
	queue   workqueue.TypedRateLimitingInterface[string]

	claims resourcelisters.ResourceClaimLister
	pods   cache.Indexer
	nodes  corelisters.NodeLister

	mu sync.Mutex
	// groups holds, per claim key, the last analysis and what was
	// reported for it, so that a problem is reported once, when it appears
	// or changes, and not at every resync.
	groups map[string]*groupState
}

type groupState struct {
	// uid is the claim's; a claim made again under the same name starts
	// afresh.
	uid   types.UID
	group Group
	// reported maps a reason to what was last reported for it.
	reported map[string]reported
}

type reported struct {
	identity string
	message  string
}

// New returns a controller; Run starts it.
func New(opts Options) (*Controller, error) {
	if opts.Client == nil {
		return nil, errors.New("grove controller: no API client")
	}
	if opts.Workers <= 0 {
		opts.Workers = 2
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	m, err := newMetrics(opts.Registerer)
	if err != nil {
		return nil, err
	}
	return &Controller{
		opts:    opts,
		metrics: m,
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.DefaultTypedControllerRateLimiter[string](),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "grove-sharing-groups"}),
		groups: map[string]*groupState{},
	}, nil
}

// claimIndex indexes pods by the claims they reference by name.
const claimIndex = "claim"

func podClaimKeys(obj any) ([]string, error) {
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return nil, nil
	}
	var keys []string
	for _, rc := range pod.Spec.ResourceClaims {
		if rc.ResourceClaimName != nil {
			keys = append(keys, pod.Namespace+"/"+*rc.ResourceClaimName)
		}
	}
	return keys, nil
}

// Run watches claims, pods and nodes until ctx is done. Claims and pods
// are watched with the label managed-by=grove-operator, which Grove puts on
// both: a pod Grove did not make is not counted as a consumer.
func (c *Controller) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx).WithName("grove")
	ctx = klog.NewContext(ctx, logger)
	defer c.queue.ShutDown()

	grove := informers.NewSharedInformerFactoryWithOptions(c.opts.Client, c.opts.ResyncPeriod,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.LabelSelector = labels.Set{LabelManagedBy: ManagedByGrove}.String()
		}))
	all := informers.NewSharedInformerFactory(c.opts.Client, c.opts.ResyncPeriod)
	claimInformer := grove.Resource().V1().ResourceClaims()
	podInformer := grove.Core().V1().Pods()
	nodeInformer := all.Core().V1().Nodes()
	if err := podInformer.Informer().AddIndexers(cache.Indexers{claimIndex: podClaimKeys}); err != nil {
		return fmt.Errorf("grove controller: pod index: %w", err)
	}
	c.claims, c.pods, c.nodes = claimInformer.Lister(), podInformer.Informer().GetIndexer(), nodeInformer.Lister()

	if err := c.seed(ctx); err != nil {
		// Without the old Events a new leader reports current problems once
		// more; that is better than not starting.
		logger.Error(err, "Reading earlier Events failed; current problems will be reported again")
	}

	handlers := []struct {
		informer cache.SharedIndexInformer
		handler  cache.ResourceEventHandler
	}{
		{claimInformer.Informer(), cache.ResourceEventHandlerFuncs{
			AddFunc:    c.enqueueClaim,
			UpdateFunc: func(_, obj any) { c.enqueueClaim(obj) },
			DeleteFunc: c.enqueueClaim,
		}},
		{podInformer.Informer(), cache.ResourceEventHandlerFuncs{
			AddFunc:    c.enqueuePodClaims,
			UpdateFunc: func(old, obj any) { c.enqueuePodClaims(old); c.enqueuePodClaims(obj) },
			DeleteFunc: c.enqueuePodClaims,
		}},
		{nodeInformer.Informer(), cache.ResourceEventHandlerFuncs{
			AddFunc:    c.enqueueNodeClaims,
			UpdateFunc: c.nodeUpdated,
			DeleteFunc: c.enqueueNodeClaims,
		}},
	}
	for _, h := range handlers {
		if _, err := h.informer.AddEventHandler(h.handler); err != nil {
			return fmt.Errorf("grove controller: event handler: %w", err)
		}
	}
	grove.Start(ctx.Done())
	all.Start(ctx.Done())
	defer grove.Shutdown()
	defer all.Shutdown()
	for typ, ok := range grove.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return fmt.Errorf("grove controller: %v cache did not sync: %w", typ, ctx.Err())
		}
	}
	for typ, ok := range all.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return fmt.Errorf("grove controller: %v cache did not sync: %w", typ, ctx.Err())
		}
	}
	c.dropSeededGone()
	logger.Info("Watching Grove sharing groups", "workers", c.opts.Workers)
	var wg sync.WaitGroup
	for range c.opts.Workers {
		wg.Go(func() { wait.UntilWithContext(ctx, c.work, time.Second) })
	}
	<-ctx.Done()
	c.queue.ShutDown()
	wg.Wait()
	return nil
}

func (c *Controller) enqueueClaim(obj any) {
	if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
		c.queue.Add(key)
	}
}

func (c *Controller) enqueuePodClaims(obj any) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	keys, _ := podClaimKeys(obj)
	for _, k := range keys {
		c.queue.Add(k)
	}
}

// nodeUpdated re-checks groups only when what a consumer is matched
// against changed: node status updates are frequent and change neither.
func (c *Controller) nodeUpdated(old, obj any) {
	o, n := old.(*corev1.Node), obj.(*corev1.Node)
	if labels.Equals(o.Labels, n.Labels) && equalTaints(o.Spec.Taints, n.Spec.Taints) {
		return
	}
	c.enqueueNodeClaims(obj)
}

func equalTaints(a, b []corev1.Taint) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if !a[i].MatchTaint(&b[i]) || a[i].Value != b[i].Value {
			return false
		}
	}
	return true
}

// enqueueNodeClaims re-checks the groups allocated on the node, and those
// whose node was not known.
func (c *Controller) enqueueNodeClaims(obj any) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	node, ok := obj.(*corev1.Node)
	if !ok {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for key, st := range c.groups {
		if st.group.Allocated && (st.group.Node == node.Name || st.group.Node == "") {
			c.queue.Add(key)
		}
	}
}

func (c *Controller) work(ctx context.Context) {
	for c.processNext(ctx) {
	}
}

func (c *Controller) processNext(ctx context.Context) bool {
	key, shutdown := c.queue.Get()
	if shutdown {
		return false
	}
	defer c.queue.Done(key)
	recheck, err := c.sync(ctx, key)
	if err != nil {
		utilruntime.HandleErrorWithContext(ctx, err, "Syncing Grove sharing group failed", "claim", key)
		c.queue.AddRateLimited(key)
		return true
	}
	c.queue.Forget(key)
	if recheck > 0 {
		c.queue.AddAfter(key, recheck)
	}
	return true
}

// sync analyses one claim's group and reports what is new.
func (c *Controller) sync(ctx context.Context, key string) (time.Duration, error) {
	namespace, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return 0, nil // never valid: do not retry
	}
	claim, err := c.claims.ResourceClaims(namespace).Get(name)
	if apierrors.IsNotFound(err) || (err == nil && (!IsGroveClaim(claim) || !IsOurs(claim))) {
		c.forget(key)
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("get claim %s: %w", key, err)
	}
	podObjs, err := c.pods.ByIndex(claimIndex, key)
	if err != nil {
		return 0, fmt.Errorf("consumers of claim %s: %w", key, err)
	}
	pods := make([]*corev1.Pod, 0, len(podObjs))
	for _, o := range podObjs {
		pods = append(pods, o.(*corev1.Pod))
	}
	var nodes []*corev1.Node
	if claim.Status.Allocation != nil && claim.Status.Allocation.NodeSelector != nil {
		if nodes, err = c.nodes.List(labels.Everything()); err != nil {
			return 0, fmt.Errorf("list nodes: %w", err)
		}
	}
	group, recheck := Analyze(Input{Claim: claim, Pods: pods, Nodes: nodes, Now: c.opts.Now(), PendingGrace: c.opts.PendingGrace})
	c.report(ctx, key, claim, group)
	return recheck, nil
}

// report records an Event for every problem that is new or changed since
// the last sync of this claim, and updates the metrics.
func (c *Controller) report(ctx context.Context, key string, claim *resourceapi.ResourceClaim, g Group) {
	logger := klog.FromContext(ctx)
	c.mu.Lock()
	st := c.groups[key]
	if st == nil || st.uid != g.ClaimUID {
		st = &groupState{uid: g.ClaimUID, reported: map[string]reported{}}
		c.groups[key] = st
	}
	st.group = g
	var toReport []Problem
	current := map[string]bool{}
	for _, p := range g.Problems {
		current[p.Reason] = true
		last, seen := st.reported[p.Reason]
		if seen && (last.identity == p.identity() || last.message == note(p.Message)) {
			continue
		}
		st.reported[p.Reason] = reported{identity: p.identity(), message: note(p.Message)}
		toReport = append(toReport, p)
	}
	for reason := range st.reported {
		if !current[reason] {
			delete(st.reported, reason) // solved: report it again if it comes back
		}
	}
	c.updateMetricsLocked()
	c.mu.Unlock()

	for _, p := range toReport {
		logger.Info("Grove sharing group problem", "claim", klog.KObj(claim), "reason", p.Reason, "message", p.Message)
		c.metrics.events.WithLabelValues(p.Reason).Inc()
		if c.opts.Recorder == nil {
			continue
		}
		claimRef := claimReference(claim)
		var ownerRef *corev1.ObjectReference
		if g.Owner != nil {
			ownerRef = &corev1.ObjectReference{APIVersion: g.Owner.APIVersion, Kind: g.Owner.Kind, Name: g.Owner.Name, Namespace: claim.Namespace, UID: g.Owner.UID}
		}
		// related must be a typed nil-free value: a nil *ObjectReference in
		// the interface would be dereferenced by the recorder.
		if ownerRef != nil {
			c.opts.Recorder.Eventf(claimRef, ownerRef, corev1.EventTypeWarning, p.Reason, ActionShare, "%s", note(p.Message))
			c.opts.Recorder.Eventf(ownerRef, claimRef, corev1.EventTypeWarning, p.Reason, ActionShare, "%s", note("claim "+claim.Name+": "+p.Message))
		} else {
			c.opts.Recorder.Eventf(claimRef, nil, corev1.EventTypeWarning, p.Reason, ActionShare, "%s", note(p.Message))
		}
	}
}

// claimReference names the claim without its resourceVersion: the events
// library folds Events with the same regarding object and reason into a
// series, and a version would make that depend on unrelated claim updates.
func claimReference(claim *resourceapi.ResourceClaim) *corev1.ObjectReference {
	return &corev1.ObjectReference{APIVersion: resourceapi.SchemeGroupVersion.String(), Kind: "ResourceClaim",
		Namespace: claim.Namespace, Name: claim.Name, UID: claim.UID}
}

// noteLimit is the API server's limit on an events.k8s.io Event's note; a
// longer one is refused and the Event lost.
const noteLimit = 1024

// note cuts a message to what an Event can hold, at a rune boundary.
func note(msg string) string {
	if len(msg) <= noteLimit {
		return msg
	}
	const more = "..."
	cut := noteLimit - len(more)
	for cut > 0 && !utf8.RuneStart(msg[cut]) {
		cut--
	}
	return msg[:cut] + more
}

// dropSeededGone forgets what earlier Events said about claims that no
// longer exist; the claims that do exist are all queued by now.
func (c *Controller) dropSeededGone() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for key, st := range c.groups {
		namespace, name, _ := cache.SplitMetaNamespaceKey(key)
		if claim, err := c.claims.ResourceClaims(namespace).Get(name); err != nil || claim.UID != st.uid {
			delete(c.groups, key)
		}
	}
}

func (c *Controller) forget(key string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.groups, key)
	c.updateMetricsLocked()
}

func (c *Controller) updateMetricsLocked() {
	groups, consumers := 0, 0
	problems := map[string]int{}
	for _, st := range c.groups {
		if st.group.ClaimUID == "" {
			continue // seeded only
		}
		groups++
		consumers += len(st.group.Consumers)
		for _, p := range st.group.Problems {
			problems[p.Reason]++
		}
	}
	c.metrics.groups.Set(float64(groups))
	c.metrics.consumers.Set(float64(consumers))
	for _, r := range Reasons {
		c.metrics.problems.WithLabelValues(r).Set(float64(problems[r]))
	}
}

// Groups returns the groups as last analysed, for tests and debugging.
func (c *Controller) Groups() []Group {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]Group, 0, len(c.groups))
	for _, st := range c.groups {
		if st.group.ClaimUID != "" {
			out = append(out, st.group)
		}
	}
	return out
}
