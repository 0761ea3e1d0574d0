package queue

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

var t0 = time.Date(2030, 1, 1, 12, 0, 0, 0, time.UTC)

// at is t0 plus m minutes.
func at(m float64) time.Time { return t0.Add(time.Duration(m * float64(time.Minute))) }

func dur(d time.Duration) *time.Duration { return &d }

func keys(items []Item) []string {
	out := make([]string, 0, len(items))
	for _, it := range items {
		out = append(out, it.Key)
	}
	return out
}

func TestPolicyFor(t *testing.T) {
	assert.Equal(t, Policy{Name: v1alpha1.FCFS, AgingPerMinute: 1, DefaultShare: 1}, PolicyFor(nil))

	q := &v1alpha1.GpuQueue{
		ObjectMeta: metav1.ObjectMeta{Name: "research"},
		Spec: v1alpha1.GpuQueueSpec{
			Policy:         v1alpha1.FairShare,
			AgingPerMinute: ptr.To[int32](0),
			Shares:         map[string]int32{"a": 3},
		},
	}
	p := PolicyFor(q)
	assert.Equal(t, Policy{Name: v1alpha1.FairShare, AgingPerMinute: 0, Shares: map[string]int32{"a": 3}, DefaultShare: 1}, p)
	assert.Empty(t, q.Spec.DefaultShare, "PolicyFor must default a copy")
	p.Shares["a"] = 9
	assert.Equal(t, int32(3), q.Spec.Shares["a"], "the policy must not share the queue's map")
}

func TestShare(t *testing.T) {
	p := Policy{Shares: map[string]int32{"a": 3, "bad": 0}, DefaultShare: 2}
	assert.Equal(t, int32(3), p.Share("a"))
	assert.Equal(t, int32(2), p.Share("other"))
	assert.Equal(t, int32(1), p.Share("bad"))
	assert.Equal(t, int32(1), Policy{}.Share("x"))
}

func TestEffectivePriority(t *testing.T) {
	p := Policy{Name: v1alpha1.Priority, AgingPerMinute: 2}
	it := Item{Priority: 5, QueuedAt: at(0)}
	assert.InDelta(t, 5, p.EffectivePriority(it, at(0)), 1e-9)
	assert.InDelta(t, 25, p.EffectivePriority(it, at(10)), 1e-9)
	assert.InDelta(t, 6, p.EffectivePriority(it, at(0.5)), 1e-9)
	assert.InDelta(t, 5, p.EffectivePriority(it, at(-3)), 1e-9, "clock skew counts as no wait")
	assert.InDelta(t, 5, Policy{Name: v1alpha1.Priority}.EffectivePriority(it, at(60)), 1e-9, "aging off")
}

func TestOrder(t *testing.T) {
	fcfs := Policy{Name: v1alpha1.FCFS, AgingPerMinute: 1, DefaultShare: 1}
	prio := func(aging int32) Policy {
		return Policy{Name: v1alpha1.Priority, AgingPerMinute: aging, DefaultShare: 1}
	}
	fair := func(shares map[string]int32) Policy {
		return Policy{Name: v1alpha1.FairShare, AgingPerMinute: 1, Shares: shares, DefaultShare: 1}
	}
	sjf := Policy{Name: v1alpha1.ShortestJobFirst, AgingPerMinute: 1, DefaultShare: 1}

	tests := []struct {
		name  string
		p     Policy
		items []Item
		now   time.Time
		held  map[string]int64
		want  []string
	}{
		{name: "empty", p: fcfs, want: []string{}},
		{
			name: "FCFS by arrival, ignoring priority and size",
			p:    fcfs,
			items: []Item{
				{Key: "c", QueuedAt: at(3), Priority: 100},
				{Key: "a", QueuedAt: at(1), Devices: 64},
				{Key: "b", QueuedAt: at(2)},
			},
			want: []string{"a", "b", "c"},
		},
		{
			name:  "FCFS ties broken by key",
			p:     fcfs,
			items: []Item{{Key: "z", QueuedAt: at(1)}, {Key: "m", QueuedAt: at(1)}, {Key: "a", QueuedAt: at(2)}},
			want:  []string{"m", "z", "a"},
		},
		{
			name:  "unknown policy falls back to FCFS",
			p:     Policy{Name: "LIFO"},
			items: []Item{{Key: "new", QueuedAt: at(5), Priority: 9}, {Key: "old", QueuedAt: at(1)}},
			want:  []string{"old", "new"},
		},
		{
			name:  "empty policy name is FCFS",
			p:     Policy{},
			items: []Item{{Key: "new", QueuedAt: at(5)}, {Key: "old", QueuedAt: at(1)}},
			want:  []string{"old", "new"},
		},
		{
			name: "Priority: higher first without aging",
			p:    prio(0),
			items: []Item{
				{Key: "low-old", Priority: 1, QueuedAt: at(0)},
				{Key: "high-new", Priority: 10, QueuedAt: at(50)},
				{Key: "mid", Priority: 5, QueuedAt: at(20)},
			},
			now:  at(60),
			want: []string{"high-new", "mid", "low-old"},
		},
		{
			name: "Priority: same priority keeps arrival order",
			p:    prio(0),
			items: []Item{
				{Key: "b", Priority: 3, QueuedAt: at(2)},
				{Key: "a", Priority: 3, QueuedAt: at(1)},
			},
			now:  at(10),
			want: []string{"a", "b"},
		},
		{
			name: "Priority: not yet aged enough, high still first",
			p:    prio(1),
			items: []Item{
				// low: 0 + 1*9 = 9; high: 10 + 1*0 = 10
				{Key: "low", Priority: 0, QueuedAt: at(0)},
				{Key: "high", Priority: 10, QueuedAt: at(9)},
			},
			now:  at(9),
			want: []string{"high", "low"},
		},
		{
			name: "Priority: a low item that waited long enough overtakes",
			p:    prio(1),
			items: []Item{
				// low: 0 + 1*11 = 11; high: 10 + 1*0 = 10
				{Key: "low", Priority: 0, QueuedAt: at(0)},
				{Key: "high", Priority: 10, QueuedAt: at(11)},
			},
			now:  at(11),
			want: []string{"low", "high"},
		},
		{
			name: "Priority: starvation prevented against a stream of newer high-priority items",
			p:    prio(2),
			items: []Item{
				// starved: 0 + 2*60 = 120; each hN: 50 + 2*(60-queued)
				{Key: "starved", Priority: 0, QueuedAt: at(0)},
				{Key: "h1", Priority: 50, QueuedAt: at(20)}, // 130
				{Key: "h2", Priority: 50, QueuedAt: at(40)}, // 90
				{Key: "h3", Priority: 50, QueuedAt: at(59)}, // 52
			},
			now:  at(60),
			want: []string{"h1", "starved", "h2", "h3"},
		},
		{
			name: "Priority: equal effective priority ties by arrival then key",
			p:    prio(1),
			items: []Item{
				// both 10 at t=10
				{Key: "b", Priority: 0, QueuedAt: at(0)},
				{Key: "a", Priority: 10, QueuedAt: at(10)},
				{Key: "c", Priority: 10, QueuedAt: at(10)},
			},
			now:  at(10),
			want: []string{"b", "a", "c"},
		},
		{
			name: "FairShare: namespaces alternate from nothing held",
			p:    fair(nil),
			items: []Item{
				{Key: "a1", Namespace: "a", Devices: 4, QueuedAt: at(0)},
				{Key: "a2", Namespace: "a", Devices: 4, QueuedAt: at(1)},
				{Key: "a3", Namespace: "a", Devices: 4, QueuedAt: at(2)},
				{Key: "b1", Namespace: "b", Devices: 4, QueuedAt: at(3)},
				{Key: "b2", Namespace: "b", Devices: 4, QueuedAt: at(4)},
			},
			want: []string{"a1", "b1", "a2", "b2", "a3"},
		},
		{
			name: "FairShare: the namespace holding more waits",
			p:    fair(nil),
			items: []Item{
				{Key: "a1", Namespace: "a", Devices: 2, QueuedAt: at(0)},
				{Key: "b1", Namespace: "b", Devices: 2, QueuedAt: at(5)},
				{Key: "b2", Namespace: "b", Devices: 2, QueuedAt: at(6)},
			},
			held: map[string]int64{"a": 8, "b": 2},
			// b: 2 → b1 (4) → b2 (6) all below a's 8
			want: []string{"b1", "b2", "a1"},
		},
		{
			name: "FairShare: shares weight the alternation",
			p:    fair(map[string]int32{"big": 2}),
			items: []Item{
				{Key: "big1", Namespace: "big", Devices: 1, QueuedAt: at(0)},
				{Key: "big2", Namespace: "big", Devices: 1, QueuedAt: at(1)},
				{Key: "big3", Namespace: "big", Devices: 1, QueuedAt: at(2)},
				{Key: "big4", Namespace: "big", Devices: 1, QueuedAt: at(3)},
				{Key: "small1", Namespace: "small", Devices: 1, QueuedAt: at(4)},
				{Key: "small2", Namespace: "small", Devices: 1, QueuedAt: at(5)},
			},
			// ratios (big/2, small/1): 0,0 → big1 (older); .5,0 → small1; .5,1 → big2;
			// 1,1 → big3 (older head); 1.5,1 → small2; 1.5,2 → big4
			want: []string{"big1", "small1", "big2", "big3", "small2", "big4"},
		},
		{
			name: "FairShare: within a namespace arrival order holds",
			p:    fair(nil),
			items: []Item{
				{Key: "a-late", Namespace: "a", Devices: 1, QueuedAt: at(9)},
				{Key: "a-early", Namespace: "a", Devices: 1, QueuedAt: at(1)},
			},
			want: []string{"a-early", "a-late"},
		},
		{
			name: "ShortestJobFirst: shortest first, unknown last",
			p:    sjf,
			items: []Item{
				{Key: "unknown-old", QueuedAt: at(0)},
				{Key: "long", Duration: dur(4 * time.Hour), QueuedAt: at(1)},
				{Key: "short", Duration: dur(10 * time.Minute), QueuedAt: at(2)},
				{Key: "unknown-new", QueuedAt: at(3)},
				{Key: "mid", Duration: dur(time.Hour), QueuedAt: at(4)},
			},
			want: []string{"short", "mid", "long", "unknown-old", "unknown-new"},
		},
		{
			name: "ShortestJobFirst: equal durations by arrival",
			p:    sjf,
			items: []Item{
				{Key: "b", Duration: dur(time.Hour), QueuedAt: at(2)},
				{Key: "a", Duration: dur(time.Hour), QueuedAt: at(1)},
			},
			want: []string{"a", "b"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := append([]Item(nil), tt.items...)
			got := Order(tt.p, tt.items, tt.now, tt.held)
			assert.Equal(t, tt.want, keys(got))
			assert.Equal(t, before, tt.items, "Order must not modify its input")
			// Deterministic whatever the input order.
			rev := make([]Item, len(tt.items))
			for i, it := range tt.items {
				rev[len(rev)-1-i] = it
			}
			assert.Equal(t, tt.want, keys(Order(tt.p, rev, tt.now, tt.held)), "order depends on input order")
		})
	}
}

// With one aging rate for all, the gap between two items' effective
// priorities does not change as time passes; what decides is how much
// earlier the low item arrived: AgingPerMinute points per minute of head
// start. Turning aging off restores strict priority.
func TestPriorityAgingHeadStart(t *testing.T) {
	p := PolicyFor(&v1alpha1.GpuQueue{Spec: v1alpha1.GpuQueueSpec{Policy: v1alpha1.Priority}}) // aging 1
	require.Equal(t, int32(1), p.AgingPerMinute)
	order := func(p Policy, highArrives float64, now float64) []string {
		items := []Item{
			{Key: "low", Priority: 0, QueuedAt: at(0)},
			{Key: "high", Priority: 30, QueuedAt: at(highArrives)},
		}
		return keys(Order(p, items, at(now), nil))
	}
	for _, now := range []float64{60, 600} {
		assert.Equal(t, []string{"high", "low"}, order(p, 29, now), "29 min head start < 30 points (now %v)", now)
		assert.Equal(t, []string{"low", "high"}, order(p, 31, now), "31 min head start > 30 points (now %v)", now)
	}
	p.AgingPerMinute = 0
	assert.Equal(t, []string{"high", "low"}, order(p, 500, 600), "no aging: priority only")
	p.AgingPerMinute = 10
	assert.Equal(t, []string{"low", "high"}, order(p, 4, 600), "faster aging: 4 min head start is 40 points")
}

// FairShare's greedy accounting: a large item counts in full for its
// namespace, so the other namespace goes next several times.
func TestFairShareCountsPlannedDevices(t *testing.T) {
	p := PolicyFor(&v1alpha1.GpuQueue{Spec: v1alpha1.GpuQueueSpec{Policy: v1alpha1.FairShare}})
	items := []Item{
		{Key: "a-big", Namespace: "a", Devices: 16, QueuedAt: at(0)},
		{Key: "a-small", Namespace: "a", Devices: 1, QueuedAt: at(1)},
		{Key: "b1", Namespace: "b", Devices: 4, QueuedAt: at(2)},
		{Key: "b2", Namespace: "b", Devices: 4, QueuedAt: at(3)},
		{Key: "b3", Namespace: "b", Devices: 4, QueuedAt: at(4)},
	}
	assert.Equal(t, []string{"a-big", "b1", "b2", "b3", "a-small"}, keys(Order(p, items, at(5), nil)))
}
