package local

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/gpudra/gpudra/pkg/nodelock"
)

// One owner per machine: gpudra local and gpudra's kubelet plugin hand out
// the same GPUs, so each refuses while the other holds them. Each checks
// the other and claims the machine under one lock, gpudra local's node
// lock (<state-dir>/state.lock, an flock), so that two starting at once
// never both pass:
//
//   - gpudra local, under its lock, checks the plugin's mark
//     (CheckNoPlugin) before every change of its state (Local.update);
//   - the plugin marks the machine first (its state.lock), then, under the
//     same lock, checks that gpudra local holds and queues nothing
//     (ClaimForPlugin), and takes its mark back if it does.
//
// Either the plugin's check comes after a local change, and sees it, or
// before it, and then its mark came before the change's check too.

// DefaultPluginDataDir is the kubelet plugin's state directory.
const DefaultPluginDataDir = "/var/lib/kubelet/plugins/gpu.gpudra.dev"

// pluginFiles mark a machine as the kubelet plugin's: its checkpoint, and
// its lock (which ClaimForPlugin creates first).
var pluginFiles = []string{"checkpoint.json", "state.lock"}

// Test hooks: between gpudra local's check of the plugin and its change,
// and between the plugin's taking of the lock and its check of the state.
var testHookLocalChecked, testHookPluginLocked func()

// CheckNoPlugin refuses where gpudra's kubelet plugin keeps state: it
// hands the same GPUs to the cluster. A mark it cannot look for (a
// directory it may not search) is a refusal too: a check that cannot see
// is none.
func CheckNoPlugin(pluginDataDir string) error {
	for _, f := range pluginFiles {
		p := filepath.Join(pluginDataDir, f)
		_, err := os.Stat(p)
		if err == nil {
			return fmt.Errorf("gpudra's kubelet plugin manages this machine's GPUs (its state: %s): gpudra local would hand out the same GPUs; use the cluster, or remove the plugin and its state first", p)
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("cannot tell whether gpudra's kubelet plugin manages this machine's GPUs (%w): gpudra local needs to see its state directory (--plugin-data-dir) to refuse where it runs", err)
		}
	}
	return nil
}

// CheckNoAllocations refuses while gpudra local holds or queues anything
// in stateDir: the kubelet plugin must not start then. It reads the state
// as it is and does not free dead holders (the plugin's container cannot
// see the holders' processes): gpudra local ps does. ClaimForPlugin
// checks it under gpudra local's lock.
func CheckNoAllocations(stateDir string) error {
	s, err := ReadState(stateDir)
	if err != nil {
		return fmt.Errorf("gpudra local state %s is unreadable (%w): run gpudra local ps to rebuild it, or remove it", stateDir, err)
	}
	if s == nil {
		return nil
	}
	if n := len(s.Allocations) + len(s.Waiters); n > 0 {
		return fmt.Errorf("gpudra local holds or queues %d request(s) on this machine (%s): release them (gpudra local ps, gpudra local release) before the kubelet plugin takes the GPUs", n, filepath.Join(stateDir, stateFile))
	}
	return nil
}

// ClaimForPlugin is the kubelet plugin's start (both modes): it marks the
// machine as the plugin's (pluginDataDir/state.lock, created if missing,
// private to root as the plugin's own lock is), then checks, under gpudra
// local's lock, that gpudra local holds and queues nothing in stateDir. It
// needs only read access to stateDir (the chart mounts it read-only). On a
// refusal it removes the mark it created.
func ClaimForPlugin(ctx context.Context, stateDir, pluginDataDir string) (err error) {
	if err := os.MkdirAll(pluginDataDir, 0o750); err != nil {
		return fmt.Errorf("plugin data directory: %w", err)
	}
	mark := filepath.Join(pluginDataDir, "state.lock")
	f, err := os.OpenFile(mark, os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o600)
	created := err == nil
	if created {
		_ = f.Close()
	} else if !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("mark the machine as the kubelet plugin's: %w", err)
	}
	defer func() {
		if err != nil && created {
			_ = os.Remove(mark)
		}
	}()
	lock, err := nodelock.OpenReadOnly(filepath.Join(stateDir, lockFile))
	if errors.Is(err, fs.ErrNotExist) {
		// gpudra local has not opened this state: one that does now
		// creates the lock before its first check, and sees the mark.
		return CheckNoAllocations(stateDir)
	}
	if err != nil {
		return err
	}
	defer lock.Close()
	if err := lock.Lock(ctx); err != nil {
		return err
	}
	defer lock.Unlock()
	if testHookPluginLocked != nil {
		testHookPluginLocked()
	}
	return CheckNoAllocations(stateDir)
}
