package local

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/sharing"
)

// openWithPlugin is a local state that checks the plugin directory it
// returns (empty) before every change.
func openWithPlugin(t *testing.T) (*Local, string, string) {
	t.Helper()
	pluginDir := filepath.Join(t.TempDir(), "plugin")
	l, _, dir := openLocal(t, "h100-pcie-nvlink", false, func(c *Config) { c.PluginDataDir = pluginDir })
	return l, dir, pluginDir
}

// The other side runs inside one side's window between its check and its
// change (a hook), and is given 300 ms there: with the shared lock it
// waits until the window closes and then refuses; without, both pass.
func TestLocalAndPluginClaimTheMachineUnderOneLock(t *testing.T) {
	ctx := context.Background()
	t.Run("the plugin starts while local is between its check and its change", func(t *testing.T) {
		l, dir, pluginDir := openWithPlugin(t)
		claimed := make(chan error, 1)
		testHookLocalChecked = func() {
			testHookLocalChecked = nil
			go func() { claimed <- ClaimForPlugin(ctx, dir, pluginDir) }()
			select {
			case err := <-claimed:
				claimed <- err
			case <-time.After(300 * time.Millisecond):
			}
		}
		t.Cleanup(func() { testHookLocalChecked = nil })
		errLocal := l.Enqueue(ctx, ask(t, "mine", "alice", Ask{GPUs: 1}))
		var errPlugin error
		select {
		case errPlugin = <-claimed:
		case <-time.After(10 * time.Second):
			t.Fatal("the plugin's claim did not end")
		}
		require.NoError(t, errLocal, "local checked first")
		require.Error(t, errPlugin, "the plugin and local both took the machine")
		assert.Contains(t, errPlugin.Error(), "gpudra local holds or queues 1 request(s)")
		_, err := os.Stat(filepath.Join(pluginDir, "state.lock"))
		assert.True(t, os.IsNotExist(err), "the refused plugin took its mark back")
		assert.NoError(t, l.Release(ctx, "mine", "alice"), "local goes on")
	})
	t.Run("local changes its state while the plugin is between its check and its start", func(t *testing.T) {
		l, dir, pluginDir := openWithPlugin(t)
		enqueued := make(chan error, 1)
		testHookPluginLocked = func() {
			go func() { enqueued <- l.Enqueue(ctx, ask(t, "mine", "alice", Ask{GPUs: 1})) }()
			select {
			case err := <-enqueued:
				enqueued <- err
			case <-time.After(300 * time.Millisecond):
			}
		}
		t.Cleanup(func() { testHookPluginLocked = nil })
		errPlugin := ClaimForPlugin(ctx, dir, pluginDir)
		var errLocal error
		select {
		case errLocal = <-enqueued:
		case <-time.After(10 * time.Second):
			t.Fatal("local's change did not end")
		}
		require.NoError(t, errPlugin, "the plugin checked first")
		require.Error(t, errLocal, "the plugin and local both took the machine")
		assert.Contains(t, errLocal.Error(), "gpudra's kubelet plugin manages this machine's GPUs")
		assert.NoError(t, CheckNoAllocations(dir), "nothing was queued")
	})
}

// A plugin directory that cannot be searched (here: a path through a
// file) is no proof that the plugin is absent.
func TestCheckNoPluginRefusesWhatItCannotSee(t *testing.T) {
	file := filepath.Join(t.TempDir(), "file")
	require.NoError(t, os.WriteFile(file, nil, 0o600))
	assert.ErrorContains(t, CheckNoPlugin(filepath.Join(file, "plugin")), "cannot tell whether gpudra's kubelet plugin manages")
}

// A holder recorded in another boot is gone even where its pid and start
// time name a running process now (pids and start times begin again at
// each boot).
func TestAHolderFromAnotherBootIsGone(t *testing.T) {
	l, _, _ := openLocal(t, "h100-pcie-nvlink", false, func(c *Config) { c.BootID = "boot-2" })
	ctx := context.Background()
	_, holder := sleeper(t)
	now := ask(t, "this-boot", "alice", Ask{GPUs: 1})
	now.Holder, now.Holder.BootID = holder, "boot-2"
	before := ask(t, "before-reboot", "bob", Ask{GPUs: 1})
	before.Holder, before.Holder.BootID = holder, "boot-1"
	require.NoError(t, l.mutate(ctx, func(s *State) error {
		s.Allocations = append(s.Allocations, Allocation{Request: now}, Allocation{Request: before})
		return nil
	}))
	s, err := l.State(ctx)
	require.NoError(t, err)
	require.Len(t, s.Allocations, 1, "the holder of the other boot is gone")
	assert.Equal(t, "this-boot", s.Allocations[0].Name)

	self, err := HolderOf("/proc", os.Getpid())
	require.NoError(t, err)
	assert.NotEmpty(t, self.BootID, "a holder records its boot")
}

// failingControl is an MPS control whose daemon never starts.
type failingControl struct{ starts atomic.Int32 }

func (f *failingControl) Start([]string) (int, error) {
	f.starts.Add(1)
	return 0, errors.New("injected: the daemon cannot start")
}
func (f *failingControl) Command(context.Context, []string, string) error { return errors.New("none") }
func (f *failingControl) Alive(int) bool                                  { return false }
func (f *failingControl) Kill(int) error                                  { return nil }

// A grant that fails, run by another user's command, fails the request
// with its error: recorded, shown by ps, returned to its requester, and
// not tried again.
func TestAFailedGrantFailsTheRequest(t *testing.T) {
	ctl := &failingControl{}
	l, _, _ := openLocal(t, "h100-pcie-nvlink", false, func(c *Config) {
		c.MPS = &sharing.ProcessServers{Root: filepath.Join(c.StateDir, "mps"), Control: ctl}
	})
	ctx := context.Background()
	mps := func(name string) Request {
		r := ask(t, name, "bob", Ask{GPUs: 1})
		r.Share, r.MPS = ShareMPS, &MPSLimits{}
		return r
	}
	_, err := l.Acquire(ctx, ask(t, "all", "alice", Ask{GPUs: 4}), nil)
	require.NoError(t, err)
	require.NoError(t, l.Enqueue(ctx, mps("bob-mps")))
	// Alice's release runs the round that grants bob's request.
	require.NoError(t, l.Release(ctx, "all", "alice"))
	for range 3 {
		_, err := l.State(ctx)
		require.NoError(t, err)
	}
	assert.Equal(t, int32(1), ctl.starts.Load(), "tried once, not at every look")
	s, err := l.State(ctx)
	require.NoError(t, err)
	rows := Ps(s, l.Order(s), time.Now(), l.Capacity())
	require.Len(t, rows, 1)
	assert.Equal(t, "Failed", rows[0].State)
	assert.Contains(t, rows[0].Error, "injected: the daemon cannot start")
	_, err = l.Poll(ctx, "bob-mps")
	var failed *GrantFailedError
	require.ErrorAs(t, err, &failed)
	assert.Contains(t, err.Error(), "injected: the daemon cannot start")

	// The requester's own wait ends with the error, and withdraws it.
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	_, err = l.Acquire(wctx, mps("bob-2"), nil)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "request bob-2 failed: granting it failed: MPS server for GPU-")
	assert.Contains(t, err.Error(), "injected: the daemon cannot start")
	assert.NoError(t, wctx.Err(), "failed at once, not after waiting")
	s, err = l.State(ctx)
	require.NoError(t, err)
	assert.False(t, s.find("bob-2"), "withdrawn: its name is free again")
	assert.True(t, s.find("bob-mps"), "kept until its requester has seen it")
}
