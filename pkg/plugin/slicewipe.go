package plugin

import (
	"context"
	"slices"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// republishOnWipe publishes the node's ResourceSlices again as soon as one
// of them is deleted. A starting kubelet deletes every ResourceSlice of its
// node (the DRA plugin manager's wipe at startup: no driver has registered
// with it yet), and the kubeletplugin helper's ResourceSlice controller
// would put them back only after its sync delay, 30 s, which the helper
// does not let a driver change: for that long no claim can be allocated
// on the node, though the plugin is up (measured on devcluster's real
// node: 27.8 s after the kubelet restarted). A publish through the queue
// makes the controller sync the pool at once; one for a deletion the
// controller made itself (a pool that shrank) finds nothing to change.
//
// The watch is of this node's slices of this driver only (field
// selectors), so it costs one watch per node and an event per own slice.
// It returns when the watch has started; synced says when it has listed.
func (d *Driver) republishOnWipe(ctx context.Context, client kubernetes.Interface, node string) (synced cache.InformerSynced, err error) {
	selector := fields.Set{resourceapi.ResourceSliceSelectorNodeName: node, resourceapi.ResourceSliceSelectorDriver: slicebuilder.DriverName}.String()
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
			opts.FieldSelector = selector
			return client.ResourceV1().ResourceSlices().List(ctx, opts)
		},
		WatchFuncWithContext: func(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
			opts.FieldSelector = selector
			return client.ResourceV1().ResourceSlices().Watch(ctx, opts)
		},
	}
	// Wrapped as generated informers are: a client without watch-list
	// support (a fake) is listed, not streamed.
	informer := cache.NewSharedIndexInformer(cache.ToListWatcherWithWatchListSemantics(lw, client), &resourceapi.ResourceSlice{}, 0, cache.Indexers{})
	own := func(obj any) bool {
		s, ok := obj.(*resourceapi.ResourceSlice)
		// The selectors hold the watch to the node's own; an API server
		// that ignored them must not make every node publish for every
		// other.
		return ok && s.Spec.NodeName != nil && *s.Spec.NodeName == node && s.Spec.Driver == slicebuilder.DriverName
	}
	wiped := make(chan struct{}, 1)
	_, err = informer.AddEventHandler(cache.ResourceEventHandlerFuncs{DeleteFunc: func(obj any) {
		if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
			obj = tomb.Obj
		}
		if !own(obj) {
			return
		}
		klog.FromContext(ctx).Info("A ResourceSlice of this node was deleted; publishing again", "slice", obj.(*resourceapi.ResourceSlice).Name)
		d.metrics.sliceWipe()
		select {
		case wiped <- struct{}{}:
		default:
		}
	}})
	if err != nil {
		return nil, err
	}
	go informer.RunWithContext(ctx)
	listed := func() bool {
		return slices.ContainsFunc(informer.GetStore().List(), own)
	}
	go func() {
		if !cache.WaitForCacheSync(ctx.Done(), informer.HasSynced) {
			return
		}
		// A wipe between the first publish and the watch's start sends
		// no event: a listed store without any of the node's slices is
		// one.
		if !listed() {
			klog.FromContext(ctx).Info("None of this node's ResourceSlices is listed; publishing again")
			d.publishUntilListed(ctx, listed)
		}
		for {
			select {
			case <-ctx.Done():
				return
			case <-wiped:
				d.publishUntilListed(ctx, listed)
			}
		}
	}()
	return informer.HasSynced, nil
}

// publishUntilListed publishes until a slice of the node is listed again,
// at most republishAttempts times, waiting longer each time. One publish
// may come too early: the helper's controller finds its own informer still
// holding the deleted slices, changes nothing, and then waits its sync
// delay (measured: 25.9 s once on the real node, where one publish came
// before its informer saw the wipe).
func (d *Driver) publishUntilListed(ctx context.Context, listed func() bool) {
	delay := republishCheckFirst
	for range republishAttempts {
		d.republish(ctx)
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
		if listed() {
			return
		}
		delay = min(2*delay, republishCheckMax)
	}
	klog.FromContext(ctx).Info("The node's ResourceSlices are not listed again after publishing; the helper's controller will", "attempts", republishAttempts)
}

// After a wipe: publish, look again after 250 ms, 500 ms, ... up to 4 s
// apart, 8 times at most (about 20 s, under the helper's 30 s delay).
const (
	republishCheckFirst = 250 * time.Millisecond
	republishCheckMax   = 4 * time.Second
	republishAttempts   = 8
)
