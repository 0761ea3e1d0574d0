package sim

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

func inventory(t *testing.T, m *Machine) *nvdevice.Inventory {
	t.Helper()
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	return inv
}

// TestDGXH100Figures checks the simulated DGX H100 against ../shared/facts/h100.md.
func TestDGXH100Figures(t *testing.T) {
	m, err := NewBuiltin("dgx-h100", "node-a")
	require.NoError(t, err)
	inv := inventory(t, m)
	require.Len(t, inv.GPUs, 8)
	domain := inv.GPUs[0].NVLink.Domain
	require.NotEmpty(t, domain)
	for i, g := range inv.GPUs {
		assert.Equal(t, i, g.Index)
		assert.Equal(t, "NVIDIA H100 80GB HBM3", g.ProductName)
		assert.Equal(t, uint64(81559), g.MemoryMiB)
		assert.Equal(t, "9.0", g.CUDAComputeCapability)
		assert.Equal(t, "Hopper", g.Architecture)
		assert.Equal(t, 132, g.Engines.Multiprocessors)
		assert.Equal(t, "10de:2330", g.PCI.DeviceID)
		assert.Regexp(t, `^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`, g.UUID)
		assert.Regexp(t, `^[0-9a-f]{4}:[0-9a-f]{2}:00\.0$`, g.PCI.BusID)
		assert.True(t, g.MIG.Capable)
		assert.Len(t, g.NVLink.Links, 18)
		assert.Equal(t, 18, g.NVLink.ActiveLinks())
		assert.Equal(t, domain, g.NVLink.Domain, "all 8 GPUs share one NVSwitch domain")
		assert.Empty(t, g.NVLink.FabricClique, "HGX H100 reports a zero fabric cluster UUID")
		assert.Len(t, g.MIG.Profiles, 7)
	}
	assert.Equal(t, 0, inv.GPUs[0].NUMANode)
	assert.Equal(t, 1, inv.GPUs[7].NUMANode)
}

// TestH100ProfileTable is the facts table, row by row.
func TestH100ProfileTable(t *testing.T) {
	type row struct {
		id, nvml, max      int
		memMiB             uint64
		sms, ce, dec, jpeg int
		ofa                int
		starts             []int
		size               int
	}
	want := map[string]row{
		"1g.10gb":    {19, 0, 7, 9984, 16, 1, 1, 1, 0, []int{0, 1, 2, 3, 4, 5, 6}, 1},
		"1g.10gb+me": {20, 7, 1, 9984, 16, 1, 1, 1, 1, []int{0, 1, 2, 3, 4, 5, 6}, 1},
		"1g.20gb":    {15, 9, 4, 20096, 26, 1, 1, 1, 0, []int{0, 2, 4, 6}, 2},
		"2g.20gb":    {14, 1, 3, 20096, 32, 2, 2, 2, 0, []int{0, 2, 4}, 2},
		"3g.40gb":    {9, 2, 2, 40448, 60, 3, 3, 3, 0, []int{0, 4}, 4},
		"4g.40gb":    {5, 3, 1, 40448, 64, 4, 4, 4, 0, []int{0}, 4},
		"7g.80gb":    {0, 4, 1, 81152, 132, 8, 7, 7, 1, []int{0}, 8},
	}
	m, err := NewBuiltin("dgx-h100", "node-a")
	require.NoError(t, err)
	profiles := inventory(t, m).GPUs[0].MIG.Profiles
	require.Len(t, profiles, len(want))
	for _, p := range profiles {
		t.Run(p.Name, func(t *testing.T) {
			w, ok := want[p.Name]
			require.True(t, ok, "unexpected profile")
			assert.Equal(t, w.id, p.ID)
			assert.Equal(t, w.nvml, p.NVMLIndex)
			assert.Equal(t, w.max, p.MaxInstances)
			assert.Equal(t, w.memMiB, p.MemoryMiB)
			assert.Equal(t, nvdevice.Engines{Multiprocessors: w.sms, CopyEngines: w.ce, Decoders: w.dec, JPEGEngines: w.jpeg, OFAEngines: w.ofa}, p.Engines)
			assert.Equal(t, 0, p.Engines.Encoders, "H100 profiles have no encoders")
			var starts []int
			for _, pl := range p.Placements {
				starts = append(starts, pl.Start)
				assert.Equal(t, w.size, pl.Size)
			}
			assert.Equal(t, w.starts, starts)
		})
	}
}

func TestDeterministicIdentity(t *testing.T) {
	a1, err := NewBuiltin("dgx-h100", "node-a")
	require.NoError(t, err)
	a2, err := NewBuiltin("dgx-h100", "node-a")
	require.NoError(t, err)
	b, err := NewBuiltin("dgx-h100", "node-b")
	require.NoError(t, err)
	ia, ia2, ib := inventory(t, a1), inventory(t, a2), inventory(t, b)
	assert.Equal(t, ia, ia2, "same node, same GPUs")
	seen := map[string]bool{}
	for i := range ia.GPUs {
		assert.NotEqual(t, ia.GPUs[i].UUID, ib.GPUs[i].UUID, "different nodes, different UUIDs")
		assert.False(t, seen[ia.GPUs[i].UUID], "UUIDs unique within a node")
		seen[ia.GPUs[i].UUID] = true
	}
	assert.NotEqual(t, ia.GPUs[0].NVLink.Domain, ib.GPUs[0].NVLink.Domain, "NVLink domains are per node")
}

func TestMachines(t *testing.T) {
	pcie, err := NewBuiltin("h100-pcie", "n")
	require.NoError(t, err)
	inv := inventory(t, pcie)
	require.Len(t, inv.GPUs, 2)
	for _, g := range inv.GPUs {
		assert.Equal(t, "NVIDIA H100 PCIe", g.ProductName)
		assert.Equal(t, 114, g.Engines.Multiprocessors)
		assert.Empty(t, g.NVLink.Links)
		assert.Empty(t, g.NVLink.Domain, "no NVLink, no domain")
	}

	fabric, err := NewBuiltin("h100-nvlink-fabric", "n1")
	require.NoError(t, err)
	other, err := NewBuiltin("h100-nvlink-fabric", "n2")
	require.NoError(t, err)
	g1, g2 := inventory(t, fabric).GPUs[0], inventory(t, other).GPUs[3]
	assert.Equal(t, defaultClusterUUID+".1", g1.NVLink.FabricClique)
	assert.Equal(t, g1.NVLink.FabricClique, g1.NVLink.Domain)
	assert.Equal(t, g1.NVLink.Domain, g2.NVLink.Domain, "nodes of one clique share the multi-node domain")

	nomig, err := NewBuiltin("dgx-h100-nomig", "n")
	require.NoError(t, err)
	assert.False(t, inventory(t, nomig).GPUs[0].MIG.Enabled)
}

func TestInventoryIsACopy(t *testing.T) {
	m, err := NewBuiltin("dgx-h100", "n")
	require.NoError(t, err)
	inv := inventory(t, m)
	inv.GPUs[0].MIG.Profiles[0].Placements[0].Start = 99
	inv.GPUs[0].NVLink.Links[0].Active = false
	fresh := inventory(t, m)
	assert.Equal(t, 0, fresh.GPUs[0].MIG.Profiles[0].Placements[0].Start)
	assert.True(t, fresh.GPUs[0].NVLink.Links[0].Active)
}
