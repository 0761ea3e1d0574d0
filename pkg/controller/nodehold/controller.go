package nodehold

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/metadata/metadatainformer"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/allocator"
)

// Nodes is the resource the controller watches (metadata only) and patches.
var Nodes = corev1.SchemeGroupVersion.WithResource("nodes")

// FieldManager names the controller's node patches.
const FieldManager = "gpudra-controller"

// Options are what the controller needs.
type Options struct {
	// Client watches ResourceClaims; Metadata watches and patches Nodes.
	Client   kubernetes.Interface
	Metadata metadata.Interface
	// Registerer receives the metrics; nil: none.
	Registerer prometheus.Registerer
	// Planned, when set, returns the claims of gangs being admitted on
	// the Workload API path with their planned allocations
	// (gang.Controller.HandedClaims); call Kick when they change.
	Planned func() []*resourceapi.ResourceClaim
	// Period: a round at least this often, whatever happens (retries of
	// failed writes come sooner); default 30 s.
	Period time.Duration
	// Gap: at least this long between rounds, so that a burst of claim
	// events costs one round; default 500 ms.
	Gap time.Duration
	// ReasonRefresh: a marked node's reason is rewritten at most this
	// often (marking and unmarking are never delayed); default 1 min.
	ReasonRefresh time.Duration
	// Now is the clock; nil: time.Now.
	Now func() time.Time
}

// Controller keeps the nodes' annotations; it runs on the leader only.
//
// Cost: it watches every ResourceClaim, and every Node as metadata only
// (kube-apiserver sends no spec or status), and keeps of a claim its name
// and the nodes of its gpu.gpudra.dev allocation (slimClaim), of a node its
// name and gpudra's four annotation keys (slimNode): under 1 KB per claim
// and per node (800 and 700 bytes measured). A round walks every cached
// claim and node once (O(claims + nodes), no API call; 3 ms over 10,000
// claims and 1,000 nodes, BenchmarkRound1000Nodes10kClaims), and patches only the
// nodes whose annotations must change: one merge patch when a node starts
// or stops holding devices, and at most one per ReasonRefresh while its
// claims change. Claim events that change no claim's nodes, and node
// events that change none of gpudra's keys, run no round.
type Controller struct {
	opts    Options
	metrics *metrics
	trigger chan struct{}
	claims  cache.Store
	nodes   cache.Store
	// lastWrite is when each node was last patched (round goroutine
	// only): the reason's rewrites are spaced by ReasonRefresh.
	lastWrite map[string]time.Time
	// failures counts rounds in a row with a failed write: the next round
	// comes after a backoff.
	failures int
}

// New returns a controller; Run starts it.
func New(opts Options) (*Controller, error) {
	if opts.Client == nil || opts.Metadata == nil {
		return nil, errors.New("node hold controller: no API client")
	}
	if opts.Period == 0 {
		opts.Period = 30 * time.Second
	}
	if opts.Gap == 0 {
		opts.Gap = 500 * time.Millisecond
	}
	if opts.ReasonRefresh == 0 {
		opts.ReasonRefresh = time.Minute
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	m, err := newMetrics(opts.Registerer)
	if err != nil {
		return nil, err
	}
	return &Controller{opts: opts, metrics: m, trigger: make(chan struct{}, 1), lastWrite: map[string]time.Time{}}, nil
}

// Kick asks for a round soon.
func (c *Controller) Kick() {
	select {
	case c.trigger <- struct{}{}:
	default:
	}
}

// Run watches until ctx is done.
func (c *Controller) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx).WithName("nodehold")
	ctx = klog.NewContext(ctx, logger)
	typed := informers.NewSharedInformerFactoryWithOptions(c.opts.Client, 0, informers.WithTransform(slimClaim))
	claimInf := typed.Resource().V1().ResourceClaims().Informer()
	meta := metadatainformer.NewSharedInformerFactory(c.opts.Metadata, 0)
	nodeInf := meta.ForResource(Nodes).Informer()
	if err := nodeInf.SetTransform(slimNode); err != nil {
		return fmt.Errorf("node hold controller: transform: %w", err)
	}
	c.claims, c.nodes = claimInf.GetStore(), nodeInf.GetStore()
	if _, err := claimInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			if cl, ok := obj.(*resourceapi.ResourceClaim); ok && len(ClaimNodes(cl)) > 0 {
				c.Kick()
			}
		},
		UpdateFunc: func(old, cur any) {
			o, ok1 := old.(*resourceapi.ResourceClaim)
			n, ok2 := cur.(*resourceapi.ResourceClaim)
			if !ok1 || !ok2 || !slices.Equal(ClaimNodes(o), ClaimNodes(n)) {
				c.Kick()
			}
		},
		DeleteFunc: func(obj any) {
			if cl, ok := obj.(*resourceapi.ResourceClaim); !ok || len(ClaimNodes(cl)) > 0 {
				c.Kick()
			}
		},
	}); err != nil {
		return fmt.Errorf("node hold controller: event handler: %w", err)
	}
	if _, err := nodeInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(any) { c.Kick() },
		UpdateFunc: func(old, cur any) {
			o, ok1 := old.(*metav1.PartialObjectMetadata)
			n, ok2 := cur.(*metav1.PartialObjectMetadata)
			if !ok1 || !ok2 || !equalKeys(o.Annotations, n.Annotations) {
				c.Kick()
			}
		},
		DeleteFunc: func(any) { c.Kick() },
	}); err != nil {
		return fmt.Errorf("node hold controller: event handler: %w", err)
	}
	typed.Start(ctx.Done())
	meta.Start(ctx.Done())
	defer typed.Shutdown()
	defer meta.Shutdown()
	for typ, ok := range typed.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return fmt.Errorf("node hold controller: %v cache did not sync: %w", typ, ctx.Err())
		}
	}
	for gvr, ok := range meta.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return fmt.Errorf("node hold controller: %v cache did not sync: %w", gvr, ctx.Err())
		}
	}
	logger.Info("Keeping autoscalers off nodes that hold gpudra devices in use")
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-c.trigger:
		case <-timer.C:
		}
		next := c.Round(ctx)
		timer.Reset(next)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(c.opts.Gap):
		}
	}
}

// Round brings every cached node's annotations to what the cached claims
// (and the planned ones) say, and returns when the next round is due at
// the latest: sooner after a failed write (1 s, doubling, up to Period) or
// for a reason held back by ReasonRefresh. A failed write is logged,
// counted, and retried then.
func (c *Controller) Round(ctx context.Context) time.Duration {
	logger := klog.FromContext(ctx)
	claims := listClaims(c.claims)
	var planned []*resourceapi.ResourceClaim
	if c.opts.Planned != nil {
		planned = c.opts.Planned()
	}
	holds := NodesHeld(claims, planned)
	now := c.opts.Now()
	next := c.opts.Period
	failed, marked := false, 0
	seen := map[string]bool{}
	for _, obj := range c.nodes.List() {
		n, ok := obj.(*metav1.PartialObjectMetadata)
		if !ok {
			continue
		}
		seen[n.Name] = true
		hold := holds[n.Name]
		_, wasMarked := n.Annotations[Marker]
		ch := Marks(n.Annotations, hold)
		if len(ch) > 0 && ch.ReasonOnly(n.Annotations) {
			if wait := c.lastWrite[n.Name].Add(c.opts.ReasonRefresh).Sub(now); wait > 0 {
				next = min(next, wait)
				ch = nil
			}
		}
		if len(ch) == 0 {
			if wasMarked {
				marked++
			}
			continue
		}
		op := operation(wasMarked, hold != nil)
		err := patchNode(ctx, c.opts.Metadata, n.Name, ch)
		switch {
		case err == nil:
			c.lastWrite[n.Name] = now
			c.metrics.writes.WithLabelValues(op, "success").Inc()
			logger.V(2).Info("Node annotations written", "node", n.Name, "operation", op, "reason", reasonOf(hold))
			if hold != nil {
				marked++
			}
		case apierrors.IsNotFound(err):
			// Gone: nothing holds it any more.
		default:
			failed = true
			c.metrics.writes.WithLabelValues(op, "error").Inc()
			logger.Error(err, "Writing node annotations failed; retried", "node", n.Name, "operation", op)
			if wasMarked {
				marked++
			}
		}
	}
	for name := range c.lastWrite {
		if !seen[name] {
			delete(c.lastWrite, name)
		}
	}
	c.metrics.held.Set(float64(marked))
	if !failed {
		c.failures = 0
		return next
	}
	c.failures++
	return min(next, time.Second<<min(c.failures-1, 5))
}

func listClaims(store cache.Store) []*resourceapi.ResourceClaim {
	objs := store.List()
	claims := make([]*resourceapi.ResourceClaim, 0, len(objs))
	for _, obj := range objs {
		if cl, ok := obj.(*resourceapi.ResourceClaim); ok {
			claims = append(claims, cl)
		}
	}
	return claims
}

// Operations of gpudra_node_hold_writes_total.
const (
	opMark   = "mark"
	opUnmark = "unmark"
	opUpdate = "update"
)

func operation(wasMarked, held bool) string {
	switch {
	case !held:
		return opUnmark
	case wasMarked:
		return opUpdate
	default:
		return opMark
	}
}

func reasonOf(h *Hold) string {
	if h == nil {
		return ""
	}
	return h.Reason()
}

// patchNode writes a node's annotation changes as a JSON merge patch of
// metadata.annotations alone: nothing else of the node is sent, and
// annotations of other keys are left as they are.
func patchNode(ctx context.Context, md metadata.Interface, node string, ch Changes) error {
	data, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": ch}})
	if err != nil {
		return err
	}
	_, err = md.Resource(Nodes).Patch(ctx, node, types.MergePatchType, data, metav1.PatchOptions{FieldManager: FieldManager})
	if err != nil {
		return fmt.Errorf("patch node %s annotations: %w", node, err)
	}
	return nil
}

// Release removes gpudra's marks from every node (the controller turned
// off: a node it marked before would never be scaled down), the
// administrators' own annotations left as they are. It retries until every
// node is done or ctx ends, and returns how many it released.
func Release(ctx context.Context, md metadata.Interface) (int, error) {
	released := 0
	err := waitBackoff(ctx, func() (bool, error) {
		list, err := md.Resource(Nodes).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, fmt.Errorf("list nodes: %w", err)
		}
		var errs []error
		for i := range list.Items {
			n := &list.Items[i]
			if ch := Marks(n.Annotations, nil); len(ch) > 0 {
				if err := patchNode(ctx, md, n.Name, ch); err != nil && !apierrors.IsNotFound(err) {
					errs = append(errs, err)
					continue
				}
				released++
			}
		}
		return len(errs) == 0, errors.Join(errs...)
	})
	return released, err
}

// waitBackoff calls try until it is done, 1 s after a failure, doubling up
// to a minute, until ctx ends; it returns the last failure then.
func waitBackoff(ctx context.Context, try func() (bool, error)) error {
	delay := time.Second
	for {
		done, err := try()
		if done {
			return nil
		}
		klog.FromContext(ctx).Error(err, "Releasing gpudra's node marks failed; retried", "in", delay)
		select {
		case <-ctx.Done():
			return err
		case <-time.After(delay):
		}
		delay = min(2*delay, time.Minute)
	}
}

// slimClaim is the claim informer's transform: of a claim it keeps what
// NodesHeld reads, its name and one gpu.gpudra.dev allocation result (the
// driver and the pool, no device) per node it holds, so that a claim costs
// about 500 bytes however many devices it has.
func slimClaim(obj any) (any, error) {
	cl, ok := obj.(*resourceapi.ResourceClaim)
	if !ok {
		return obj, nil
	}
	out := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: cl.Namespace, Name: cl.Name, UID: cl.UID, ResourceVersion: cl.ResourceVersion}}
	if cl.Status.Allocation != nil {
		out.Status.Allocation = &resourceapi.AllocationResult{}
		for _, node := range ClaimNodes(cl) {
			out.Status.Allocation.Devices.Results = append(out.Status.Allocation.Devices.Results,
				resourceapi.DeviceRequestAllocationResult{Driver: allocator.DriverName, Pool: node})
		}
	}
	return out, nil
}

// slimNode is the node informer's transform: a node's name and gpudra's
// annotation keys, nothing else.
func slimNode(obj any) (any, error) {
	n, ok := obj.(*metav1.PartialObjectMetadata)
	if !ok {
		return obj, nil
	}
	out := &metav1.PartialObjectMetadata{TypeMeta: n.TypeMeta, ObjectMeta: metav1.ObjectMeta{Name: n.Name, UID: n.UID, ResourceVersion: n.ResourceVersion}}
	for _, k := range Keys {
		if v, ok := n.Annotations[k]; ok {
			if out.Annotations == nil {
				out.Annotations = map[string]string{}
			}
			out.Annotations[k] = v
		}
	}
	return out, nil
}

// equalKeys says whether two annotation maps agree on gpudra's keys.
func equalKeys(a, b map[string]string) bool {
	for _, k := range Keys {
		va, oka := a[k]
		vb, okb := b[k]
		if oka != okb || va != vb {
			return false
		}
	}
	return true
}
