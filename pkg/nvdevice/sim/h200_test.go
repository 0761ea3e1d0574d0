package sim

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// TestHGXH200Machines: the H200 boards are the DGX H100 board (PCI buses,
// PCIe roots, NUMA nodes, NVSwitch links, one NVLink domain) with H200s on
// it, MIG mode on or off. The product figures and the profile table are
// compared with the real H200 in cmd/gpudra (TestInventoryMatchesRealGPU).
func TestHGXH200Machines(t *testing.T) {
	h100 := inventory(t, mustBuiltin(t, "dgx-h100", "node-a"))
	for _, tc := range []struct {
		machine string
		mig     bool
	}{
		{"hgx-h200", true},
		{"hgx-h200-nomig", false},
	} {
		t.Run(tc.machine, func(t *testing.T) {
			inv := inventory(t, mustBuiltin(t, tc.machine, "node-a"))
			require.Len(t, inv.GPUs, 8)
			for i, g := range inv.GPUs {
				assert.Equal(t, "NVIDIA H200", g.ProductName)
				assert.Equal(t, uint64(143771), g.MemoryMiB)
				assert.Equal(t, "10de:2335", g.PCI.DeviceID)
				assert.Equal(t, nvdevice.Engines{Multiprocessors: 132, CopyEngines: 8, Decoders: 7, JPEGEngines: 7, OFAEngines: 1}, g.Engines)
				assert.Equal(t, h100.GPUs[i].PCI.BusID, g.PCI.BusID)
				assert.Equal(t, h100.GPUs[i].PCI.PCIeRoot, g.PCI.PCIeRoot)
				assert.Equal(t, h100.GPUs[i].NUMANode, g.NUMANode)
				assert.Equal(t, 18, g.NVLink.ActiveLinks())
				assert.Equal(t, inv.GPUs[0].NVLink.Domain, g.NVLink.Domain, "one NVSwitch domain")
				assert.NotEmpty(t, g.NVLink.Domain)
				assert.Empty(t, g.NVLink.FabricClique)
				assert.True(t, g.MIG.Capable)
				assert.Equal(t, tc.mig, g.MIG.Enabled)
				assert.Len(t, g.MIG.Profiles, 7)
			}
		})
	}
}

// TestH200MigRules: the H200's profiles obey the same hardware rules as the
// H100's, under their own names.
func TestH200MigRules(t *testing.T) {
	ctx := context.Background()
	m := mustBuiltin(t, "hgx-h200", "node-a")
	gpu := inventory(t, m).GPUs[0].UUID
	create := func(profile string, start int) (*nvdevice.MigDevice, error) {
		return m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: profile, Start: start})
	}
	_, err := create("1g.10gb", 0)
	require.Error(t, err, "an H100 profile name is no H200 profile")
	_, err = create("3g.71gb", 2)
	require.ErrorIs(t, err, nvdevice.ErrInvalidPlacement)

	d, err := create("3g.71gb", 4)
	require.NoError(t, err)
	assert.Equal(t, uint64(71424), d.MemoryMiB)
	assert.Equal(t, 60, d.Engines.Multiprocessors)
	_, err = create("1g.18gb", 4)
	require.ErrorIs(t, err, nvdevice.ErrInsufficientResources, "overlaps the 3g.71gb")
	d, err = create("4g.71gb", 0)
	require.NoError(t, err)
	assert.Equal(t, nvdevice.Placement{Start: 0, Size: 4}, d.Placement)
	_, err = create("1g.18gb+me", 6)
	require.ErrorIs(t, err, nvdevice.ErrInsufficientResources, "no memory slice left")

	// Seven 1g.18gb on the next GPU, and no eighth.
	gpu = inventory(t, m).GPUs[1].UUID
	for s := 0; s < 7; s++ {
		_, err := create("1g.18gb", s)
		require.NoError(t, err, "start %d", s)
	}
	_, err = create("1g.18gb+me", 6)
	require.ErrorIs(t, err, nvdevice.ErrInsufficientResources)
}

func mustBuiltin(t *testing.T, name, node string) *Machine {
	t.Helper()
	m, err := NewBuiltin(name, node)
	require.NoError(t, err)
	return m
}
