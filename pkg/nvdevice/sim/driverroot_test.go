package sim

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

func TestDriverRootLayoutAndDiscovery(t *testing.T) {
	root := t.TempDir()
	require.NoError(t, WriteDriverRoot(root, "570.172.08"))
	target, err := os.Readlink(filepath.Join(root, LibDir, "libcuda.so.1"))
	require.NoError(t, err)
	assert.Equal(t, "libcuda.so.570.172.08", target, "soname symlinks as the driver installs them")

	m := newDGX(t)
	_, err = m.DriverFiles(context.Background())
	require.ErrorIs(t, err, nvdevice.ErrNotFound, "no driver root: nothing to discover")

	m.SetDriverRoot(root)
	f, err := m.DriverFiles(context.Background())
	require.NoError(t, err)
	assert.Equal(t, "570.172.08", f.Version)
	assert.Equal(t, root, f.Root)
	ctr := map[string]nvdevice.DriverMount{}
	for _, mt := range f.Mounts {
		ctr[mt.ContainerPath] = mt
		assert.True(t, strings.HasPrefix(mt.HostPath, root+"/"), mt.HostPath)
		assert.Equal(t, filepath.Join(root, mt.ContainerPath), mt.HostPath)
	}
	for _, l := range DriverLibraries {
		p := "/usr/lib/x86_64-linux-gnu/" + l.Name + ".570.172.08"
		require.Contains(t, ctr, p)
		assert.Contains(t, ctr[p].Options, "ro")
	}
	for _, b := range DriverBinaries {
		require.Contains(t, ctr, "/usr/bin/"+b)
	}
	assert.Contains(t, ctr, "/lib/firmware/nvidia/570.172.08/gsp_ga10x.bin")
	assert.Contains(t, ctr, "/run/nvidia-persistenced/socket")
	assert.Len(t, f.Hooks, 3)
	assert.Equal(t, []string{"nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib/x86_64-linux-gnu"}, f.Hooks[2].Args)

	// A driver upgrade replaces the files.
	require.NoError(t, WriteDriverRoot(root, "580.65.06"))
	f, err = m.DriverFiles(context.Background())
	require.NoError(t, err)
	assert.Equal(t, "580.65.06", f.Version)
	for _, mt := range f.Mounts {
		assert.NotContains(t, mt.ContainerPath, "570.172.08")
	}
}

func newDGX(t *testing.T) *Machine {
	t.Helper()
	m, err := NewBuiltin("dgx-h100", "node-a")
	require.NoError(t, err)
	return m
}
