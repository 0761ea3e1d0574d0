package dashboard

import (
	"cmp"
	"slices"
	"sync"
	"time"

	"github.com/gpudra/gpudra/pkg/top"
)

// History is what a source saw since it started: each device's last
// SparkPoints usage readings (the sparklines), and the devices allocated
// and used per owner, one point per step over a span (the allocation
// chart when no Prometheus is given). It only grows from what the source
// records; a point it did not see is not made up.
//
// Its maps and slices are replaced, never changed, once handed out: a
// View built from Sparks stays as it was while the next read records.
type History struct {
	mu     sync.Mutex
	step   time.Duration
	frames int
	spark  map[string][]*float64
	// ring is the allocation frames, oldest first, at most frames long.
	ring []allocFrame
}

// allocFrame is one step of the allocation history.
type allocFrame struct {
	at     time.Time
	owners map[string]ownerCount
}

// ownerCount is one owner's devices at one time; used is nil when none of
// them had a usage reading.
type ownerCount struct {
	allocated float64
	used      *float64
}

// Defaults of the seen history: six hours, one point per 30 s.
const (
	DefaultHistoryStep = 30 * time.Second
	DefaultHistorySpan = 6 * time.Hour
)

// NewHistory keeps one allocation point per step over span (defaults
// when 0).
func NewHistory(step, span time.Duration) *History {
	if step <= 0 {
		step = DefaultHistoryStep
	}
	if span <= 0 {
		span = DefaultHistorySpan
	}
	return &History{step: step, frames: max(1, int(span/step)), spark: map[string][]*float64{}}
}

// RecordUsage adds one point to every device's sparkline from one usage
// read (nodes by name): its utilization, or a MIG device's SM activity
// (MIG devices have no utilization of their own). A device known before
// and not read this time gets a null point; a device whose points are all
// null is forgotten.
func (h *History) RecordUsage(usage map[string]*top.Snapshot) {
	h.mu.Lock()
	defer h.mu.Unlock()
	read := map[string]*float64{}
	for node, s := range usage {
		if s == nil {
			continue
		}
		for i := range s.Devices {
			d := &s.Devices[i]
			read[SparkKey(node, d.Name)] = cmp.Or(d.Utilization, d.SMActive)
		}
	}
	next := make(map[string][]*float64, len(h.spark)+len(read))
	for key, old := range h.spark {
		if line := pushSpark(old, read[key]); !allNil(line) {
			next[key] = line
		}
	}
	for key, v := range read {
		if _, known := h.spark[key]; !known && v != nil {
			next[key] = pushSpark(nil, v)
		}
	}
	h.spark = next
}

// pushSpark is line with v appended and its oldest points dropped past
// SparkPoints, in a new slice (the old one may be in a published View).
func pushSpark(line []*float64, v *float64) []*float64 {
	keep := line[max(0, len(line)-SparkPoints+1):]
	out := make([]*float64, 0, len(keep)+1)
	return append(append(out, keep...), v)
}

func allNil(line []*float64) bool {
	for _, p := range line {
		if p != nil {
			return false
		}
	}
	return true
}

// Sparks are the sparklines by SparkKey; the map is not changed later.
func (h *History) Sparks() map[string][]*float64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.spark
}

// Observe records the View's allocation as the point of its time step
// (a later View in the same step replaces it).
func (h *History) Observe(v *View) {
	owners := allocationOf(v)
	at := v.At.Truncate(h.step)
	h.mu.Lock()
	defer h.mu.Unlock()
	if n := len(h.ring); n > 0 && h.ring[n-1].at.Equal(at) {
		h.ring[n-1].owners = owners
		return
	}
	if n := len(h.ring); n > 0 && at.Before(h.ring[n-1].at) {
		return // a clock step back: the ring stays in time order
	}
	h.ring = append(h.ring, allocFrame{at: at, owners: owners})
	if len(h.ring) > h.frames {
		h.ring = slices.Delete(h.ring, 0, len(h.ring)-h.frames)
	}
}

// allocationOf counts each owner's devices in a View: a whole GPU or a
// MIG device once per owner that holds it (a shared device counts in each
// owner's), and of them those in use (utilization, or a MIG device's SM
// activity, above 0). The owner is the holder's namespace, or its user
// in local mode.
func allocationOf(v *View) map[string]ownerCount {
	out := map[string]ownerCount{}
	count := func(holders []Holder, reading *float64) {
		seen := map[string]bool{}
		for _, h := range holders {
			owner := cmp.Or(h.User, h.Namespace)
			if seen[owner] {
				continue
			}
			seen[owner] = true
			c := out[owner]
			c.allocated++
			if reading != nil {
				used := 0.0
				if c.used != nil {
					used = *c.used
				}
				if *reading > 0 {
					used++
				}
				c.used = &used
			}
			out[owner] = c
		}
	}
	for _, d := range v.Domains {
		for _, n := range d.Nodes {
			for _, g := range n.GPUs {
				if len(g.Holders) > 0 {
					var r *float64
					if g.Usage != nil {
						r = g.Usage.Utilization
					}
					count(g.Holders, r)
				}
				for _, p := range g.Placements {
					if len(p.Holders) > 0 {
						var r *float64
						if p.Usage != nil {
							r = cmp.Or(p.Usage.SMActive, p.Usage.Utilization)
						}
						count(p.Holders, r)
					}
				}
			}
		}
	}
	return out
}

// Allocation is the seen history as the View carries it: one series per
// owner that held anything in the span, a point per recorded step (0
// where it held nothing then).
func (h *History) Allocation() Allocation {
	h.mu.Lock()
	defer h.mu.Unlock()
	a := Allocation{Source: "seen", StepSeconds: int(h.step / time.Second), Series: []AllocationSeries{}}
	owners := map[string]bool{}
	for _, f := range h.ring {
		for o := range f.owners {
			owners[o] = true
		}
	}
	names := make([]string, 0, len(owners))
	for o := range owners {
		names = append(names, o)
	}
	slices.Sort(names)
	for _, o := range names {
		s := AllocationSeries{Owner: o, Points: make([]AllocationPoint, 0, len(h.ring))}
		for _, f := range h.ring {
			c := f.owners[o]
			s.Points = append(s.Points, AllocationPoint{At: f.at, Allocated: c.allocated, Used: c.used})
		}
		a.Series = append(a.Series, s)
	}
	return a
}
