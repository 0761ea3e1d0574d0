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

func TestXIDPolicyCritical(t *testing.T) {
	xid := func(x uint64) HealthEvent { return HealthEvent{Kind: HealthXID, XID: x} }
	for _, tc := range []struct {
		name   string
		policy XIDPolicy
		ev     HealthEvent
		want   bool
	}{
		{"default: application XID 13", DefaultXIDPolicy, xid(13), false},
		{"default: application XID 31", DefaultXIDPolicy, xid(31), false},
		{"default: application XID 43", DefaultXIDPolicy, xid(43), false},
		{"default: application XID 45", DefaultXIDPolicy, xid(45), false},
		{"default: application XID 68", DefaultXIDPolicy, xid(68), false},
		{"default: application XID 109", DefaultXIDPolicy, xid(109), false},
		{"default: double-bit ECC XID 48", DefaultXIDPolicy, xid(48), true},
		{"default: fallen off the bus XID 79", DefaultXIDPolicy, xid(79), true},
		{"default: lost GPU", DefaultXIDPolicy, HealthEvent{Kind: HealthGPULost}, true},
		{"default: recovery", DefaultXIDPolicy, HealthEvent{Kind: HealthRecovered}, false},
		{"nil list is the default", NewXIDPolicy(nil), xid(13), false},
		{"nil list is the default: 48", NewXIDPolicy(nil), xid(48), true},
		{"an ignored XID", NewXIDPolicy([]uint64{13, 94}), xid(94), false},
		{"a configured list replaces the default", NewXIDPolicy([]uint64{94}), xid(13), true},
		{"an empty list ignores none", NewXIDPolicy([]uint64{}), xid(13), true},
		{"a lost GPU cannot be ignored", NewXIDPolicy([]uint64{79}), HealthEvent{Kind: HealthGPULost}, true},
		{"a recovery is never critical", NewXIDPolicy([]uint64{}), HealthEvent{Kind: HealthRecovered}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, tc.policy.Critical(tc.ev), "%+v", tc.ev)
		})
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
