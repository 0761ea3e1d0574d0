package slicebuilder

import (
	"fmt"
	"slices"
	"strings"
)

// MigPolicy says which MIG devices a GPU in MIG mode publishes beyond those
// that exist (issue 26). Every placement of every profile (25 per H100,
// each with its shared counters) is what the scheduler must evaluate on
// every node for every pod: at 1,000 nodes that costs it seconds per pod
// once GPUs are held (docs/scale.md). The zero value publishes everything.
// Whatever the policy, a MIG device the driver created for a claim stays
// published at its placement until the claim is released
// (Options.ManagedMigDevices): a policy narrowed meanwhile neither withdraws
// it nor frees what it holds.
type MigPolicy struct {
	// Existing: only MIG devices that exist; none the plugin would create,
	// and no whole GPU (it would be created as the instance spanning it).
	Existing bool
	// Profiles, when not empty, are the only profiles whose placements are
	// published to be created; MIG devices that exist are published
	// whatever their profile, and so is the whole GPU.
	Profiles []string
}

// MIG policy names, as --mig-devices and the chart take them.
const (
	MigPolicyAll      = "all"
	MigPolicyExisting = "existing"
	// migPolicyProfiles prefixes a list: "profiles=1g.10gb,3g.40gb".
	migPolicyProfiles = "profiles="
)

// ParseMigPolicy reads "all", "existing" or "profiles=<profile>,...".
func ParseMigPolicy(s string) (MigPolicy, error) {
	switch {
	case s == "" || s == MigPolicyAll:
		return MigPolicy{}, nil
	case s == MigPolicyExisting:
		return MigPolicy{Existing: true}, nil
	case strings.HasPrefix(s, migPolicyProfiles):
		var p MigPolicy
		for _, name := range strings.Split(strings.TrimPrefix(s, migPolicyProfiles), ",") {
			name = strings.TrimSpace(name)
			if name == "" {
				return MigPolicy{}, fmt.Errorf("MIG device policy %q: an empty profile name", s)
			}
			if !strings.Contains(name, "g.") {
				return MigPolicy{}, fmt.Errorf("MIG device policy %q: %q is no MIG profile name (such as 1g.10gb or 3g.40gb)", s, name)
			}
			if !slices.Contains(p.Profiles, name) {
				p.Profiles = append(p.Profiles, name)
			}
		}
		return p, nil
	}
	return MigPolicy{}, fmt.Errorf("MIG device policy %q: want %s, %s or %s<profile>,<profile>...", s, MigPolicyAll, MigPolicyExisting, migPolicyProfiles)
}

// String is the policy as ParseMigPolicy reads it.
func (p MigPolicy) String() string {
	switch {
	case p.Existing:
		return MigPolicyExisting
	case len(p.Profiles) > 0:
		return migPolicyProfiles + strings.Join(p.Profiles, ",")
	}
	return MigPolicyAll
}

// PublishesAll says whether every placement of every profile is published
// (all, the zero value).
func (p MigPolicy) PublishesAll() bool {
	return !p.Existing && len(p.Profiles) == 0
}

// publishes says whether a placement of the profile that does not exist
// is published to be created.
func (p MigPolicy) publishes(profile string) bool {
	if p.Existing {
		return false
	}
	return len(p.Profiles) == 0 || slices.Contains(p.Profiles, profile)
}
