package nvdevice

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func gpu(index int, uuid, bus string, remotes ...string) GPU {
	g := GPU{Index: index, UUID: uuid, PCI: PCI{BusID: bus}}
	for i, r := range remotes {
		g.NVLink.Links = append(g.NVLink.Links, NVLinkLink{Index: i, Active: r != "", RemoteBusID: r})
	}
	return g
}

func TestAssignNVLinkDomains(t *testing.T) {
	cluster := [16]byte{0xab, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 0xff}
	tests := []struct {
		name   string
		gpus   []GPU
		fabric map[string]FabricInfo
		want   []string // domain per GPU
		clique []string
	}{
		{
			name: "all through shared NVSwitches",
			gpus: []GPU{gpu(0, "A", "0000:18:00.0", "0000:05:00.0", "0000:06:00.0"), gpu(1, "B", "0000:2a:00.0", "0000:06:00.0", "0000:05:00.0")},
			want: []string{"nvlink-A", "nvlink-A"},
		},
		{
			name: "two islands of bridged pairs, named after their lowest GPU",
			gpus: []GPU{
				gpu(0, "A", "0000:01:00.0", "0000:02:00.0"), gpu(1, "B", "0000:02:00.0", "0000:01:00.0"),
				gpu(2, "C", "0000:03:00.0", "0000:04:00.0"), gpu(3, "D", "0000:04:00.0", "0000:03:00.0"),
			},
			want: []string{"nvlink-A", "nvlink-A", "nvlink-C", "nvlink-C"},
		},
		{
			name: "inactive links give no domain",
			gpus: []GPU{gpu(0, "A", "0000:01:00.0", ""), gpu(1, "B", "0000:02:00.0")},
			want: []string{"", ""},
		},
		{
			name:   "a non-zero fabric cluster wins",
			gpus:   []GPU{gpu(0, "A", "0000:18:00.0", "0000:05:00.0"), gpu(1, "B", "0000:2a:00.0", "0000:05:00.0")},
			fabric: map[string]FabricInfo{"A": {ClusterUUID: cluster, CliqueID: 3}, "B": {ClusterUUID: cluster, CliqueID: 3}},
			want:   []string{"ab010203-0405-0607-0809-0a0b0c0d0eff.3", "ab010203-0405-0607-0809-0a0b0c0d0eff.3"},
			clique: []string{"ab010203-0405-0607-0809-0a0b0c0d0eff.3", "ab010203-0405-0607-0809-0a0b0c0d0eff.3"},
		},
		{
			name:   "a zero cluster UUID is no fabric",
			gpus:   []GPU{gpu(0, "A", "0000:18:00.0", "0000:05:00.0")},
			fabric: map[string]FabricInfo{"A": {CliqueID: 3}},
			want:   []string{"nvlink-A"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			AssignNVLinkDomains(tc.gpus, tc.fabric)
			for i, g := range tc.gpus {
				assert.Equal(t, tc.want[i], g.NVLink.Domain, "GPU %d", i)
				wantClique := ""
				if tc.clique != nil {
					wantClique = tc.clique[i]
				}
				assert.Equal(t, wantClique, g.NVLink.FabricClique, "GPU %d", i)
			}
		})
	}
}

func TestHealthEventCritical(t *testing.T) {
	for _, tc := range []struct {
		ev   HealthEvent
		want bool
	}{
		{HealthEvent{Kind: HealthXID, XID: 13}, false},
		{HealthEvent{Kind: HealthXID, XID: 31}, false},
		{HealthEvent{Kind: HealthXID, XID: 43}, false},
		{HealthEvent{Kind: HealthXID, XID: 45}, false},
		{HealthEvent{Kind: HealthXID, XID: 68}, false},
		{HealthEvent{Kind: HealthXID, XID: 109}, false},
		{HealthEvent{Kind: HealthXID, XID: 48}, true},
		{HealthEvent{Kind: HealthXID, XID: 79}, true},
		{HealthEvent{Kind: HealthGPULost}, true},
		{HealthEvent{Kind: HealthRecovered}, false},
	} {
		assert.Equal(t, tc.want, tc.ev.Critical(), "%+v", tc.ev)
	}
}

func TestPlacementOverlaps(t *testing.T) {
	p := func(s, n int) Placement { return Placement{Start: s, Size: n} }
	assert.True(t, p(0, 4).Overlaps(p(3, 1)))
	assert.True(t, p(0, 8).Overlaps(p(6, 2)))
	assert.False(t, p(0, 4).Overlaps(p(4, 4)))
	assert.False(t, p(6, 1).Overlaps(p(0, 6)))
	assert.Equal(t, []int{4, 5, 6, 7}, p(4, 4).Slices())
}
