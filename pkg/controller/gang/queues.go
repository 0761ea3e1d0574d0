package gang

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/sets"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/allocator"
	"github.com/gpudra/gpudra/pkg/controller/queue"
)

// Queues, the core's second step for both paths: the round's items
// (reservations.go, gangs.go) are ordered per GpuQueue by its policy and
// planned in that order (plan.go); each queue's status and metrics say
// what waits.

// Kinds of queue items.
const (
	KindReservation = gpudrav1.KindGpuReservation
	KindGang        = "Gang"
)

// item is one reservation or gang waiting in a queue.
type item struct {
	queue.Item
	kind      string
	queueName string
	// res or gang, by kind.
	res  *gpudrav1.GpuReservation
	gang *Gang
	// claims (a reservation's) and groups (a gang's) are what to plan;
	// create are the claims (namespace/name) that do not exist yet.
	claims []*resourceapi.ResourceClaim
	groups []allocator.Group
	create sets.Set[string]
	// asWritten, when set, are the claims as they are in the API, where
	// claims are copies narrowed for planning (inDomain): a plan's
	// allocations are written to these.
	asWritten  []*resourceapi.ResourceClaim
	sameDomain bool
	classes    []string
}

// outcome is what a round decided for a waiting item.
type outcome struct {
	reason, message string
	position        int
	// needsDevices: the item waits because its devices do not fit in the
	// cluster now, and more nodes could give them (Unsatisfiable for lack
	// of devices included: a pool scaled to zero has none). Its demand is
	// published for an autoscaler (autoscaler.go). Queue order, a plan
	// error or a policy (mixed priorities) is not such a wait.
	needsDevices bool
}

// planQueues orders each queue's items by its policy and plans them in
// order. An item that would fit on the cluster but not now holds back the
// items behind it (no small item starves a big one); one that could never
// fit does not.
func (c *Controller) planQueues(ctx context.Context, items []*item, snap *snapshot, held map[string]int64, now time.Time) error {
	byQueue := map[string][]*item{}
	var kueue []*item
	for _, it := range items {
		if it.queueName == "" {
			kueue = append(kueue, it)
			continue
		}
		byQueue[it.queueName] = append(byQueue[it.queueName], it)
	}
	c.metrics.queueLength.Reset()
	c.metrics.queueDevices.Reset()
	c.metrics.unsatisfiable.Reset()
	c.metrics.waitingDemand.Reset()
	queued := map[demandKey]float64{}
	var errs []error
	var batch []*admission
	c.needDevices = nil
	// Gangs Kueue admitted first, each on its own: Kueue decided when they
	// start (its quota, cohorts, its own queue order), so none waits
	// behind an item of a GpuQueue or holds one back, and one that does
	// not fit now holds back no other; each is placed as soon as its
	// devices are free, oldest first (docs/queues.md).
	slices.SortFunc(kueue, func(a, b *item) int {
		return cmp.Or(a.QueuedAt.Compare(b.QueuedAt), cmp.Compare(a.Key, b.Key))
	})
	for _, it := range kueue {
		out, adm, err := c.plan(ctx, it, snap)
		if err != nil {
			errs = append(errs, err)
		}
		if adm != nil {
			batch = append(batch, adm)
		}
		if out.needsDevices {
			c.needDevices = append(c.needDevices, it)
		}
		if out.reason == gpudrav1.ReasonAllocated {
			held[it.Namespace] += it.Devices
			continue
		}
		errs = append(errs, c.reportWaiting(ctx, it, out, now))
	}
	for _, name := range sortedKeys(byQueue) {
		policy := queue.PolicyFor(c.queue(name))
		keyed := map[string]*item{}
		var qitems []queue.Item
		for _, it := range byQueue[name] {
			keyed[it.Key] = it
			qitems = append(qitems, it.Item)
		}
		blocked := ""
		waiting, waitingDevices, unsatisfiable := 0, int64(0), 0
		for _, qi := range queue.Order(policy, qitems, now, held) {
			it := keyed[qi.Key]
			var out outcome
			if blocked != "" {
				out = outcome{reason: gpudrav1.ReasonBehindInQueue, message: "behind " + blocked + " in queue " + name}
				// An item that could never fit says so even behind others.
				if msg := c.unsatisfiable(ctx, it, snap); msg != "" {
					out = outcome{reason: gpudrav1.ReasonUnsatisfiable, message: msg}
					unsatisfiable++
				}
			} else {
				var err error
				var adm *admission
				out, adm, err = c.plan(ctx, it, snap)
				if err != nil {
					errs = append(errs, err)
				}
				if adm != nil {
					batch = append(batch, adm)
				}
				if out.needsDevices {
					c.needDevices = append(c.needDevices, it)
				}
				switch out.reason {
				case gpudrav1.ReasonAllocated:
					held[it.Namespace] += it.Devices
					continue
				case gpudrav1.ReasonWaitingForDevices:
					blocked = it.Key
				case gpudrav1.ReasonUnsatisfiable:
					unsatisfiable++
				}
			}
			waiting++
			waitingDevices += it.Devices
			for _, class := range it.classes {
				c.metrics.waitingDemand.WithLabelValues(class).Add(float64(it.Devices) / float64(len(it.classes)))
				queued[demandKey{class, "", queueSource(it.kind)}] += float64(it.Devices) / float64(len(it.classes))
			}
			out.position = waiting
			errs = append(errs, c.reportWaiting(ctx, it, out, now))
		}
		c.metrics.queueLength.WithLabelValues(name).Set(float64(waiting))
		c.metrics.queueDevices.WithLabelValues(name).Set(float64(waitingDevices))
		c.metrics.unsatisfiable.WithLabelValues(name).Set(float64(unsatisfiable))
		errs = append(errs, c.setQueueStatus(ctx, name, waiting, waitingDevices, blocked))
	}
	c.queuedDemand = queued
	errs = append(errs, c.admit(ctx, batch, snap, now))
	return errors.Join(errs...)
}

// unsatisfiable says why an item would not fit even on an empty cluster,
// or "" when it would. The answer depends only on the item and the
// cluster's devices, so it is kept until the slices, classes or nodes
// change: waiting items are asked every round.
func (c *Controller) unsatisfiable(ctx context.Context, it *item, snap *snapshot) string {
	return c.verdict(ctx, it, snap).message
}

// verdict is unsatisfiable's answer, with whether more devices could
// help: the empty cluster lacked devices (a NotFitError), not one NVLink
// domain for them or a valid request.
func (c *Controller) verdict(ctx context.Context, it *item, snap *snapshot) verdict {
	fp := snap.fingerprint()
	c.mu.Lock()
	v, ok := c.verdicts[it.Key]
	c.mu.Unlock()
	// Kept a minute at most: a gang made again under its name with other
	// node selectors asks for the same number of devices.
	if ok && v.fingerprint == fp && v.devices == it.Devices && c.opts.Now().Sub(v.seen) < time.Minute {
		return v
	}
	var msg string
	empty, err := allocator.Plan(ctx, snap.input(c.opts.Strategy, it.claims, it.groups, true))
	var nf *allocator.NotFitError
	short := errors.As(err, &nf)
	switch {
	case err != nil:
		msg = fmt.Sprintf("%d devices cannot be allocated even on an empty cluster: %v", it.Devices, err)
	case it.sameDomain && len(empty.NVLinkDomains) > 1:
		msg = fmt.Sprintf("%d devices do not fit in one NVLink domain even on an empty cluster", it.Devices)
	}
	v = verdict{fingerprint: fp, devices: it.Devices, message: msg, short: short, seen: c.opts.Now()}
	c.mu.Lock()
	c.verdicts[it.Key] = v
	for k, old := range c.verdicts {
		if c.opts.Now().Sub(old.seen) > time.Minute {
			delete(c.verdicts, k)
		}
	}
	c.mu.Unlock()
	return v
}

// verdict is a remembered answer of unsatisfiable.
type verdict struct {
	fingerprint uint64
	devices     int64
	message     string
	// short: the empty cluster lacked devices (more nodes could help).
	short bool
	seen  time.Time
}

// requestClasses are the device classes a claim asks for.
func requestClasses(cl *resourceapi.ResourceClaim) []string {
	var out []string
	for _, r := range cl.Spec.Devices.Requests {
		switch {
		case r.Exactly != nil:
			out = append(out, r.Exactly.DeviceClassName)
		case len(r.FirstAvailable) > 0:
			out = append(out, r.FirstAvailable[0].DeviceClassName)
		}
	}
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// queue returns the GpuQueue of a name, nil when there is none.
func (c *Controller) queue(name string) *gpudrav1.GpuQueue {
	obj, ok, err := c.queues.GetByKey(name)
	if err != nil || !ok {
		return nil
	}
	q, err := gpudrav1.FromUnstructured[gpudrav1.GpuQueue](obj.(*unstructured.Unstructured))
	if err != nil {
		return nil
	}
	return q
}

// setQueueStatus writes a GpuQueue's status, when the object exists.
func (c *Controller) setQueueStatus(ctx context.Context, name string, waiting int, devices int64, head string) error {
	q := c.queue(name)
	if q == nil {
		return nil
	}
	st := gpudrav1.GpuQueueStatus{Waiting: int32(waiting), WaitingDevices: devices, Head: head}
	if head != "" {
		st.HeadReason = gpudrav1.ReasonWaitingForDevices
	}
	if reflect.DeepEqual(st, q.Status) {
		return nil
	}
	_, err := c.updateStatus(ctx, c.queues, gpudrav1.GpuQueues, "", name, st)
	return err
}
