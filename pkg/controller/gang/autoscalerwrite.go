package gang

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// Autoscaler demand modes (Options.AutoscalerDemand, --autoscaler-demand).
const (
	// AutoscalerDemandCapacityBuffers publishes the demand of items waiting
	// for devices as CapacityBuffers where the API server serves them.
	AutoscalerDemandCapacityBuffers = "capacitybuffers"
	// AutoscalerDemandOff publishes nothing and calls no buffer API.
	AutoscalerDemandOff = "off"
)

// How often the publisher asks discovery whether CapacityBuffers are
// served: every minute, and every 10 s while discovery fails.
var (
	demandCheckEvery   = time.Minute
	demandRecheckEvery = 10 * time.Second
)

// demandStores are the informers' view of the demand objects that exist
// (selected by LabelDemandFor).
type demandStores struct {
	buffers, templates, claims cache.Store
	synced                     func() bool
	stop                       func()
}

// demandPublisher writes the demand that wantedDemand decides and takes it
// back. Its memory is the API: the informers show what exists, whoever
// made it, so a new leader takes back what an earlier one published.
// Only the round's goroutine uses it.
type demandPublisher struct {
	disc    discovery.DiscoveryInterface
	client  kubernetes.Interface
	dynamic dynamic.Interface
	metrics *metrics
	now     func() time.Time
	// start starts the informers once the API is served (tests replace
	// it with stand-ins).
	start func(ctx context.Context) *demandStores

	// served is discovery's last answer (kept while discovery cannot
	// tell); checked: discovery has answered once.
	served, checked bool
	nextCheck       time.Time
	stores          *demandStores
}

func newDemandPublisher(opts Options, m *metrics) *demandPublisher {
	p := &demandPublisher{disc: opts.Discovery, client: opts.Client, dynamic: opts.Dynamic, metrics: m, now: opts.Now}
	if p.disc == nil {
		p.disc = opts.Client.Discovery()
	}
	p.start = p.startInformers
	return p
}

// active says whether demand can be written and taken back now: discovery
// said CapacityBuffers are served (its last answer: "could not tell" is
// never "absent", and never "served" before a first answer) and the
// informers show what exists. Discovery is asked here, at most every
// demandCheckEvery.
func (p *demandPublisher) active(ctx context.Context) bool {
	if p == nil {
		return false
	}
	if now := p.now(); !now.Before(p.nextCheck) {
		p.check(ctx, now)
	}
	return p.served && p.stores != nil && p.stores.synced()
}

// check asks discovery and starts or stops the informers on a change.
func (p *demandPublisher) check(ctx context.Context, now time.Time) {
	logger := klog.FromContext(ctx)
	list, err := p.disc.ServerResourcesForGroupVersion(CapacityBuffers.GroupVersion().String())
	served := err == nil && slices.ContainsFunc(list.APIResources, func(r metav1.APIResource) bool { return r.Name == CapacityBuffers.Resource })
	if err != nil && !apierrors.IsNotFound(err) {
		p.metrics.demandDiscoveryFailures.Inc()
		p.nextCheck = now.Add(demandRecheckEvery)
		logger.Error(err, "API discovery could not tell whether CapacityBuffers are served: autoscaler demand stays as it was", "served", p.served, "decided", p.checked)
		return
	}
	p.nextCheck = now.Add(demandCheckEvery)
	if p.checked && served == p.served {
		return
	}
	p.checked, p.served = true, served
	logger.Info("Autoscaler demand", "capacityBuffers", served)
	switch {
	case served && p.stores == nil:
		p.stores = p.start(ctx)
	case !served && p.stores != nil:
		p.stores.stop()
		p.stores = nil
		p.metrics.demandBuffers.Set(0)
	}
}

// startInformers watches the demand objects, by label.
func (p *demandPublisher) startInformers(ctx context.Context) *demandStores {
	ctx, cancel := context.WithCancel(ctx)
	selected := func(o *metav1.ListOptions) { o.LabelSelector = LabelDemandFor }
	dyn := dynamicinformer.NewFilteredDynamicSharedInformerFactory(p.dynamic, 0, metav1.NamespaceAll, selected)
	typed := informers.NewSharedInformerFactoryWithOptions(p.client, 0, informers.WithTweakListOptions(selected))
	buffers := dyn.ForResource(CapacityBuffers).Informer()
	templates := typed.Core().V1().PodTemplates().Informer()
	claims := typed.Resource().V1().ResourceClaims().Informer()
	dyn.Start(ctx.Done())
	typed.Start(ctx.Done())
	return &demandStores{
		buffers: buffers.GetStore(), templates: templates.GetStore(), claims: claims.GetStore(),
		synced: func() bool { return buffers.HasSynced() && templates.HasSynced() && claims.HasSynced() },
		stop: func() {
			cancel()
			dyn.Shutdown()
			typed.Shutdown()
		},
	}
}

// existing are the demand objects the informers show.
func (p *demandPublisher) existing() []demandObject {
	var out []demandObject
	add := func(resource string, store cache.Store) {
		for _, obj := range store.List() {
			m, ok := obj.(metav1.Object)
			if !ok {
				continue
			}
			o := demandObject{resource: resource, namespace: m.GetNamespace(), name: m.GetName(), uid: m.GetUID(), labels: m.GetLabels()}
			if refs := m.GetOwnerReferences(); len(refs) > 0 {
				o.owner = refs[0].UID
			}
			out = append(out, o)
		}
	}
	add(resourceCapacityBuffers, p.stores.buffers)
	add(resourcePodTemplates, p.stores.templates)
	add(resourceClaims, p.stores.claims)
	return out
}

// publish makes what exists what is wanted: it deletes the demand of items
// that no longer wait for devices (admitted, deleted, or waiting for
// something else), then creates the missing. Nothing is written unless
// active.
func (p *demandPublisher) publish(ctx context.Context, wanted map[string]*demandUnit) error {
	if !p.active(ctx) {
		return nil
	}
	remove, create := demandChanges(p.existing(), wanted)
	errs := []error{p.delete(ctx, remove)}
	for _, u := range create {
		errs = append(errs, p.create(ctx, u))
	}
	p.metrics.demandBuffers.Set(float64(len(wanted)))
	return errors.Join(errs...)
}

// takeBack deletes an item's demand, before the item's allocation is
// written or the gang handed over: the autoscaler must not keep capacity
// for demand that becomes real pods. An error means some of it may remain:
// the caller does not admit the item this round.
func (p *demandPublisher) takeBack(ctx context.Context, it *item) error {
	if !p.active(ctx) {
		return nil
	}
	kind, name := demandKindGang, ""
	switch it.kind {
	case KindGang:
		name = it.gang.Name
	case KindReservation:
		kind, name = demandKindReservation, it.res.Name
	}
	want := demandItemLabels(kind, name)
	var mine []demandObject
	for _, o := range p.existing() {
		if o.namespace == it.Namespace && o.labels[LabelDemandFor] == want[LabelDemandFor] && o.labels[LabelDemandKind] == kind {
			mine = append(mine, o)
		}
	}
	if len(mine) > 0 {
		klog.FromContext(ctx).V(2).Info("Taking back autoscaler demand before admitting", "item", it.Key, "objects", len(mine))
	}
	return p.delete(ctx, mine)
}

// delete deletes demand objects: buffers first, so that the autoscaler
// drops their virtual pods before their templates and claims go. A
// deletion the object is gone for already succeeds.
func (p *demandPublisher) delete(ctx context.Context, objs []demandObject) error {
	order := map[string]int{resourceCapacityBuffers: 0, resourcePodTemplates: 1, resourceClaims: 2}
	slices.SortStableFunc(objs, func(a, b demandObject) int { return order[a.resource] - order[b.resource] })
	var errs []error
	for _, o := range objs {
		opts := metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &o.uid}}
		var err error
		switch o.resource {
		case resourceCapacityBuffers:
			err = p.dynamic.Resource(CapacityBuffers).Namespace(o.namespace).Delete(ctx, o.name, opts)
		case resourcePodTemplates:
			err = p.client.CoreV1().PodTemplates(o.namespace).Delete(ctx, o.name, opts)
		case resourceClaims:
			err = p.client.ResourceV1().ResourceClaims(o.namespace).Delete(ctx, o.name, opts)
		}
		if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			p.metrics.demandWriteFailures.WithLabelValues("delete").Inc()
			errs = append(errs, fmt.Errorf("delete autoscaler demand %s %s/%s: %w", o.resource, o.namespace, o.name, err))
		}
	}
	return errors.Join(errs...)
}

// create creates a unit's objects: its claims and template before the
// buffer that names them, so that the autoscaler resolves the buffer at
// once. An object that exists already (the informer lags) is no error.
func (p *demandPublisher) create(ctx context.Context, u *demandUnit) error {
	var errs []error
	failed := func(what string, err error) {
		if err != nil && !apierrors.IsAlreadyExists(err) {
			p.metrics.demandWriteFailures.WithLabelValues("create").Inc()
			errs = append(errs, fmt.Errorf("create autoscaler demand %s: %w", what, err))
		}
	}
	for _, c := range u.claims {
		_, err := p.client.ResourceV1().ResourceClaims(c.Namespace).Create(ctx, c, metav1.CreateOptions{})
		failed("claim "+c.Namespace+"/"+c.Name, err)
	}
	_, err := p.client.CoreV1().PodTemplates(u.template.Namespace).Create(ctx, u.template, metav1.CreateOptions{})
	failed("PodTemplate "+u.template.Namespace+"/"+u.template.Name, err)
	if len(errs) > 0 {
		return errors.Join(errs...) // no buffer naming what is not there
	}
	_, err = p.dynamic.Resource(CapacityBuffers).Namespace(u.buffer.GetNamespace()).Create(ctx, u.buffer, metav1.CreateOptions{})
	failed("CapacityBuffer "+u.buffer.GetNamespace()+"/"+u.buffer.GetName(), err)
	return errors.Join(errs...)
}
