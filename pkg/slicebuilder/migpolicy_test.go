package slicebuilder

import (
	"context"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/dynamic-resource-allocation/structured"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

func TestParseMigPolicy(t *testing.T) {
	tests := []struct {
		in      string
		want    MigPolicy
		wantErr string
	}{
		{in: "", want: MigPolicy{}},
		{in: "all", want: MigPolicy{}},
		{in: "existing", want: MigPolicy{Existing: true}},
		{in: "profiles=1g.10gb,3g.40gb", want: MigPolicy{Profiles: []string{"1g.10gb", "3g.40gb"}}},
		{in: "profiles=1g.10gb+me, 1g.10gb+me", want: MigPolicy{Profiles: []string{"1g.10gb+me"}}},
		{in: "profiles=", wantErr: "an empty profile name"},
		{in: "profiles=small", wantErr: `"small" is no MIG profile name`},
		{in: "some", wantErr: "want all, existing or profiles=<profile>,<profile>..."},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := ParseMigPolicy(tt.in)
			if tt.wantErr != "" {
				assert.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
			again, err := ParseMigPolicy(got.String())
			require.NoError(t, err)
			assert.Equal(t, got, again, "String reads back")
		})
	}
}

// TestBuildUnderMigPolicies: what one H100 in MIG mode publishes under each
// policy, and whether it needs its counter set.
func TestBuildUnderMigPolicies(t *testing.T) {
	foreignMe := oneGPUMig + "migDevices:\n- {gpu: 0, profile: 1g.10gb+me, start: 6}\n"
	tests := []struct {
		name, machine string
		policy        MigPolicy
		wantDevices   []string
		wantCounters  bool
	}{
		{"all", oneGPUMig, MigPolicy{}, nil, true},
		{"two profiles and the whole GPU", oneGPUMig, MigPolicy{Profiles: []string{"3g.40gb", "7g.80gb"}},
			[]string{"gpu-0", "gpu-0-mig-3g-40gb-0", "gpu-0-mig-3g-40gb-4", "gpu-0-mig-7g-80gb-0"}, true},
		{"existing, none there: nothing, no counters", oneGPUMig, MigPolicy{Existing: true}, []string{}, false},
		{"existing: the instance as it is, no counters", foreignMe, MigPolicy{Existing: true}, []string{"gpu-0-mig-1g-10gb-me-6"}, false},
		{"profiles beside an existing instance: it is published whatever its profile", foreignMe, MigPolicy{Profiles: []string{"3g.40gb"}},
			[]string{"gpu-0-mig-1g-10gb-me-6", "gpu-0-mig-3g-40gb-0"}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, inv := machine(t, tt.machine, "node-a")
			out := build(t, inv, "node-a", Options{Mig: tt.policy})
			var names []string
			counters := false
			for _, s := range out {
				counters = counters || len(s.Spec.SharedCounters) > 0
				for _, d := range s.Spec.Devices {
					names = append(names, d.Name)
				}
			}
			assert.Equal(t, tt.wantCounters, counters)
			if tt.wantDevices == nil {
				assert.Len(t, names, 26, "the whole GPU and 25 placements")
				return
			}
			slices.Sort(names)
			assert.Equal(t, tt.wantDevices, append([]string{}, names...))
		})
	}
}

// TestAllocatorUnderMigPolicies: the MIG rules the scheduler enforces
// through the counters hold whatever the policy publishes. Each sequence
// runs with only the profiles it asks for published.
func TestAllocatorUnderMigPolicies(t *testing.T) {
	for _, tc := range oneGPUSequences() {
		var profiles []string
		for _, s := range tc.steps {
			if s.ask.profile != "" && !slices.Contains(profiles, s.ask.profile) {
				profiles = append(profiles, s.ask.profile)
			}
		}
		if len(profiles) == 0 {
			continue
		}
		t.Run(tc.name, func(t *testing.T) {
			runSequence(t, newCluster(t, oneGPUMig, Options{Mig: MigPolicy{Profiles: profiles}}), tc.steps)
		})
	}
	// Existing instances: a second +me does not fit (there is one), nor a
	// whole GPU beside it, nor a placement overlapping it.
	t.Run("existing", func(t *testing.T) {
		c := newCluster(t, oneGPUMig+"migDevices:\n- {gpu: 0, profile: 1g.10gb+me, start: 6}\n- {gpu: 0, profile: 3g.40gb, start: 0}\n", Options{Mig: MigPolicy{Existing: true}})
		runSequence(t, c, seq([]step{{migAsk("1g.10gb+me"), true}, {migAsk("1g.10gb+me"), false}, {gpuAsk(), false},
			{migAsk("3g.40gb"), true}, {migAsk("3g.40gb"), false}, {migAsk("1g.10gb"), false}}))
	})
}

// TestPreparedMigDeviceOutlivesNarrowerPolicy (issue 35): a MIG device the
// plugin created for a claim stays published at its placement, as it was
// published when the claim was allocated, under any policy that came in
// since: the claim's allocation names it, and only through its counters
// does the scheduler know the whole GPU and the placements it overlaps are
// taken.
func TestPreparedMigDeviceOutlivesNarrowerPolicy(t *testing.T) {
	m, inv := machine(t, oneGPUMig, "node-a")
	mig, err := m.CreateMigDevice(context.Background(), nvdevice.MigCreateRequest{ParentUUID: inv.GPUs[0].UUID, Profile: "3g.40gb", Start: 4})
	require.NoError(t, err)
	inv, err = m.Inventory(context.Background())
	require.NoError(t, err)
	managed := map[string]bool{mig.UUID: true}
	const prepared = "gpu-0-mig-3g-40gb-4"
	asAllocated := devicesByName(build(t, inv, "node-a", Options{ManagedMigDevices: managed}))[prepared]
	require.NotEmpty(t, asAllocated.ConsumesCounters, "under all the placement consumes its counters")

	t.Run("profiles without its profile", func(t *testing.T) {
		opts := Options{ManagedMigDevices: managed, Mig: MigPolicy{Profiles: []string{"1g.10gb"}}}
		byName := devicesByName(build(t, inv, "node-a", opts))
		if got, ok := byName[prepared]; assert.True(t, ok, "the prepared 3g.40gb is still published at its placement") {
			assert.Equal(t, asAllocated, got, "published as when the claim was allocated: no uuid, the same counters")
		}
		assert.NotContains(t, byName, "gpu-0-mig-3g-40gb-0", "no other 3g.40gb placement")
		assert.Contains(t, byName, "gpu-0", "the whole GPU stays, blocked by the counters")

		// The scheduler, with the prepared claim's device allocated: neither
		// the whole GPU nor a placement overlapping it is handed out.
		c := newCluster(t, oneGPUMig, Options{})
		c.slices = nil
		for _, s := range build(t, inv, "node-a", opts) {
			c.slices = append(c.slices, s.DeepCopy())
		}
		c.allocated.Insert(structured.MakeDeviceID(DriverName, "node-a", prepared))
		runSequence(t, c, seq([]step{{gpuAsk(), false}},
			repeat(4, step{migAsk("1g.10gb"), true}), []step{{migAsk("1g.10gb"), false}}))
	})
	for _, tc := range []struct {
		name string
		opts Options
	}{
		{"existing", Options{ManagedMigDevices: managed, Mig: MigPolicy{Existing: true}}},
		{"DynamicMIG off", Options{ManagedMigDevices: managed, ExistingMigOnly: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := build(t, inv, "node-a", tc.opts)
			for _, s := range out {
				assert.Empty(t, s.Spec.SharedCounters, "no counter set")
			}
			got, ok := devicesByName(out)[prepared]
			require.True(t, ok, "the prepared 3g.40gb is still published at its placement")
			assert.Empty(t, got.ConsumesCounters, "no counters to consume")
			assert.Equal(t, []string{prepared}, deviceNames(allDevices(out)), "nothing else: no whole GPU, no placement to create")
		})
	}
}
