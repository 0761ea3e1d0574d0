package dashboard

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/top"
)

func TestSparklines(t *testing.T) {
	h := NewHistory(0, 0)
	read := func(devs ...top.Device) map[string]*top.Snapshot {
		return map[string]*top.Snapshot{"n": {Devices: devs}}
	}
	h.RecordUsage(read(top.Device{Name: "gpu-0", Utilization: fp(0.5)}, top.Device{Name: "gpu-1-mig-3g-40gb-4", SMActive: fp(0.2)}, top.Device{Name: "gpu-2"}))
	first := h.Sparks()
	h.RecordUsage(read(top.Device{Name: "gpu-0", Utilization: fp(0.7)}))
	s := h.Sparks()
	assert.Equal(t, []*float64{fp(0.5), fp(0.7)}, s[SparkKey("n", "gpu-0")])
	assert.Equal(t, []*float64{fp(0.2), nil}, s[SparkKey("n", "gpu-1-mig-3g-40gb-4")], "a MIG device's SM activity; not read is null, not 0")
	assert.NotContains(t, s, SparkKey("n", "gpu-2"), "never read: no line")
	assert.Len(t, first[SparkKey("n", "gpu-0")], 1, "what was handed out does not change")

	for i := range SparkPoints + 5 {
		h.RecordUsage(read(top.Device{Name: "gpu-0", Utilization: fp(float64(i))}))
	}
	line := h.Sparks()[SparkKey("n", "gpu-0")]
	require.Len(t, line, SparkPoints)
	assert.Equal(t, float64(SparkPoints+4), *line[SparkPoints-1], "newest last")
	for range SparkPoints {
		h.RecordUsage(nil)
	}
	assert.Empty(t, h.Sparks(), "all null: forgotten")
}

func TestSeenAllocation(t *testing.T) {
	h := NewHistory(30*time.Second, 2*time.Minute) // 4 points
	t0 := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	view := func(at time.Time, gpus ...GPU) *View {
		return &View{At: at, Domains: []Domain{{Nodes: []Node{{Name: "n", GPUs: gpus}}}}}
	}
	busy := &Usage{Utilization: fp(0.9)}
	idleU := &Usage{Utilization: fp(0)}
	a, b := Holder{Namespace: "a", Claim: "x"}, Holder{Namespace: "b", Claim: "y"}
	h.Observe(view(t0, GPU{Name: "gpu-0", Holders: []Holder{a}, Usage: busy}, GPU{Name: "gpu-1", Holders: []Holder{a, b}, Usage: idleU},
		GPU{Name: "gpu-2", Placements: []Placement{{Name: "m", Holders: []Holder{b}}}}))
	h.Observe(view(t0.Add(10*time.Second), GPU{Name: "gpu-0", Holders: []Holder{a}, Usage: busy})) // same step: replaces
	h.Observe(view(t0.Add(30*time.Second), GPU{Name: "gpu-0", Holders: []Holder{b}}))

	got := h.Allocation()
	assert.Equal(t, "seen", got.Source)
	assert.Equal(t, 30, got.StepSeconds)
	require.Len(t, got.Series, 2)
	assert.Equal(t, "a", got.Series[0].Owner)
	assert.Equal(t, []AllocationPoint{{At: t0, Allocated: 1, Used: fp(1)}, {At: t0.Add(30 * time.Second), Allocated: 0}}, got.Series[0].Points)
	assert.Equal(t, []AllocationPoint{{At: t0, Allocated: 0}, {At: t0.Add(30 * time.Second), Allocated: 1}}, got.Series[1].Points,
		"b's GPU had no usage reading: used unknown, not 0")

	// A shared device counts once in each owner's; usage read and idle is 0 used.
	h2 := NewHistory(30*time.Second, time.Hour)
	h2.Observe(view(t0, GPU{Name: "gpu-1", Holders: []Holder{a, b, {Namespace: "a", Claim: "z"}}, Usage: idleU}))
	s := h2.Allocation().Series
	require.Len(t, s, 2)
	assert.Equal(t, AllocationPoint{At: t0, Allocated: 1, Used: fp(0)}, s[0].Points[0])

	for i := range 10 {
		h.Observe(view(t0.Add(time.Duration(i+2)*30*time.Second), GPU{Name: "gpu-0", Holders: []Holder{a}}))
	}
	assert.Len(t, h.Allocation().Series[0].Points, 4, "the ring keeps its span")
}
