package deviceplugin

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestPreferredAllocation(t *testing.T) {
	inv := twoDomains(t)
	rs, err := Resources(inv, ResourceOptions{})
	require.NoError(t, err)
	devs := rs[0].Devices
	gpu := func(is ...int) []string {
		var out []string
		for _, i := range is {
			out = append(out, inv.GPUs[i].UUID)
		}
		return out
	}
	domainOf := map[string]string{}
	for _, g := range inv.GPUs {
		domainOf[g.UUID] = g.NVLink.Domain
	}

	tests := []struct {
		name      string
		available []string
		must      []string
		size      int
		want      []string // exact, when set
		sameDom   bool     // all picks in one NVLink domain
		wantIn    []string // the picks are among these
	}{
		{name: "2 of all 8 stay in one domain", available: gpu(0, 1, 2, 3, 4, 5, 6, 7), size: 2, sameDom: true},
		{name: "4 of all 8 take a whole domain", available: gpu(0, 1, 2, 3, 4, 5, 6, 7), size: 4, sameDom: true},
		{name: "pack: the domain with the fewest free that fits", available: gpu(0, 1, 2, 4, 5, 6, 7), size: 2,
			sameDom: true, wantIn: gpu(0, 1, 2)},
		{name: "pack 4: only the full domain fits", available: gpu(0, 1, 2, 4, 5, 6, 7), size: 4, want: gpu(4, 5, 6, 7)},
		{name: "must-include first and its domain", available: gpu(0, 1, 2, 3, 4, 5, 6), must: gpu(5), size: 2,
			sameDom: true, wantIn: gpu(4, 5, 6)},
		{name: "must-include with a 4-GPU request", available: gpu(0, 1, 2, 3, 4, 5, 6, 7), must: gpu(6), size: 4,
			want: gpu(6, 4, 5, 7)},
		{name: "must-include whose domain is too small: the rest still packs", available: gpu(0, 1, 2, 3, 4), must: gpu(4), size: 3,
			sameDom: false, wantIn: gpu(0, 1, 2, 3, 4)},
		{name: "no domain fits: as few domains as possible", available: gpu(0, 1, 2, 3, 5, 6), size: 5,
			wantIn: gpu(0, 1, 2, 3, 5, 6)},
		{name: "unknown IDs are never picked", available: append([]string{"GPU-nope"}, gpu(0)...), size: 2, want: gpu(0)},
		{name: "must-include fills the request", available: gpu(0, 1, 2), must: gpu(2, 1), size: 2, want: gpu(2, 1)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := PreferredAllocation(devs, tc.available, tc.must, tc.size)
			if tc.want != nil {
				assert.Equal(t, tc.want, got)
				return
			}
			require.Len(t, got, tc.size)
			if len(tc.must) > 0 {
				assert.Equal(t, tc.must, got[:len(tc.must)], "must-include devices come first")
			}
			seen := map[string]bool{}
			for _, id := range got {
				assert.False(t, seen[id], "%s twice", id)
				seen[id] = true
				assert.Contains(t, tc.available, id)
				if tc.wantIn != nil {
					assert.Contains(t, tc.wantIn, id)
				}
			}
			if tc.sameDom {
				for _, id := range got {
					assert.Equal(t, domainOf[got[0]], domainOf[id], "%v spans NVLink domains", got)
				}
			}
		})
	}

	t.Run("three of domain A after must-include outside it", func(t *testing.T) {
		got := PreferredAllocation(devs, gpu(0, 1, 2, 3, 4), gpu(4), 3)
		require.Len(t, got, 3)
		assert.Equal(t, domainOf[got[1]], domainOf[got[2]], "the rest stays in one domain")
	})
	t.Run("5 over two domains takes the whole larger one", func(t *testing.T) {
		got := PreferredAllocation(devs, gpu(0, 1, 2, 3, 5, 6), nil, 5)
		assert.Subset(t, got, gpu(0, 1, 2, 3))
	})
}

func TestPreferredAllocationReplicasSpread(t *testing.T) {
	_, inv := builtin(t, "dgx-h100-nomig")
	rs, err := Resources(inv, ResourceOptions{Config: mustConfig(t, "version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: gpu, replicas: 4}]\n")})
	require.NoError(t, err)
	devs := rs[0].Devices
	// GPU 0 has 4 free replicas, GPU 1 two, GPU 2 one.
	available := []string{}
	for _, d := range devs {
		if d.GPUIndex == 0 || (d.GPUIndex == 1 && d.Replica < 2) || (d.GPUIndex == 2 && d.Replica == 0) {
			available = append(available, d.ID)
		}
	}
	got := PreferredAllocation(devs, available, nil, 2)
	require.Len(t, got, 2)
	u0, u1 := inv.GPUs[0].UUID, inv.GPUs[1].UUID
	assert.Equal(t, []string{u0 + "::0", u1 + "::0"}, got, "replicas spread over distinct GPUs, least loaded first")
}

func TestPreferredAllocationMigPacksParent(t *testing.T) {
	_, inv := migMachine(t)
	rs, err := Resources(inv, ResourceOptions{Config: mustConfig(t, "version: v1\nflags: {migStrategy: mixed}\n")})
	require.NoError(t, err)
	r := resourceNamed(t, rs, "nvidia.com/mig-1g.10gb")
	got := PreferredAllocation(r.Devices, ids(r.Devices), nil, 1)
	assert.Equal(t, []string{r.Devices[0].ID}, got)
}
