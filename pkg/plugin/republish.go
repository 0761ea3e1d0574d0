package plugin

import (
	"context"
	"time"

	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
)

// Republishing goes through a rate-limited work queue with a single key:
// a publish that fails (an NVML read that failed for a moment, the API
// server away) is retried with exponential backoff until one succeeds, so
// that an unhealthy GPU's taint is never lost to one failure; and changes
// that come while a publish runs fold into one more publish, as the queue
// holds the key once.
const republishKey = "resourceslices"

// Backoff between failed publishes: doubling from the first to the last.
const (
	republishRetryFirst = 250 * time.Millisecond
	republishRetryMax   = 30 * time.Second
)

// republisher is the queue and its worker.
type republisher struct {
	queue workqueue.TypedRateLimitingInterface[string]
	// stop cancels the worker; done is closed when it has returned.
	stop context.CancelFunc
	done chan struct{}
}

func newRepublisher() *republisher {
	return &republisher{queue: workqueue.NewTypedRateLimitingQueueWithConfig(
		workqueue.NewTypedItemExponentialFailureRateLimiter[string](republishRetryFirst, republishRetryMax),
		workqueue.TypedRateLimitingQueueConfig[string]{Name: "gpudra_republish"})}
}

// republish asks for the slices to be published again; it never blocks.
// Before startRepublishing (a driver not started yet) nothing is
// published, so there is nothing to bring up to date.
func (d *Driver) republish(ctx context.Context) {
	if d.repub == nil {
		klog.FromContext(ctx).V(4).Info("Republish asked before the driver publishes; ignored")
		return
	}
	d.repub.queue.Add(republishKey)
}

// startRepublishing runs d.publish for every republish until ctx ends or
// stopRepublishing is called.
func (d *Driver) startRepublishing(ctx context.Context) {
	if d.repub == nil {
		d.repub = newRepublisher()
	}
	r := d.repub
	ctx, r.stop = context.WithCancel(ctx)
	r.done = make(chan struct{})
	go func() {
		<-ctx.Done()
		r.queue.ShutDown()
	}()
	go func() {
		defer close(r.done)
		for d.publishQueued(ctx, r.queue) {
		}
	}()
}

// stopRepublishing stops the worker and waits until no publish runs.
func (d *Driver) stopRepublishing() {
	if d.repub == nil || d.repub.stop == nil {
		return
	}
	d.repub.stop()
	<-d.repub.done
}

// publishQueued publishes once for the queued key; false when the worker
// must stop.
func (d *Driver) publishQueued(ctx context.Context, q workqueue.TypedRateLimitingInterface[string]) bool {
	key, shutdown := q.Get()
	if shutdown {
		return false
	}
	defer q.Done(key)
	if ctx.Err() != nil {
		return false // stopping: what is queued goes with the plugin
	}
	if d.publish == nil {
		q.Forget(key)
		return true
	}
	if err := d.publish(ctx); err != nil {
		// Retried until it succeeds: a taint must not wait for an
		// unrelated change to be published.
		klog.FromContext(ctx).Error(err, "Republishing ResourceSlices failed; retrying", "failures", q.NumRequeues(key)+1)
		q.AddRateLimited(key)
		return true
	}
	q.Forget(key)
	return true
}
