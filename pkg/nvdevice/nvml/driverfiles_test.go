//go:build cgo && linux

package nvml

import (
	"context"
	"sort"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

// TestDriverFilesFromFakeRoot runs the toolkit's nvcdi over the simulator's
// fake driver root: it finds the same files and hooks that the simulator's
// hand-written discovery gives, so tests on the simulator see what a real
// node would write.
func TestDriverFilesFromFakeRoot(t *testing.T) {
	root := t.TempDir()
	require.NoError(t, sim.WriteDriverRoot(root, "570.172.08"))
	got, err := discoverDriverFiles(context.Background(), root)
	require.NoError(t, err)
	assert.Equal(t, "570.172.08", got.Version)
	assert.Equal(t, root, got.Root)

	m, err := sim.NewBuiltin("dgx-h100", "node-a")
	require.NoError(t, err)
	m.SetDriverRoot(root)
	want, err := m.DriverFiles(context.Background())
	require.NoError(t, err)

	byPath := func(ms []nvdevice.DriverMount) []nvdevice.DriverMount {
		out := append([]nvdevice.DriverMount(nil), ms...)
		sort.Slice(out, func(i, j int) bool { return out[i].ContainerPath < out[j].ContainerPath })
		return out
	}
	assert.Equal(t, byPath(want.Mounts), byPath(got.Mounts))
	assert.ElementsMatch(t, want.Hooks, got.Hooks)
	assert.Equal(t, want.Env, got.Env)
}

func TestDriverFilesWithoutDriver(t *testing.T) {
	_, err := discoverDriverFiles(context.Background(), t.TempDir())
	require.Error(t, err)
}
