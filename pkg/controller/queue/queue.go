// Package queue orders the waiting items of one GpuQueue (reservations and
// gangs) by the queue's policy. It is pure: no clients, no clock of its
// own, so the controller can recompute the order on every pass and tests
// can pin time. Planning (what fits where) is the allocator's business;
// this package only says in which order items are tried.
package queue

import (
	"cmp"
	"slices"
	"time"

	"github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// Item is one waiting reservation or gang.
type Item struct {
	// Key identifies the item, for example "GpuReservation/ns/name" or
	// "Gang/ns/name"; unique within a queue. It is the last tie-breaker,
	// which keeps the order deterministic.
	Key       string
	Namespace string
	Priority  int32
	// QueuedAt is when it started waiting.
	QueuedAt time.Time
	// Duration is the declared run time; nil when unknown.
	Duration *time.Duration
	// Devices is the number of devices it asks for.
	Devices int64
}

// Policy is a queue's ordering policy with its defaults applied.
type Policy struct {
	Name           v1alpha1.QueuePolicy
	AgingPerMinute int32
	Shares         map[string]int32
	DefaultShare   int32
}

// PolicyFor returns q's effective policy. A nil queue (the default queue
// need not exist as an object) is FCFS. q is not modified.
func PolicyFor(q *v1alpha1.GpuQueue) Policy {
	if q == nil {
		q = &v1alpha1.GpuQueue{}
	} else {
		q = q.DeepCopy()
	}
	q.Default()
	return Policy{
		Name:           q.Spec.Policy,
		AgingPerMinute: v1alpha1.AgingPerMinute(q),
		Shares:         q.Spec.Shares,
		DefaultShare:   q.Spec.DefaultShare,
	}
}

// Share is a namespace's weight under FairShare. A weight below 1 (which
// validation refuses, but a Policy can be built by hand) counts as 1 so
// that no namespace divides by zero or gets a negative claim.
func (p Policy) Share(namespace string) int32 {
	s, ok := p.Shares[namespace]
	if !ok {
		s = p.DefaultShare
	}
	return max(s, 1)
}

// EffectivePriority is the item's priority plus AgingPerMinute for each
// minute (fractions included) it has waited by now, so that under the
// Priority policy a low-priority item eventually overtakes a stream of
// newer high-priority ones. Time before QueuedAt (clock skew) counts as
// no wait.
func (p Policy) EffectivePriority(it Item, now time.Time) float64 {
	waited := max(now.Sub(it.QueuedAt), 0)
	return float64(it.Priority) + float64(p.AgingPerMinute)*waited.Minutes()
}

// Order returns the items in the order they are planned. It does not
// modify items. held maps a namespace to the devices it holds now (used
// by FairShare only; nil means none). Ties are broken by QueuedAt, then
// Key, so the order is deterministic. An unknown policy orders FCFS: a
// queue object written before a policy existed must still drain.
func Order(p Policy, items []Item, now time.Time, held map[string]int64) []Item {
	out := slices.Clone(items)
	switch p.Name {
	case v1alpha1.Priority:
		// Computed once per item: the comparison must see one consistent
		// value per item, and aging makes it a function of time.
		eff := make(map[string]float64, len(out))
		for _, it := range out {
			eff[it.Key] = p.EffectivePriority(it, now)
		}
		slices.SortStableFunc(out, func(a, b Item) int {
			if c := cmp.Compare(eff[b.Key], eff[a.Key]); c != 0 {
				return c
			}
			return byArrival(a, b)
		})
	case v1alpha1.FairShare:
		out = fairShare(p, out, held)
	case v1alpha1.ShortestJobFirst:
		slices.SortStableFunc(out, func(a, b Item) int {
			switch {
			case a.Duration == nil && b.Duration == nil:
			case a.Duration == nil:
				return 1
			case b.Duration == nil:
				return -1
			default:
				if c := cmp.Compare(*a.Duration, *b.Duration); c != 0 {
					return c
				}
			}
			return byArrival(a, b)
		})
	default: // FCFS and anything unknown
		slices.SortStableFunc(out, byArrival)
	}
	return out
}

// byArrival orders by QueuedAt, then Key.
func byArrival(a, b Item) int {
	if c := a.QueuedAt.Compare(b.QueuedAt); c != 0 {
		return c
	}
	return cmp.Compare(a.Key, b.Key)
}

// fairShare orders greedily: it repeatedly takes the oldest item of the
// namespace whose (held + already planned devices) / share is lowest, so
// namespaces alternate in proportion to their shares instead of the
// oldest namespace taking everything. Ratios are compared by cross
// multiplication to stay exact.
func fairShare(p Policy, items []Item, held map[string]int64) []Item {
	slices.SortStableFunc(items, byArrival)
	// Per-namespace FIFO lines; within a namespace the ratio is the same
	// for every item, so only each line's head competes.
	lines := map[string][]Item{}
	var namespaces []string
	for _, it := range items {
		if _, ok := lines[it.Namespace]; !ok {
			namespaces = append(namespaces, it.Namespace)
		}
		lines[it.Namespace] = append(lines[it.Namespace], it)
	}
	used := make(map[string]int64, len(namespaces))
	for _, ns := range namespaces {
		used[ns] = held[ns]
	}

	out := make([]Item, 0, len(items))
	for len(out) < len(items) {
		best := ""
		for _, ns := range namespaces {
			if len(lines[ns]) == 0 {
				continue
			}
			if best == "" || fairLess(p, ns, best, used, lines) {
				best = ns
			}
		}
		it := lines[best][0]
		lines[best] = lines[best][1:]
		used[best] += it.Devices
		out = append(out, it)
	}
	return out
}

// fairLess reports whether namespace a's head goes before b's: lower
// usage per share first, then the older head.
func fairLess(p Policy, a, b string, used map[string]int64, lines map[string][]Item) bool {
	// used[a]/share(a) < used[b]/share(b)  ⇔  used[a]*share(b) < used[b]*share(a)
	l := used[a] * int64(p.Share(b))
	r := used[b] * int64(p.Share(a))
	if l != r {
		return l < r
	}
	return byArrival(lines[a][0], lines[b][0]) < 0
}
