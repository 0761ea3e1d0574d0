package slicebuilder

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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
