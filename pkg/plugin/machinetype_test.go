package plugin

import (
	"context"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpudra/gpudra/pkg/machinetype"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// TestMachineTypeSlicesAreWhatAFreshNodePublishes: what machinetype says a
// fresh node of a type publishes (an autoscaler's templates, issue 48) is
// what the real plugin publishes on a fresh simulated node of that type,
// under each MIG policy: with MIG mode off, and on under "all", a profile
// list and "existing" (no MIG device exists yet: nothing published for a
// GPU in MIG mode).
func TestMachineTypeSlicesAreWhatAFreshNodePublishes(t *testing.T) {
	tests := []struct {
		typ     string
		migMode bool
		policy  string
		devices int // published devices, so that the case cannot pass empty by accident
	}{
		{typ: "p5.48xlarge", devices: 8},
		{typ: "p5e.48xlarge", migMode: true, policy: slicebuilder.MigPolicyAll, devices: 8 * 26},    // 25 placements and the whole GPU
		{typ: "a3-ultragpu-8g", migMode: true, policy: "profiles=1g.18gb,7g.141gb", devices: 8 * 9}, // 7 + 1 placements and the whole GPU
		{typ: "a3-highgpu-8g", migMode: true, policy: slicebuilder.MigPolicyExisting, devices: 0},
	}
	for _, tt := range tests {
		t.Run(tt.typ+"/"+tt.policy, func(t *testing.T) {
			ctx := context.Background()
			typ, err := machinetype.Lookup(tt.typ)
			require.NoError(t, err)
			policy, err := slicebuilder.ParseMigPolicy(tt.policy)
			require.NoError(t, err)
			want, err := machinetype.Slices(ctx, typ, tt.migMode, pool, slicebuilder.Options{Mig: policy})
			require.NoError(t, err)

			name, err := typ.Machine(tt.migMode)
			require.NoError(t, err)
			spec, err := sim.LookupSpec(name)
			require.NoError(t, err)
			m, err := sim.New(spec, pool)
			require.NoError(t, err)
			e := &env{t: t, machine: m, dir: t.TempDir()}
			e.cdiDir = filepath.Join(e.dir, "cdi")
			_, client, _ := startPluginWith(t, e, func(cfg *Config) { cfg.MigDevices = policy })

			var got []resourceapi.ResourceSliceSpec
			require.Eventually(t, func() bool {
				list, err := client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
				if err != nil || len(list.Items) != len(want) {
					return false
				}
				got = got[:0]
				for _, s := range list.Items {
					got = append(got, s.Spec)
				}
				return true
			}, 10*time.Second, 50*time.Millisecond, "the plugin publishes %d slices", len(want))
			wantSpecs := make([]resourceapi.ResourceSliceSpec, 0, len(want))
			for _, s := range want {
				wantSpecs = append(wantSpecs, s.Spec)
			}
			assert.Equal(t, normalized(wantSpecs), normalized(got))
			n := 0
			for _, s := range got {
				n += len(s.Devices)
			}
			assert.Equal(t, tt.devices, n, "devices published")
		})
	}
}

// normalized orders slices by their first device or counter set, and
// forgets the pool's generation (republishes count it up).
func normalized(specs []resourceapi.ResourceSliceSpec) []resourceapi.ResourceSliceSpec {
	out := make([]resourceapi.ResourceSliceSpec, 0, len(specs))
	for _, s := range specs {
		s = *s.DeepCopy()
		s.Pool.Generation = 0
		out = append(out, s)
	}
	key := func(s resourceapi.ResourceSliceSpec) string {
		switch {
		case len(s.Devices) > 0:
			return "d" + s.Devices[0].Name
		case len(s.SharedCounters) > 0:
			return "c" + s.SharedCounters[0].Name
		}
		return ""
	}
	slices.SortFunc(out, func(a, b resourceapi.ResourceSliceSpec) int { return strings.Compare(key(a), key(b)) })
	return out
}
