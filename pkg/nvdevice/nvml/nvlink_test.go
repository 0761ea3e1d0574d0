//go:build cgo && linux

package nvml

import (
	"context"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// The four NVSwitches of an HGX H100 board, as NVML writes their bus ids.
var hgxSwitches = []string{"00000000:05:00.0", "00000000:06:00.0", "00000000:07:00.0", "00000000:08:00.0"}

func TestNVLinkDomains(t *testing.T) {
	for _, tc := range []struct {
		name        string
		gpus        func() []*fakeGPU
		wantDomains []string
		wantLinks   []int // active links per GPU
	}{
		{
			name:        "HGX H100: every GPU on the same NVSwitches",
			gpus:        func() []*fakeGPU { return board(8, nvml.DEVICE_MIG_DISABLE, hgxSwitches...) },
			wantDomains: []string{"nvlink-0", "nvlink-0", "nvlink-0", "nvlink-0", "nvlink-0", "nvlink-0", "nvlink-0", "nvlink-0"},
			wantLinks:   []int{18, 18, 18, 18, 18, 18, 18, 18},
		},
		{
			name: "two boards' worth of switches: two domains",
			gpus: func() []*fakeGPU {
				g := board(4, nvml.DEVICE_MIG_DISABLE, hgxSwitches[:2]...)
				for _, i := range []int{2, 3} {
					other := []string{"00000000:95:00.0", "00000000:96:00.0"}
					g[i].GetNvLinkRemotePciInfoFunc = func(l int) (nvml.PciInfo, nvml.Return) {
						return nvml.PciInfo{BusId: cString(other[l%2])}, nvml.SUCCESS
					}
				}
				return g
			},
			wantDomains: []string{"nvlink-0", "nvlink-0", "nvlink-2", "nvlink-2"},
			wantLinks:   []int{18, 18, 18, 18},
		},
		{
			name: "NVLink bridge pairs (PCIe cards): links reach the peer GPU",
			gpus: func() []*fakeGPU {
				g := board(4, nvml.DEVICE_MIG_DISABLE, "x") // placeholder, replaced below
				peer := map[int]int{0: 1, 1: 0, 2: 3, 3: 2}
				for i := range g {
					bus, _ := g[peer[i]].GetPciInfo()
					g[i].GetNvLinkRemotePciInfoFunc = func(int) (nvml.PciInfo, nvml.Return) { return bus, nvml.SUCCESS }
					g[i].GetNvLinkRemoteDeviceTypeFunc = func(int) (nvml.IntNvLinkDeviceType, nvml.Return) {
						return nvml.NVLINK_DEVICE_TYPE_GPU, nvml.SUCCESS
					}
					g[i].GetNvLinkStateFunc = func(l int) (nvml.EnableState, nvml.Return) {
						if l >= 12 {
							return 0, nvml.ERROR_INVALID_ARGUMENT
						}
						if l >= 4 {
							return nvml.FEATURE_DISABLED, nvml.SUCCESS
						}
						return nvml.FEATURE_ENABLED, nvml.SUCCESS
					}
				}
				return g
			},
			wantDomains: []string{"nvlink-0", "nvlink-0", "nvlink-2", "nvlink-2"},
			wantLinks:   []int{4, 4, 4, 4},
		},
		{
			name:        "no NVLink",
			gpus:        func() []*fakeGPU { return board(2, nvml.DEVICE_MIG_DISABLE) },
			wantDomains: []string{"", ""},
			wantLinks:   []int{0, 0},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			inv, err := testBackend(t, fakeLib(tc.gpus())).Inventory(context.Background())
			require.NoError(t, err)
			var domains []string
			var links []int
			for _, g := range inv.GPUs {
				domains = append(domains, g.NVLink.Domain)
				links = append(links, g.NVLink.ActiveLinks())
				assert.Empty(t, g.NVLink.FabricClique)
			}
			assert.Equal(t, tc.wantDomains, domains)
			assert.Equal(t, tc.wantLinks, links)
		})
	}
}

func TestNVLinkLinks(t *testing.T) {
	gpus := board(1, nvml.DEVICE_MIG_DISABLE, hgxSwitches...)
	gpus[0].GetNvLinkStateFunc = func(l int) (nvml.EnableState, nvml.Return) {
		switch {
		case l >= 18:
			return 0, nvml.ERROR_INVALID_ARGUMENT
		case l == 17:
			return nvml.FEATURE_DISABLED, nvml.SUCCESS
		}
		return nvml.FEATURE_ENABLED, nvml.SUCCESS
	}
	inv, err := testBackend(t, fakeLib(gpus)).Inventory(context.Background())
	require.NoError(t, err)
	links := inv.GPUs[0].NVLink.Links
	require.Len(t, links, 18)
	assert.Equal(t, nvdevice.NVLinkLink{Index: 0, Active: true, RemoteBusID: "0000:05:00.0", RemoteKind: nvdevice.RemoteNVSwitch}, links[0])
	assert.Equal(t, nvdevice.NVLinkLink{Index: 5, Active: true, RemoteBusID: "0000:06:00.0", RemoteKind: nvdevice.RemoteNVSwitch}, links[5])
	assert.Equal(t, nvdevice.NVLinkLink{Index: 17}, links[17], "an inactive link has no far end")

	// A driver without nvmlDeviceGetNvLinkRemoteDeviceType is not asked.
	gpus = board(1, nvml.DEVICE_MIG_DISABLE, hgxSwitches...)
	inv, err = testBackend(t, fakeLib(gpus, "nvmlDeviceGetNvLinkRemoteDeviceType")).Inventory(context.Background())
	require.NoError(t, err)
	assert.Equal(t, nvdevice.RemoteUnknown, inv.GPUs[0].NVLink.Links[0].RemoteKind)
	assert.Empty(t, gpus[0].GetNvLinkRemoteDeviceTypeCalls())
	assert.Equal(t, "nvlink-0", inv.GPUs[0].NVLink.Domain)
}

func TestFabricClique(t *testing.T) {
	cluster := [16]uint8{0x4d, 0x1c, 0x2b, 0x3a, 0x9e, 0x8f, 0x4a, 0x7b, 0x8c, 0x6d, 0x5e, 0x4f, 0x3a, 0x2b, 0x1c, 0x0d}
	done := func(uuid [16]uint8, clique uint32) *nvml.GpuFabricInfo {
		return &nvml.GpuFabricInfo{ClusterUuid: uuid, CliqueId: clique, State: nvml.GPU_FABRIC_STATE_COMPLETED, Status: uint32(nvml.SUCCESS)}
	}
	for _, tc := range []struct {
		name       string
		fabric     *nvml.GpuFabricInfo
		missing    []string
		wantClique string
		wantDomain string
	}{
		{name: "multi-node NVLink", fabric: done(cluster, 7),
			wantClique: "4d1c2b3a-9e8f-4a7b-8c6d-5e4f3a2b1c0d.7", wantDomain: "4d1c2b3a-9e8f-4a7b-8c6d-5e4f3a2b1c0d.7"},
		{name: "HGX H100: zero cluster UUID", fabric: done([16]uint8{}, 0), wantDomain: "nvlink-0"},
		{name: "no fabric support", wantDomain: "nvlink-0"},
		{name: "registration in progress", fabric: &nvml.GpuFabricInfo{ClusterUuid: cluster, CliqueId: 7, State: nvml.GPU_FABRIC_STATE_IN_PROGRESS},
			wantDomain: "nvlink-0"},
		{name: "registration failed", fabric: &nvml.GpuFabricInfo{ClusterUuid: cluster, CliqueId: 7, State: nvml.GPU_FABRIC_STATE_COMPLETED, Status: uint32(nvml.ERROR_UNKNOWN)},
			wantDomain: "nvlink-0"},
		{name: "driver older than the call", fabric: done(cluster, 7), missing: []string{"nvmlDeviceGetGpuFabricInfo"}, wantDomain: "nvlink-0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gpus := []*fakeGPU{newFakeGPU(gpuSpec{uuid: "GPU-0", bus: "00000000:18:00.0", switches: hgxSwitches[:1], fabric: tc.fabric})}
			inv, err := testBackend(t, fakeLib(gpus, tc.missing...)).Inventory(context.Background())
			require.NoError(t, err)
			assert.Equal(t, tc.wantClique, inv.GPUs[0].NVLink.FabricClique)
			assert.Equal(t, tc.wantDomain, inv.GPUs[0].NVLink.Domain)
			if len(tc.missing) > 0 {
				assert.Empty(t, gpus[0].GetGpuFabricInfoCalls(), "a missing symbol is never called")
			}
		})
	}
}
