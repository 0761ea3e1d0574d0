package plugin

import (
	"context"

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
	_, err = informer.AddEventHandler(cache.ResourceEventHandlerFuncs{DeleteFunc: func(obj any) {
		if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
			obj = tomb.Obj
		}
		s, ok := obj.(*resourceapi.ResourceSlice)
		// The selectors hold this to the node's own; an API server that
		// ignored them must not make every node publish for every other.
		if !ok || s.Spec.NodeName == nil || *s.Spec.NodeName != node || s.Spec.Driver != slicebuilder.DriverName {
			return
		}
		klog.FromContext(ctx).Info("A ResourceSlice of this node was deleted; publishing again", "slice", s.Name)
		d.metrics.sliceWipe()
		d.republish(ctx)
	}})
	if err != nil {
		return nil, err
	}
	go informer.RunWithContext(ctx)
	// A wipe between the first publish and the watch's start sends no
	// event: a listed store without any of the node's slices is one.
	go func() {
		if !cache.WaitForCacheSync(ctx.Done(), informer.HasSynced) {
			return
		}
		for _, obj := range informer.GetStore().List() {
			if s, ok := obj.(*resourceapi.ResourceSlice); ok && s.Spec.NodeName != nil && *s.Spec.NodeName == node && s.Spec.Driver == slicebuilder.DriverName {
				return
			}
		}
		klog.FromContext(ctx).Info("None of this node's ResourceSlices is listed; publishing again")
		d.republish(ctx)
	}()
	return informer.HasSynced, nil
}
