package dashboard

import (
	"cmp"
	"context"
	"fmt"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/top"
)

// AllocationRanger reads the allocation over time from elsewhere than
// what the source saw (PrometheusUsage).
type AllocationRanger interface {
	Range(ctx context.Context, span time.Duration) (*Allocation, error)
}

// ClusterConfig is what a ClusterSource reads, with the user's own
// credentials.
type ClusterConfig struct {
	Client kubernetes.Interface
	// Dynamic reads the gpudra CRDs (GpuQueues, GpuReservations), as the
	// controller does; nil: no queues from them (a note says so).
	Dynamic dynamic.Interface
	// Namespace limits the namespaced objects (pods, claims,
	// reservations); "": all.
	Namespace string
	// FallbackNamespace is read when pods or claims are forbidden
	// cluster-wide (the kubeconfig context's namespace).
	FallbackNamespace string
	// Context names the kubeconfig context and user, for the header.
	Context string
	// Usage reads the live usage (nil: none) every UsageInterval (5 s).
	Usage         UsageReader
	UsageInterval time.Duration
	// Allocation, when set, gives the allocation over AllocationSpan
	// (default 6 h), read every minute; nil: what the source saw.
	Allocation     AllocationRanger
	AllocationSpan time.Duration
	// Debounce is how long a rebuild waits for more changes (200 ms).
	Debounce time.Duration
	// SyncTimeout bounds the wait for the informers' first lists (30 s);
	// what has not synced by then is a note, and still watched.
	SyncTimeout time.Duration
	// Now is the clock (time.Now when nil).
	Now func() time.Time
}

// ClusterSource keeps the View of a cluster: informers on the user's
// client (one watch per resource, whatever the number of viewers), a
// rebuild after each change, debounced, and the usage read on its own
// clock. It writes nothing to the cluster.
type ClusterSource struct {
	cfg  ClusterConfig
	pub  *Publisher
	hist *History
	kick chan struct{}

	mu         sync.Mutex
	stores     clusterStores
	notes      []string // what could not be watched, fixed once Run started
	usage      map[string]*top.Snapshot
	usageNotes []string
	allocation *Allocation
	allocNote  string
}

// clusterStores are the informers' stores; nil: not watched.
type clusterStores struct {
	nodes, slices, classes, queues cache.Store
	pods, claims, reservations     []cache.Store // one per namespace watched
	// The engines' objects, where served and readable (workloads.go).
	rayClusters, rayJobs, kueueWorkloads, localQueues []cache.Store
	// podsNamespace and claimsNamespace are the namespace pods and claims
	// are watched in ("": all).
	podsNamespace, claimsNamespace string
}

// NewClusterSource returns the source; Run starts it. Until the first
// build its View says it is reading the cluster.
func NewClusterSource(cfg ClusterConfig) *ClusterSource {
	if cfg.UsageInterval <= 0 {
		cfg.UsageInterval = 5 * time.Second
	}
	if cfg.Debounce <= 0 {
		cfg.Debounce = 200 * time.Millisecond
	}
	if cfg.SyncTimeout <= 0 {
		cfg.SyncTimeout = 30 * time.Second
	}
	if cfg.AllocationSpan <= 0 {
		cfg.AllocationSpan = DefaultHistorySpan
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	initial := &View{Mode: "cluster", At: cfg.Now(), Context: cfg.Context, Domains: []Domain{}, Queues: []Queue{},
		Allocation: Allocation{Source: "seen", Series: []AllocationSeries{}},
		Filters:    Filters{States: []string{StateFree, StatePartial, StateAllocated, StateBlocked, StateUnhealthy}},
		Notes:      []string{"reading the cluster..."}}
	return &ClusterSource{cfg: cfg, pub: NewPublisher(initial), hist: NewHistory(0, 0), kick: make(chan struct{}, 1)}
}

// Current implements Source.
func (s *ClusterSource) Current() (*View, <-chan struct{}) { return s.pub.Current() }

// watchable says how a resource may be watched: its List in the scope is
// tried once (Limit 1). Forbidden or not served is a note, and the
// resource is not watched: never shown as empty.
func watchable(ctx context.Context, what, scope string, list func(context.Context, metav1.ListOptions) error) (bool, string) {
	err := list(ctx, metav1.ListOptions{Limit: 1})
	switch {
	case err == nil:
		return true, ""
	case apierrors.IsForbidden(err):
		return false, fmt.Sprintf("%s%s: forbidden", what, scope)
	case apierrors.IsNotFound(err) || meta.IsNoMatchError(err):
		return false, fmt.Sprintf("%s: not served by this cluster", what)
	default:
		return false, fmt.Sprintf("%s%s: %v", what, scope, err)
	}
}

func scopeOf(ns string) string {
	if ns == "" {
		return " (all namespaces)"
	}
	return " in namespace " + ns
}

// stripManaged keeps the informers' memory to what Build reads.
func stripManaged(obj any) (any, error) {
	if m, ok := obj.(metav1.Object); ok {
		m.SetManagedFields(nil)
	}
	return obj, nil
}

// Run watches until ctx is done; it returns an error only when nothing
// can be watched.
func (s *ClusterSource) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx).WithName("dashboard")
	ctx = klog.NewContext(ctx, logger)
	c := s.cfg.Client
	var notes []string
	var informersToSync []cache.InformerSynced
	factories := map[string]informers.SharedInformerFactory{}
	factory := func(ns string) informers.SharedInformerFactory {
		f := factories[ns]
		if f == nil {
			f = informers.NewSharedInformerFactoryWithOptions(c, 0, informers.WithNamespace(ns), informers.WithTransform(stripManaged))
			factories[ns] = f
		}
		return f
	}
	watch := func(inf cache.SharedIndexInformer) cache.Store {
		if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
			AddFunc: func(any) { s.changed() }, UpdateFunc: func(any, any) { s.changed() }, DeleteFunc: func(any) { s.changed() },
		}); err != nil {
			logger.Error(err, "Add event handler")
		}
		informersToSync = append(informersToSync, inf.HasSynced)
		return inf.GetStore()
	}
	var st clusterStores
	// The cluster-scoped resources: each watched, or a note of what its
	// absence hides.
	cl := factory("")
	for _, r := range []struct {
		what  string
		list  func(context.Context, metav1.ListOptions) error
		inf   func() cache.SharedIndexInformer // made only if watchable: a factory starts every informer it made
		into  *cache.Store
		hides string
	}{
		{"nodes", func(ctx context.Context, o metav1.ListOptions) error {
			_, err := c.CoreV1().Nodes().List(ctx, o)
			return err
		},
			func() cache.SharedIndexInformer { return cl.Core().V1().Nodes().Informer() }, &st.nodes, "device-plugin nodes are not shown, and nodes only through their devices"},
		{"ResourceSlices", func(ctx context.Context, o metav1.ListOptions) error {
			_, err := c.ResourceV1().ResourceSlices().List(ctx, o)
			return err
		},
			func() cache.SharedIndexInformer { return cl.Resource().V1().ResourceSlices().Informer() }, &st.slices, "you see only the devices of the claims you can read, free devices not at all"},
		{"DeviceClasses", func(ctx context.Context, o metav1.ListOptions) error {
			_, err := c.ResourceV1().DeviceClasses().List(ctx, o)
			return err
		},
			func() cache.SharedIndexInformer { return cl.Resource().V1().DeviceClasses().Informer() }, &st.classes, "no class filter"},
	} {
		if ok, note := watchable(ctx, r.what, "", r.list); ok {
			*r.into = watch(r.inf())
		} else {
			notes = append(notes, note+": "+r.hides)
		}
	}
	// Pods and claims: cluster-wide (or the namespace asked), else the
	// fallback namespace.
	for _, r := range []struct {
		what  string
		list  func(ns string) func(context.Context, metav1.ListOptions) error
		inf   func(f informers.SharedInformerFactory) cache.SharedIndexInformer
		into  *[]cache.Store
		hides string
	}{
		{"pods", func(ns string) func(context.Context, metav1.ListOptions) error {
			return func(ctx context.Context, o metav1.ListOptions) error {
				_, err := c.CoreV1().Pods(ns).List(ctx, o)
				return err
			}
		}, func(f informers.SharedInformerFactory) cache.SharedIndexInformer {
			return f.Core().V1().Pods().Informer()
		}, &st.pods,
			"holders show without their pods' gangs, and no gang or pending pod waits"},
		{"ResourceClaims", func(ns string) func(context.Context, metav1.ListOptions) error {
			return func(ctx context.Context, o metav1.ListOptions) error {
				_, err := c.ResourceV1().ResourceClaims(ns).List(ctx, o)
				return err
			}
		}, func(f informers.SharedInformerFactory) cache.SharedIndexInformer {
			return f.Resource().V1().ResourceClaims().Informer()
		}, &st.claims, "no device shows as free or held: state unknown"},
	} {
		ns := s.cfg.Namespace
		ok, note := watchable(ctx, r.what, scopeOf(ns), r.list(ns))
		if !ok && ns == "" && s.cfg.FallbackNamespace != "" {
			if ok2, note2 := watchable(ctx, r.what, scopeOf(s.cfg.FallbackNamespace), r.list(s.cfg.FallbackNamespace)); ok2 {
				ns, ok = s.cfg.FallbackNamespace, true
				note = fmt.Sprintf("%s: forbidden in all namespaces: showing namespace %s only", r.what, ns)
			} else {
				note += "; " + note2
			}
		}
		if !ok {
			notes = append(notes, note+": "+r.hides)
			continue
		}
		if note != "" {
			notes = append(notes, note)
		}
		*r.into = append(*r.into, watch(r.inf(factory(ns))))
		switch r.into {
		case &st.pods:
			st.podsNamespace = ns
		case &st.claims:
			st.claimsNamespace = ns
		}
	}
	if st.claimsNamespace != "" {
		notes = append(notes, fmt.Sprintf("ResourceClaims read in namespace %s only: a device no claim there holds shows as unknown, not free", st.claimsNamespace))
	}
	var dynFactories []dynamicinformer.DynamicSharedInformerFactory
	if s.cfg.Dynamic == nil {
		notes = append(notes, "GpuQueues and GpuReservations: not read (no client for them): queues show only gangs and pending pods")
	} else {
		dyn := s.cfg.Dynamic
		if ok, note := watchable(ctx, "GpuQueues", "", func(ctx context.Context, o metav1.ListOptions) error {
			_, err := dyn.Resource(gpudrav1.GpuQueues).List(ctx, o)
			return err
		}); ok {
			f := dynamicinformer.NewDynamicSharedInformerFactory(dyn, 0)
			dynFactories = append(dynFactories, f)
			st.queues = watch(f.ForResource(gpudrav1.GpuQueues).Informer())
		} else {
			notes = append(notes, note+": queues show without their policies")
		}
		ns := s.cfg.Namespace
		ok, note := watchable(ctx, "GpuReservations", scopeOf(ns), func(ctx context.Context, o metav1.ListOptions) error {
			_, err := dyn.Resource(gpudrav1.GpuReservations).Namespace(ns).List(ctx, o)
			return err
		})
		if !ok && ns == "" && s.cfg.FallbackNamespace != "" {
			if ok2, _ := watchable(ctx, "GpuReservations", "", func(ctx context.Context, o metav1.ListOptions) error {
				_, err := dyn.Resource(gpudrav1.GpuReservations).Namespace(s.cfg.FallbackNamespace).List(ctx, o)
				return err
			}); ok2 {
				ns, ok = s.cfg.FallbackNamespace, true
				notes = append(notes, fmt.Sprintf("GpuReservations: forbidden in all namespaces: showing namespace %s only", ns))
			}
		}
		if ok {
			f := dynamicinformer.NewFilteredDynamicSharedInformerFactory(dyn, 0, ns, nil)
			dynFactories = append(dynFactories, f)
			st.reservations = append(st.reservations, watch(f.ForResource(gpudrav1.GpuReservations).Informer()))
		} else {
			notes = append(notes, note+": no reservation shows as waiting")
		}
	}
	engineFactories, engineNotes := s.watchEngines(ctx, &st, watch)
	dynFactories = append(dynFactories, engineFactories...)
	notes = append(notes, engineNotes...)
	if pu, ok := s.cfg.Usage.(*PluginProxyUsage); ok && pu.Pods == nil {
		// The plugin pods from the pods informer, where it watches their
		// namespace: no List of them every read.
		pu.Pods = pluginPodsFrom(&st, pu)
	}
	if len(informersToSync) == 0 {
		return fmt.Errorf("dashboard: nothing can be watched with these credentials: %v", notes)
	}
	s.mu.Lock()
	s.stores, s.notes = st, notes
	s.mu.Unlock()

	for _, f := range factories {
		f.Start(ctx.Done())
		defer f.Shutdown()
	}
	for _, f := range dynFactories {
		f.Start(ctx.Done())
		defer f.Shutdown()
	}
	syncCtx, cancel := context.WithTimeout(ctx, s.cfg.SyncTimeout)
	synced := cache.WaitForCacheSync(syncCtx.Done(), informersToSync...)
	cancel()
	if ctx.Err() != nil {
		return nil
	}
	if !synced {
		s.mu.Lock()
		s.notes = append(s.notes, fmt.Sprintf("not everything was listed within %s: the view fills in as it arrives", s.cfg.SyncTimeout))
		s.mu.Unlock()
	}
	logger.V(2).Info("Dashboard informers started", "synced", synced, "notes", notes)

	var wg sync.WaitGroup
	defer wg.Wait()
	if s.cfg.Usage != nil {
		wg.Go(func() { s.readUsage(ctx) })
	}
	if s.cfg.Allocation != nil {
		wg.Go(func() { s.readAllocation(ctx) })
	}
	s.publish()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-s.kick:
		}
		// More changes within the debounce are one rebuild: a rollout of
		// 1,000 pods is not 1,000 Views.
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(s.cfg.Debounce):
		}
		select {
		case <-s.kick:
		default:
		}
		s.publish()
	}
}

// changed asks for a rebuild (at most one pending).
func (s *ClusterSource) changed() {
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// readUsage reads the usage every interval, independent of the viewers.
func (s *ClusterSource) readUsage(ctx context.Context) {
	t := time.NewTicker(s.cfg.UsageInterval)
	defer t.Stop()
	for {
		s.mu.Lock()
		nodes := nodeNames(s.stores)
		s.mu.Unlock()
		rctx, cancel := context.WithTimeout(ctx, max(s.cfg.UsageInterval, time.Second))
		usage, notes := s.cfg.Usage.Read(rctx, nodes)
		cancel()
		if ctx.Err() != nil {
			return
		}
		s.hist.RecordUsage(usage)
		s.mu.Lock()
		s.usage, s.usageNotes = usage, notes
		s.mu.Unlock()
		s.changed()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// readAllocation reads the allocation over time every minute.
func (s *ClusterSource) readAllocation(ctx context.Context) {
	t := time.NewTicker(time.Minute)
	defer t.Stop()
	for {
		a, err := s.cfg.Allocation.Range(ctx, s.cfg.AllocationSpan)
		if ctx.Err() != nil {
			return
		}
		s.mu.Lock()
		if err != nil {
			// The last good one stays; the note says it is old.
			s.allocNote = "allocation over time: " + err.Error()
		} else {
			s.allocation, s.allocNote = a, ""
		}
		s.mu.Unlock()
		s.changed()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// nodeNames are the nodes the usage is read for: those with gpudra's
// slices, else all nodes watched; none (all the reader finds) when
// neither is watched.
func nodeNames(st clusterStores) []string {
	seen := map[string]bool{}
	var out []string
	if st.slices != nil {
		for _, o := range st.slices.List() {
			if sl, ok := o.(*resourceapi.ResourceSlice); ok {
				if n := sliceNode(sl); !seen[n] {
					seen[n] = true
					out = append(out, n)
				}
			}
		}
	}
	// Device-plugin nodes publish no slices: their GPUs show only
	// through the usage read (and with no slices at all, every node is
	// asked).
	if st.nodes != nil {
		noSlices := len(out) == 0
		for _, o := range st.nodes.List() {
			n, ok := o.(*corev1.Node)
			if !ok || seen[n.Name] {
				continue
			}
			if q, dp := n.Status.Allocatable[DevicePluginResource]; noSlices || (dp && !q.IsZero()) {
				seen[n.Name] = true
				out = append(out, n.Name)
			}
		}
	}
	return out
}

// inputs gathers what Build reads from the stores.
func (s *ClusterSource) inputs() ClusterInputs {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.stores
	in := ClusterInputs{Now: s.cfg.Now(), Context: s.cfg.Context, Usage: s.usage, UsageSource: usageSourceOf(s.cfg.Usage),
		Spark: s.hist.Sparks(), Allocation: s.allocation}
	in.Notes = append(append([]string(nil), s.notes...), s.usageNotes...)
	if s.allocNote != "" {
		in.Notes = append(in.Notes, s.allocNote)
	}
	in.Nodes = storeList[*corev1.Node](st.nodes)
	in.Slices = storeList[*resourceapi.ResourceSlice](st.slices)
	in.DeviceClasses = storeList[*resourceapi.DeviceClass](st.classes)
	for _, p := range st.pods {
		in.Pods = append(in.Pods, storeList[*corev1.Pod](p)...)
	}
	for _, c := range st.claims {
		in.Claims = append(in.Claims, storeList[*resourceapi.ResourceClaim](c)...)
	}
	in.ClaimsPartial = len(st.claims) == 0 || st.claimsNamespace != ""
	for _, e := range []struct {
		from []cache.Store
		into *[]*unstructured.Unstructured
	}{
		{st.rayClusters, &in.Workloads.RayClusters}, {st.rayJobs, &in.Workloads.RayJobs},
		{st.kueueWorkloads, &in.Workloads.KueueWorkloads}, {st.localQueues, &in.Workloads.LocalQueues},
	} {
		for _, store := range e.from {
			*e.into = append(*e.into, storeList[*unstructured.Unstructured](store)...)
		}
	}
	var bad int
	in.Queues, bad = decoded[gpudrav1.GpuQueue](st.queues)
	for _, r := range st.reservations {
		rs, b := decoded[gpudrav1.GpuReservation](r)
		in.Reservations, bad = append(in.Reservations, rs...), bad+b
	}
	if bad > 0 {
		in.Notes = append(in.Notes, fmt.Sprintf("%d gpudra objects could not be read (a CRD version this gpudra does not know)", bad))
	}
	return in
}

func usageSourceOf(r UsageReader) string {
	switch r.(type) {
	case *PluginProxyUsage:
		return "plugin"
	case *PrometheusUsage:
		return "prometheus"
	default:
		return ""
	}
}

func storeList[T any](st cache.Store) []T {
	if st == nil {
		return nil
	}
	objs := st.List()
	out := make([]T, 0, len(objs))
	for _, o := range objs {
		if t, ok := o.(T); ok {
			out = append(out, t)
		}
	}
	return out
}

// decoded converts the dynamic informer's objects; fields this gpudra
// does not know are left out (a newer CRD must not blank the page).
func decoded[T any](st cache.Store) ([]*T, int) {
	if st == nil {
		return nil, 0
	}
	var out []*T
	bad := 0
	for _, o := range st.List() {
		u, ok := o.(*unstructured.Unstructured)
		if !ok {
			bad++
			continue
		}
		t := new(T)
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, t); err != nil {
			bad++
			continue
		}
		out = append(out, t)
	}
	return out, bad
}

// publish builds and publishes the View, recording its allocation in the
// seen history.
func (s *ClusterSource) publish() {
	in := s.inputs()
	v := Build(in)
	s.hist.Observe(v)
	if in.Allocation == nil {
		v.Allocation = s.hist.Allocation()
	}
	s.pub.Publish(v)
}

// pluginPodsFrom lists the plugin pods from the pods informer when it
// watches their namespace (every namespace, when theirs is to be found);
// nil otherwise (the reader lists them).
func pluginPodsFrom(st *clusterStores, pu *PluginProxyUsage) func() []*corev1.Pod {
	if len(st.pods) == 0 || (st.podsNamespace != "" && (pu.Namespace == "" || st.podsNamespace != pu.Namespace)) {
		return nil
	}
	selector, err := labels.Parse(cmp.Or(pu.Selector, DefaultPluginSelector))
	if err != nil {
		return nil
	}
	store := st.pods[0]
	return func() []*corev1.Pod {
		var out []*corev1.Pod
		for _, p := range storeList[*corev1.Pod](store) {
			if (pu.Namespace == "" || p.Namespace == pu.Namespace) && selector.Matches(labels.Set(p.Labels)) {
				out = append(out, p)
			}
		}
		return out
	}
}
