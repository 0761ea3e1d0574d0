package dashboard

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/local"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

// TestLocalDashboard runs gpudra local on a simulated machine (two H100s,
// the second in MIG mode) with a real state directory: alice holds a GPU,
// bob a 3g.40gb MIG device local created, carol and dave wait. The View
// shows the holders on their devices and the queue in order.
func TestLocalDashboard(t *testing.T) {
	spec, err := sim.ParseSpec([]byte(twoGPUs))
	require.NoError(t, err)
	m, err := sim.New(spec, "box")
	require.NoError(t, err)
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	mach, err := local.NewMachine(inv, "box", true)
	require.NoError(t, err)
	dir := t.TempDir()
	clock := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	tick := func() time.Time { clock = clock.Add(time.Second); return clock }
	l, err := local.Open(local.Config{StateDir: dir, Machine: mach, MIG: m, Poll: 10 * time.Millisecond, Now: tick})
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	ctx := context.Background()
	hour := time.Hour
	req := func(name, user string, a local.Ask, d *time.Duration) local.Request {
		dc, err := local.Devices(a)
		require.NoError(t, err)
		return local.Request{Name: name, User: user, Devices: dc, Duration: d}
	}
	_, err = l.Acquire(ctx, req("train", "alice", local.Ask{GPUs: 1}, &hour), nil)
	require.NoError(t, err)
	small, err := l.Acquire(ctx, req("notebook", "bob", local.Ask{GPUs: 1, MIGProfile: "3g.40gb"}, &hour), nil)
	require.NoError(t, err)
	require.Len(t, small.Devices, 1)
	require.NoError(t, l.Enqueue(ctx, req("big", "carol", local.Ask{GPUs: 2}, nil)))
	require.NoError(t, l.Enqueue(ctx, req("next", "dave", local.Ask{GPUs: 1}, nil)))
	require.NoError(t, m.SetLoad(inv.GPUs[0].UUID, 0.5))

	for _, tc := range []struct {
		name  string
		order func(*local.State) []local.Waiter
	}{{"local's own order", l.Order}, {"LocalOrder, read only", nil}} {
		t.Run(tc.name, func(t *testing.T) {
			src := NewLocalSource(LocalConfig{Telemetry: m, Node: "box", Backend: "sim", StateDir: dir, Slices: mach.Slices, Order: tc.order,
				Now: func() time.Time { return clock }})
			src.Refresh(ctx)
			v, _ := src.Current()
			assert.Equal(t, "local", v.Mode)
			assert.Equal(t, "box", v.Context)

			g0 := findGPU(t, v, "box", "gpu-0")
			assert.Equal(t, StateAllocated, g0.State)
			assert.Equal(t, []Holder{{Local: "train", User: "alice"}}, g0.Holders)
			require.NotNil(t, g0.Usage)
			require.NotNil(t, g0.Usage.Utilization)
			assert.InDelta(t, 0.5, *g0.Usage.Utilization, 0.01)
			assert.Len(t, g0.Usage.Spark, 1)

			g1 := findGPU(t, v, "box", "gpu-1")
			assert.Equal(t, StatePartial, g1.State)
			held := findPlacement(t, g1, small.Devices[0].Name)
			assert.Equal(t, StateAllocated, held.State)
			assert.Equal(t, []Holder{{Local: "notebook", User: "bob"}}, held.Holders)
			assert.Equal(t, 4, held.Size)
			assert.Equal(t, StateBlocked, findPlacement(t, g1, "gpu-1-mig-7g-80gb-0").State)
			var free int
			for _, p := range g1.Placements {
				if p.State == StateFree {
					free++
				}
			}
			assert.Positive(t, free, "the other half's placements are free")

			require.Len(t, v.Queues, 1)
			q := v.Queues[0]
			assert.Equal(t, "local", q.Name)
			assert.Equal(t, "FCFS", q.Policy)
			require.Len(t, q.Items, 4)
			type row struct {
				name, user string
				pos        int
				holding    bool
				devices    int64
			}
			var rows []row
			for _, it := range q.Items {
				rows = append(rows, row{it.Name, it.User, it.Position, it.Holding, it.Devices})
				assert.Equal(t, "Local", it.Kind)
			}
			assert.Equal(t, []row{{"train", "alice", 0, true, 1}, {"notebook", "bob", 0, true, 1}, {"big", "carol", 1, false, 2}, {"next", "dave", 2, false, 1}}, rows)
			require.NotNil(t, q.Items[2].EstimatedStart, "both holders declared an hour")
			assert.Nil(t, q.Items[3].EstimatedStart, "behind carol, who declared nothing")
			assert.Equal(t, "1h0m0s", q.Items[0].Duration)
			assert.Equal(t, 2, v.Summary.Waiting)
			assert.Equal(t, 2, v.Summary.Allocated)

			require.Len(t, v.Allocation.Series, 2)
			assert.Equal(t, "alice", v.Allocation.Series[0].Owner, "per user")
		})
	}
}

// TestBuildLocalWithoutState: no gpudra local state is no holders and an
// empty queue, the devices from the telemetry alone.
func TestBuildLocalWithoutState(t *testing.T) {
	spec, err := sim.ParseSpec([]byte(twoGPUs + "migDevices:\n- {gpu: 1, profile: 3g.40gb, start: 4}\n"))
	require.NoError(t, err)
	m, err := sim.New(spec, "box")
	require.NoError(t, err)
	src := NewLocalSource(LocalConfig{Telemetry: m, Node: "box", Backend: "sim", StateDir: t.TempDir()})
	src.Refresh(context.Background())
	v, _ := src.Current()
	assert.Equal(t, StateFree, findGPU(t, v, "box", "gpu-0").State)
	g1 := findGPU(t, v, "box", "gpu-1")
	assert.True(t, g1.MIG)
	p := findPlacement(t, g1, "gpu-1-mig-3g-40gb-4")
	assert.Equal(t, [3]any{"3g.40gb", 4, 4}, [3]any{p.Profile, p.Start, p.Size})
	assert.Empty(t, v.Queues[0].Items)
	assert.Equal(t, "sim", v.Domains[0].Nodes[0].UsageSource)
}
