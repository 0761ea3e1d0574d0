package local

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"

	"github.com/gpudra/gpudra/pkg/allocator"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

// openLocal is a simulated machine's local state in a temporary
// directory; createMIG publishes MIG placements and creates them through
// the machine; edit, when set, completes the config.
func openLocal(t *testing.T, machine string, createMIG bool, edit func(*Config)) (*Local, *sim.Machine, string) {
	t.Helper()
	m, err := sim.NewBuiltin(machine, "box")
	require.NoError(t, err)
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	mach, err := NewMachine(inv, "box", createMIG)
	require.NoError(t, err)
	dir := t.TempDir()
	cfg := Config{StateDir: dir, Machine: mach, Poll: 20 * time.Millisecond}
	if createMIG {
		cfg.MIG = m
	}
	if edit != nil {
		edit(&cfg)
	}
	l, err := Open(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	return l, m, dir
}

// newLocal is openLocal without MIG creation.
func newLocal(t *testing.T, machine string) (*Local, string) {
	t.Helper()
	l, _, dir := openLocal(t, machine, false, nil)
	return l, dir
}

func ask(t *testing.T, name, user string, a Ask) Request {
	t.Helper()
	dc, err := Devices(a)
	require.NoError(t, err)
	return Request{Name: name, User: user, Devices: dc}
}

// sleeper is a real process that holds an allocation.
func sleeper(t *testing.T) (*exec.Cmd, Holder) {
	t.Helper()
	cmd := exec.Command("sleep", "300")
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	h, err := HolderOf("/proc", cmd.Process.Pid)
	require.NoError(t, err)
	return cmd, h
}

func uuids(a Allocation) []string {
	var out []string
	for _, d := range a.Devices {
		out = append(out, d.UUID)
	}
	return out
}

func TestTwoRunsGetDisjointGPUsInOneDomainAndAThirdWaits(t *testing.T) {
	l, _ := newLocal(t, "h100-pcie-nvlink") // 4 GPUs, NVLink bridges in pairs
	ctx := context.Background()
	var wg sync.WaitGroup
	got := make([]Allocation, 2)
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			a, err := l.Acquire(ctx, ask(t, []string{"a", "b"}[i], "alice", Ask{GPUs: 2, SameNVLink: true}), nil)
			assert.NoError(t, err)
			got[i] = a
		}()
	}
	wg.Wait()
	for _, a := range got {
		require.Len(t, a.Devices, 2)
		assert.Equal(t, a.Devices[0].NVLinkDomain, a.Devices[1].NVLinkDomain, "%s: one NVLink domain", a.Name)
		assert.NotEmpty(t, a.Devices[0].NVLinkDomain)
	}
	for _, u := range uuids(got[0]) {
		assert.NotContains(t, uuids(got[1]), u, "disjoint")
	}

	// A third waits, and starts when one ends.
	third := make(chan Allocation, 1)
	go func() {
		a, err := l.Acquire(ctx, ask(t, "c", "bob", Ask{GPUs: 2, SameNVLink: true}), nil)
		assert.NoError(t, err)
		third <- a
	}()
	require.Eventually(t, func() bool {
		st, err := l.Poll(ctx, "c")
		return err == nil && st.Position == 1
	}, 5*time.Second, 10*time.Millisecond, "c waits")
	require.NoError(t, l.Release(ctx, "a", "alice"))
	select {
	case a := <-third:
		assert.ElementsMatch(t, uuids(got[0]), uuids(a), "c gets what a released")
	case <-time.After(5 * time.Second):
		t.Fatal("c did not start when a released")
	}
}

func TestKilledHolderIsFreedWithinOnePoll(t *testing.T) {
	l, _ := newLocal(t, "h100-pcie-nvlink")
	ctx := context.Background()
	cmd, holder := sleeper(t)
	r := ask(t, "held", "alice", Ask{GPUs: 2})
	r.Holder = holder
	_, err := l.Acquire(ctx, r, nil)
	require.NoError(t, err)
	_, err = l.Acquire(ctx, ask(t, "rest", "carol", Ask{GPUs: 2}), nil)
	require.NoError(t, err)
	waiting := make(chan error, 1)
	go func() {
		_, err := l.Acquire(ctx, ask(t, "next", "bob", Ask{GPUs: 1}), nil)
		waiting <- err
	}()
	time.Sleep(100 * time.Millisecond)
	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	_ = cmd.Wait()
	killed := time.Now()
	select {
	case err := <-waiting:
		require.NoError(t, err)
		assert.Less(t, time.Since(killed), 3*l.cfg.Poll+100*time.Millisecond, "freed within a poll")
	case <-time.After(5 * time.Second):
		t.Fatal("the dead holder's GPUs were not freed")
	}
	s, err := l.State(ctx)
	require.NoError(t, err)
	assert.False(t, slices.ContainsFunc(s.Allocations, func(a Allocation) bool { return a.Name == "held" }))
}

func TestAPidReusedByAnotherProcessIsNotTheHolder(t *testing.T) {
	l, _ := newLocal(t, "h100-pcie-nvlink")
	ctx := context.Background()
	_, holder := sleeper(t)
	holder.StartTime++ // the same pid, another process
	r := ask(t, "stale", "alice", Ask{GPUs: 1})
	r.Holder = holder
	require.NoError(t, l.mutate(ctx, func(s *State) error {
		s.Allocations = append(s.Allocations, Allocation{Request: r})
		return nil
	}))
	s, err := l.State(ctx)
	require.NoError(t, err)
	assert.Empty(t, s.Allocations, "an allocation whose pid now names another process is freed")
}

func TestQueuePolicies(t *testing.T) {
	hour := time.Hour
	minute := time.Minute
	for _, tc := range []struct {
		policy string
		// waiters in arrival order: name, user, priority, duration
		waiters []Request
		want    []string
	}{
		{policy: "FCFS", waiters: []Request{{Name: "w1", User: "a"}, {Name: "w2", User: "b", Priority: 9}}, want: []string{"w1", "w2"}},
		{policy: "Priority", waiters: []Request{{Name: "low", User: "a"}, {Name: "high", User: "b", Priority: 9}}, want: []string{"high", "low"}},
		{policy: "ShortestJobFirst", waiters: []Request{{Name: "long", User: "a", Duration: &hour}, {Name: "short", User: "b", Duration: &minute}},
			want: []string{"short", "long"}},
		// alice already holds a GPU: bob's request goes first.
		{policy: "FairShare", waiters: []Request{{Name: "alice-2", User: "alice"}, {Name: "bob-1", User: "bob"}}, want: []string{"bob-1", "alice-2"}},
	} {
		t.Run(tc.policy, func(t *testing.T) {
			l, _ := newLocal(t, "h100-pcie-nvlink")
			ctx := context.Background()
			require.NoError(t, l.SetPolicy(ctx, tc.policy))
			// Every GPU is held: everyone waits; the blocker's two GPUs
			// then serve one waiter of two GPUs.
			_, err := l.Acquire(ctx, ask(t, "alice-1", "alice", Ask{GPUs: 1}), nil)
			require.NoError(t, err)
			_, err = l.Acquire(ctx, ask(t, "filler", "dave", Ask{GPUs: 1}), nil)
			require.NoError(t, err)
			_, err = l.Acquire(ctx, ask(t, "blocker", "carol", Ask{GPUs: 2}), nil)
			require.NoError(t, err)
			for _, w := range tc.waiters {
				r := ask(t, w.Name, w.User, Ask{GPUs: 2})
				r.Priority, r.Duration = w.Priority, w.Duration
				require.NoError(t, l.Enqueue(ctx, r))
				time.Sleep(2 * time.Millisecond) // distinct arrival times
			}
			s, err := l.State(ctx)
			require.NoError(t, err)
			var order []string
			for _, w := range l.Order(s) {
				order = append(order, w.Name)
			}
			assert.Equal(t, tc.want, order)
			// The first in order gets the next free GPU.
			require.NoError(t, l.Release(ctx, "blocker", "carol"))
			st, err := l.Poll(ctx, tc.want[0])
			require.NoError(t, err)
			assert.NotNil(t, st.Allocation, "%s is served first", tc.want[0])
			st, err = l.Poll(ctx, tc.want[1])
			require.NoError(t, err)
			assert.Equal(t, 1, st.Position, "%s still waits", tc.want[1])
		})
	}
}

func TestDrainKeepsNewWorkOff(t *testing.T) {
	l, _ := newLocal(t, "h100-pcie-nvlink")
	ctx := context.Background()
	a, err := l.Acquire(ctx, ask(t, "kept", "alice", Ask{GPUs: 1}), nil)
	require.NoError(t, err)
	var others []string
	for _, d := range l.cfg.Machine.devices {
		if u := allocator.StringAttribute(d, "uuid"); u != "" && u != a.Devices[0].UUID && allocator.StringAttribute(d, "type") == "gpu" {
			others = append(others, u)
		}
	}
	require.Len(t, others, 3)
	for _, u := range append(others, a.Devices[0].UUID) {
		require.NoError(t, l.Drain(ctx, u, true))
	}
	other := others[0]
	require.NoError(t, l.Enqueue(ctx, ask(t, "new", "bob", Ask{GPUs: 1})))
	st, err := l.Poll(ctx, "new")
	require.NoError(t, err)
	assert.Nil(t, st.Allocation, "both GPUs drained: the new request waits")
	s, err := l.State(ctx)
	require.NoError(t, err)
	assert.True(t, slices.ContainsFunc(s.Allocations, func(x Allocation) bool { return x.Name == "kept" }), "the holder keeps its GPU")
	assert.Contains(t, s.Drained, a.Devices[0].UUID)
	require.NoError(t, l.Drain(ctx, other, false))
	st, err = l.Poll(ctx, "new")
	require.NoError(t, err)
	require.NotNil(t, st.Allocation)
	assert.Equal(t, []string{other}, uuids(*st.Allocation))
	assert.ErrorContains(t, l.Drain(ctx, "GPU-nope", true), "no GPU GPU-nope")
}

func TestCorruptStateIsRebuilt(t *testing.T) {
	l, dir := newLocal(t, "h100-pcie-nvlink")
	ctx := context.Background()
	require.NoError(t, os.WriteFile(filepath.Join(dir, stateFile), []byte("{not json"), 0o644))
	a, err := l.Acquire(ctx, ask(t, "after", "alice", Ask{GPUs: 2}), nil)
	require.NoError(t, err, "a corrupt state file is not fatal")
	assert.Len(t, a.Devices, 2)
	aside, _ := filepath.Glob(filepath.Join(dir, stateFile+".corrupt-*"))
	assert.Len(t, aside, 1, "the corrupt file is kept aside")
}

func TestReleaseIsTheOwnersOnly(t *testing.T) {
	l, _ := newLocal(t, "h100-pcie-nvlink")
	ctx := context.Background()
	_, err := l.Acquire(ctx, ask(t, "mine", "alice", Ask{GPUs: 1}), nil)
	require.NoError(t, err)
	assert.ErrorContains(t, l.Release(ctx, "mine", "bob"), "alice's allocation")
	assert.ErrorContains(t, l.Enqueue(ctx, ask(t, "mine", "bob", Ask{GPUs: 1})), "in use")
	assert.ErrorContains(t, l.Enqueue(ctx, ask(t, "huge", "bob", Ask{GPUs: 5})), "can never be met")
	require.NoError(t, l.Release(ctx, "mine", "alice"))
}

// firstDocOfKind is the first document of a multi-document YAML file
// whose kind is kind.
func firstDocOfKind(t *testing.T, data []byte, kind string) []byte {
	t.Helper()
	for _, doc := range strings.Split(string(data), "\n---") {
		if strings.Contains(doc, "kind: "+kind) {
			return []byte(doc)
		}
	}
	t.Fatalf("no %s", kind)
	return nil
}

// The devices part of a claim written for the cluster gets the same
// choice here as from the cluster's allocator over the same slices.
func TestRequestFileMeansWhatItMeansInTheCluster(t *testing.T) {
	data, err := os.ReadFile("../../examples/nvlink-pair/nvlink-pair.yaml")
	require.NoError(t, err)
	dc, err := ParseDevices(firstDocOfKind(t, data, "ResourceClaimTemplate"))
	require.NoError(t, err)
	l, _ := newLocal(t, "h100-pcie-nvlink")
	ctx := context.Background()
	r := Request{Name: "pair", User: "alice", Devices: dc}
	a, err := l.Acquire(ctx, r, nil)
	require.NoError(t, err)
	cluster, err := allocator.Plan(ctx, allocator.Input{Claims: []*resourceapi.ResourceClaim{claim(r, nil)},
		Slices: l.cfg.Machine.Slices, Classes: Classes(), Strategy: allocator.FewestNVLinkDomains})
	require.NoError(t, err)
	assert.Equal(t, cluster.Allocations[0].Result.Devices.Results, a.Result.Devices.Results)
	require.Len(t, a.Devices, 2)
	assert.Equal(t, a.Devices[0].NVLinkDomain, a.Devices[1].NVLinkDomain, "the example's matchAttribute holds")
}

func TestPluginAndLocalRefuseEachOther(t *testing.T) {
	pluginDir := t.TempDir()
	assert.NoError(t, CheckNoPlugin(pluginDir))
	require.NoError(t, os.WriteFile(filepath.Join(pluginDir, "checkpoint.json"), []byte("{}"), 0o600))
	assert.ErrorContains(t, CheckNoPlugin(pluginDir), filepath.Join(pluginDir, "checkpoint.json"))

	l, dir := newLocal(t, "h100-pcie-nvlink")
	assert.NoError(t, CheckNoAllocations(dir), "nothing allocated")
	_, err := l.Acquire(context.Background(), ask(t, "held", "alice", Ask{GPUs: 1}), nil)
	require.NoError(t, err)
	assert.ErrorContains(t, CheckNoAllocations(dir), "holds or queues 1 request")
	require.NoError(t, l.Release(context.Background(), "held", "alice"))
	assert.NoError(t, CheckNoAllocations(dir))
}

func TestKilledWaiterLeavesTheQueue(t *testing.T) {
	l, _ := newLocal(t, "h100-pcie-nvlink")
	ctx := context.Background()
	_, err := l.Acquire(ctx, ask(t, "all", "alice", Ask{GPUs: 4}), nil)
	require.NoError(t, err)
	cmd, holder := sleeper(t)
	r := ask(t, "waits", "bob", Ask{GPUs: 1})
	r.Holder = holder
	require.NoError(t, l.Enqueue(ctx, r))
	s, err := l.State(ctx)
	require.NoError(t, err)
	require.Len(t, s.Waiters, 1)
	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	_ = cmd.Wait()
	s, err = l.State(ctx)
	require.NoError(t, err)
	assert.Empty(t, s.Waiters, "a waiter that is killed leaves the queue")
	require.NoError(t, l.Release(ctx, "all", "alice"))
	s, err = l.State(ctx)
	require.NoError(t, err)
	assert.Empty(t, s.Allocations, "nothing granted to the dead waiter")
}

func TestEstimatedStarts(t *testing.T) {
	now := time.Date(2026, 11, 24, 12, 0, 0, 0, time.UTC)
	hour, half := time.Hour, 30*time.Minute
	dev := func(n int) []Device { return make([]Device, n) }
	s := &State{Allocations: []Allocation{
		{Request: Request{Name: "a", Duration: &hour}, Devices: dev(2), Since: now.Add(-half)}, // ends 12:30
		{Request: Request{Name: "b"}, Devices: dev(1), Since: now},                             // no declared end
	}}
	w := func(name string, n int64, d *time.Duration) Waiter {
		dc, err := Devices(Ask{GPUs: n})
		require.NoError(t, err)
		return Waiter{Request: Request{Name: name, Devices: dc, Duration: d}}
	}
	// 4 GPUs, 3 held: w1 (1 GPU, an hour) starts now; w2 (2, half an
	// hour) when a ends at 12:30; w3 (2) when w1 and w2 end at 13:00; w4
	// (2) needs b's GPU or w3's, whose ends nobody declared.
	order := []Waiter{w("w1", 1, &hour), w("w2", 2, &half), w("w3", 2, nil), w("w4", 2, nil)}
	rows := Ps(s, order, now, 4)
	starts := map[string]*time.Time{}
	for _, r := range rows {
		if r.State == "Waiting" {
			starts[r.Name] = r.EstimatedStart
		}
	}
	require.NotNil(t, starts["w1"])
	assert.Equal(t, now, *starts["w1"])
	require.NotNil(t, starts["w2"])
	assert.Equal(t, now.Add(half), *starts["w2"])
	require.NotNil(t, starts["w3"])
	assert.Equal(t, now.Add(hour), *starts["w3"])
	assert.Nil(t, starts["w4"], "depends on an end nobody declared")
}

func TestTimeSlicingSharesOnlyWithTimeSlicing(t *testing.T) {
	l, _ := newLocal(t, "h100-pcie-nvlink")
	ctx := context.Background()
	shared := func(name string, gpus int64) Request {
		r := ask(t, name, "alice", Ask{GPUs: gpus})
		r.Share = ShareTimeSlicing
		return r
	}
	ts1, err := l.Acquire(ctx, shared("ts-1", 4), nil)
	require.NoError(t, err)
	require.NoError(t, l.Enqueue(ctx, shared("ts-2", 4)))
	st, err := l.Poll(ctx, "ts-2")
	require.NoError(t, err)
	require.NotNil(t, st.Allocation, "time-slicing requests share the machine's GPUs")
	assert.ElementsMatch(t, uuids(ts1), uuids(*st.Allocation))
	require.NoError(t, l.Enqueue(ctx, ask(t, "exclusive", "bob", Ask{GPUs: 1})))
	st, err = l.Poll(ctx, "exclusive")
	require.NoError(t, err)
	assert.Nil(t, st.Allocation, "an exclusive request never shares a time-sliced GPU")
	require.NoError(t, l.Release(ctx, "ts-1", "alice"))
	st, err = l.Poll(ctx, "exclusive")
	require.NoError(t, err)
	assert.Nil(t, st.Allocation, "ts-2 still holds every GPU")
	require.NoError(t, l.Release(ctx, "ts-2", "alice"))
	st, err = l.Poll(ctx, "exclusive")
	require.NoError(t, err)
	assert.NotNil(t, st.Allocation)
}

// A look that changes nothing does not rewrite the state: waiters look
// every poll, and each write is two fsyncs.
func TestIdleLookWritesNothing(t *testing.T) {
	l, dir := newLocal(t, "h100-pcie-nvlink")
	ctx := context.Background()
	_, err := l.Acquire(ctx, ask(t, "all", "alice", Ask{GPUs: 4}), nil)
	require.NoError(t, err)
	require.NoError(t, l.Enqueue(ctx, ask(t, "waits", "bob", Ask{GPUs: 1})))
	stamp := func() string {
		var st syscall.Stat_t
		require.NoError(t, syscall.Stat(ownFile(dir), &st))
		return fmt.Sprintf("%d/%d.%d", st.Ino, st.Mtim.Sec, st.Mtim.Nsec)
	}
	read := func() string {
		b, err := os.ReadFile(ownFile(dir))
		require.NoError(t, err)
		return string(b)
	}
	before, content := stamp(), read()
	for range 3 {
		st, err := l.Poll(ctx, "waits")
		require.NoError(t, err)
		assert.Equal(t, 1, st.Position)
	}
	assert.Equal(t, before, stamp(), "the state file was not rewritten")
	require.NoError(t, l.Release(ctx, "all", "alice"))
	assert.NotEqual(t, content, read(), "a change is written")
}
