package sim

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func TestDevNodesMatchHost(t *testing.T) {
	m, err := NewBuiltin("dgx-h100", "node-a")
	require.NoError(t, err)
	host, err := m.Host(context.Background())
	require.NoError(t, err)
	nodes := map[string]DevNode{}
	for _, n := range m.DevNodes() {
		_, dup := nodes[n.Path]
		require.False(t, dup, "%s twice", n.Path)
		nodes[n.Path] = n
	}
	// 3 control nodes, config and monitor, and per GPU its node and 15
	// GPU instances of one access node and 8 compute instances each.
	assert.Len(t, nodes, 3+2+8*(1+15*9))
	assert.Equal(t, DevNode{Path: "/dev/nvidia7", Major: 195, Minor: 7}, nodes["/dev/nvidia7"])
	// Every existing MIG device's capability nodes are there, with the
	// numbers Host gives the plugin for its CDI specs.
	for _, g := range m.Devices() {
		for _, d := range g.MIG.Devices {
			gi, ci, err := host.CapMinors(g.Minor, d.GPUInstanceID, d.ComputeInstanceID)
			require.NoError(t, err)
			for _, minor := range []int{gi, ci} {
				n, ok := nodes[filepathCap(minor)]
				require.True(t, ok, "MIG device %s: no node for capability minor %d", d.UUID, minor)
				assert.Equal(t, uint32(host.Majors.Caps), n.Major)
			}
		}
	}
}

func filepathCap(minor int) string { return "/dev/nvidia-caps/nvidia-cap" + strconv.Itoa(minor) }

func TestWriteDevNodes(t *testing.T) {
	m, err := NewBuiltin("h100-pcie", "node-a")
	require.NoError(t, err)
	root := t.TempDir()
	err = m.WriteDevNodes(root)
	if os.Geteuid() != 0 {
		require.ErrorIs(t, err, ErrDevNodesRefused, "not root: refused, and said so")
		_, statErr := os.Stat(filepath.Join(root, "dev"))
		assert.True(t, errors.Is(statErr, os.ErrNotExist), "nothing half made")
		return
	}
	require.NoError(t, err)
	for _, n := range m.DevNodes() {
		var st unix.Stat_t
		require.NoError(t, unix.Stat(filepath.Join(root, n.Path), &st), n.Path)
		assert.Equal(t, uint32(unix.S_IFCHR), st.Mode&unix.S_IFMT, "%s is a character device", n.Path)
		assert.Equal(t, n.Major, unix.Major(st.Rdev), n.Path)
		assert.Equal(t, n.Minor, unix.Minor(st.Rdev), n.Path)
	}
	require.NoError(t, m.WriteDevNodes(root), "written again over itself")
}
