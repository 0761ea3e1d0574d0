package sim

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// TestNVLinkTopologies: what each NVLink topology gives every GPU (its
// links, their far ends) and the NVLink domains AssignNVLinkDomains forms
// from them.
func TestNVLinkTopologies(t *testing.T) {
	tests := []struct {
		name string
		spec MachineSpec
		// domains lists the GPU indexes of each NVLink domain; GPUs in none
		// have no domain.
		domains   [][]int
		links     int
		remote    nvdevice.RemoteKind
		partnerOf func(i int) int // for links to a GPU: the GPU at the far end
	}{
		{
			name:    "built-in h100-pcie-nvlink",
			spec:    builtins["h100-pcie-nvlink"],
			domains: [][]int{{0, 1}, {2, 3}},
			links:   12, remote: nvdevice.RemoteGPU,
			partnerOf: func(i int) int { return i ^ 1 },
		},
		{
			name:    "six bridged PCIe cards",
			spec:    MachineSpec{Name: "x", GPUModel: ModelH100PCIe, GPUCount: 6, NVLink: NVLinkBridgedPairs},
			domains: [][]int{{0, 1}, {2, 3}, {4, 5}},
			links:   12, remote: nvdevice.RemoteGPU,
			partnerOf: func(i int) int { return i ^ 1 },
		},
		{
			name:    "ten bridged PCIe cards, past the first PCI domain",
			spec:    MachineSpec{Name: "x", GPUModel: ModelH100PCIe, GPUCount: 10, NVLink: NVLinkBridgedPairs},
			domains: [][]int{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}},
			links:   12, remote: nvdevice.RemoteGPU,
			partnerOf: func(i int) int { return i ^ 1 },
		},
		{
			name:    "dgx-h100: one NVSwitch domain",
			spec:    builtins["dgx-h100"],
			domains: [][]int{{0, 1, 2, 3, 4, 5, 6, 7}},
			links:   18, remote: nvdevice.RemoteNVSwitch,
		},
		{
			name:  "h100-pcie: no NVLink",
			spec:  builtins["h100-pcie"],
			links: 0,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m, err := New(tc.spec, "node-a")
			require.NoError(t, err)
			inv := inventory(t, m)
			require.Len(t, inv.GPUs, tc.spec.GPUCount)

			byDomain := map[string][]int{}
			for _, g := range inv.GPUs {
				assert.Len(t, g.NVLink.Links, tc.links, "GPU %d", g.Index)
				assert.Equal(t, tc.links, g.NVLink.ActiveLinks(), "GPU %d", g.Index)
				for j, l := range g.NVLink.Links {
					assert.Equal(t, j, l.Index, "GPU %d link %d", g.Index, j)
					assert.Equal(t, tc.remote, l.RemoteKind, "GPU %d link %d", g.Index, j)
					if tc.partnerOf != nil {
						assert.Equal(t, inv.GPUs[tc.partnerOf(g.Index)].PCI.BusID, l.RemoteBusID,
							"GPU %d link %d goes to its partner", g.Index, j)
					}
				}
				assert.Empty(t, g.NVLink.FabricClique, "no multi-node fabric")
				if g.NVLink.Domain != "" {
					byDomain[g.NVLink.Domain] = append(byDomain[g.NVLink.Domain], g.Index)
				}
			}
			var got [][]int
			for _, d := range tc.domains {
				// Each domain is named after its lowest-index GPU.
				name := "nvlink-" + inv.GPUs[d[0]].UUID[len("GPU-"):]
				got = append(got, byDomain[name])
			}
			assert.Equal(t, tc.domains, got)
			assert.Len(t, byDomain, len(tc.domains), "no other domains: %v", byDomain)
		})
	}
}

// TestH100PCIeNVLinkMachine: the built-in bridged machine is four H100 PCIe
// cards with MIG off.
func TestH100PCIeNVLinkMachine(t *testing.T) {
	m, err := NewBuiltin("h100-pcie-nvlink", "n")
	require.NoError(t, err)
	inv := inventory(t, m)
	require.Len(t, inv.GPUs, 4)
	for _, g := range inv.GPUs {
		assert.Equal(t, "NVIDIA H100 PCIe", g.ProductName)
		assert.Equal(t, "10de:2331", g.PCI.DeviceID)
		assert.Equal(t, 114, g.Engines.Multiprocessors)
		assert.True(t, g.MIG.Capable)
		assert.False(t, g.MIG.Enabled, "MIG off: MIG instances have no NVLink peer-to-peer")
	}
	assert.Equal(t, inv.GPUs[0].NVLink.Domain, inv.GPUs[1].NVLink.Domain)
	assert.Equal(t, inv.GPUs[2].NVLink.Domain, inv.GPUs[3].NVLink.Domain)
	assert.NotEqual(t, inv.GPUs[0].NVLink.Domain, inv.GPUs[2].NVLink.Domain)

	other, err := NewBuiltin("h100-pcie-nvlink", "n2")
	require.NoError(t, err)
	assert.NotEqual(t, inv.GPUs[0].NVLink.Domain, inventory(t, other).GPUs[0].NVLink.Domain, "NVLink domains are per node")
}

func TestNVLinkTopologyValidation(t *testing.T) {
	tests := []struct {
		name    string
		spec    MachineSpec
		wantErr []string
	}{
		{name: "bridged pairs", spec: MachineSpec{Name: "x", GPUModel: ModelH100PCIe, GPUCount: 2, NVLink: NVLinkBridgedPairs}},
		{name: "odd gpuCount", spec: MachineSpec{Name: "x", GPUModel: ModelH100PCIe, GPUCount: 3, NVLink: NVLinkBridgedPairs},
			wantErr: []string{"nvlink: bridged-pairs needs an even gpuCount, got 3"}},
		{name: "sxm5 has no bridges", spec: MachineSpec{Name: "x", GPUModel: ModelH100SXM5, GPUCount: 2, NVLink: NVLinkBridgedPairs},
			wantErr: []string{"nvlink: model h100-sxm5 has no NVLink bridges"}},
		{name: "default model is sxm5", spec: MachineSpec{Name: "x", GPUCount: 2, NVLink: NVLinkBridgedPairs},
			wantErr: []string{"nvlink: model h100-sxm5 has no NVLink bridges"}},
		{name: "both", spec: MachineSpec{Name: "x", GPUCount: 1, NVLink: NVLinkBridgedPairs},
			wantErr: []string{"nvlink: bridged-pairs needs an even gpuCount, got 1", "nvlink: model h100-sxm5 has no NVLink bridges"}},
		{name: "pcie has no switch links", spec: MachineSpec{Name: "x", GPUModel: ModelH100PCIe, GPUCount: 2, NVLink: NVLinkNVSwitch},
			wantErr: []string{"nvlink: model h100-pcie has no NVLink"}},
		{name: "fabric needs nvswitch", spec: MachineSpec{Name: "x", GPUModel: ModelH100PCIe, GPUCount: 2, NVLink: NVLinkBridgedPairs,
			Fabric: &FabricSpec{ClusterUUID: defaultClusterUUID, CliqueID: 1}},
			wantErr: []string{"fabric: a multi-node NVLink fabric needs nvlink: nvswitch"}},
		{name: "unknown topology", spec: MachineSpec{Name: "x", GPUCount: 2, NVLink: "pairs"},
			wantErr: []string{`nvlink: unknown topology "pairs", want nvswitch, bridged-pairs or none`}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.spec.Validate()
			if len(tc.wantErr) == 0 {
				require.NoError(t, err)
				_, err = New(tc.spec, "n")
				require.NoError(t, err)
				return
			}
			require.Error(t, err)
			for _, w := range tc.wantErr {
				assert.Contains(t, err.Error(), w)
			}
			_, err = New(tc.spec, "n")
			require.Error(t, err, "New validates too")
		})
	}
}
