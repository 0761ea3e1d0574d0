package sim

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestProcessFeed: processes listed in the driver root's feed show in the
// machine's telemetry; a new feed replaces the old (a process no longer
// listed is gone); a broken feed leaves what was read; no feed file after
// one: nothing runs.
func TestProcessFeed(t *testing.T) {
	ctx := context.Background()
	m, err := NewBuiltin("dgx-h100-nomig", "n")
	require.NoError(t, err)
	root := t.TempDir()
	m.SetDriverRoot(root)
	inv, err := m.Inventory(ctx)
	require.NoError(t, err)
	gpu0, gpu1 := inv.GPUs[0].UUID, inv.GPUs[1].UUID
	pidsOn := func() map[string][]int {
		t.Helper()
		samples, err := m.Telemetry(ctx)
		require.NoError(t, err)
		out := map[string][]int{}
		for _, s := range samples {
			for _, p := range s.Processes {
				out[s.UUID] = append(out[s.UUID], int(p.PID))
			}
		}
		return out
	}
	assert.Empty(t, pidsOn(), "no feed: no processes")

	require.NoError(t, WriteProcessFeed(root, []FedProcess{{Device: gpu0, PID: 101, SMShare: 0.5, MemoryBytes: 1 << 30},
		{Device: gpu1, PID: 102, SMShare: 0.1, MemoryBytes: 1 << 20}}))
	assert.Equal(t, map[string][]int{gpu0: {101}, gpu1: {102}}, pidsOn())

	require.NoError(t, WriteProcessFeed(root, []FedProcess{{Device: gpu1, PID: 103, SMShare: 0.2, MemoryBytes: 2 << 20}}))
	assert.Equal(t, map[string][]int{gpu1: {103}}, pidsOn(), "101 and 102 are gone with the feed that listed them")

	require.NoError(t, os.WriteFile(filepath.Join(root, ProcessFeedFile), []byte("{not json"), 0o644))
	assert.Equal(t, map[string][]int{gpu1: {103}}, pidsOn(), "a broken feed changes nothing")

	require.NoError(t, os.Remove(filepath.Join(root, ProcessFeedFile)))
	assert.Empty(t, pidsOn(), "the feed gone: its processes gone")
}
