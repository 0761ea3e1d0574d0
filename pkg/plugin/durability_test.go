package plugin

import (
	"context"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	resourceapi "k8s.io/api/resource/v1"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/plugin/checkpoint"
	"github.com/gpudra/gpudra/pkg/prepared"
)

// recordStaging makes the test see, for each store of a claim's record,
// whether it was fsynced.
func recordStaging(t *testing.T) *[]string {
	var seen []string
	orig := stagingFor
	stagingFor = func(c *prepared.Claim) stageFunc {
		f := orig(c)
		kind := "fsynced"
		if reflect.ValueOf(f).Pointer() == reflect.ValueOf(checkpoint.StageUnsynced).Pointer() {
			kind = "unsynced"
		}
		seen = append(seen, c.UID+" "+kind)
		return f
	}
	t.Cleanup(func() { stagingFor = orig })
	return &seen
}

// A whole GPU's prepare and unprepare store the checkpoint without an
// fsync: its only side effect is its CDI spec, and no power loss needs to
// find its record (a power loss is a reboot, and the next start discards
// the checkpoint of this boot). A claim whose record names a MIG device
// the driver made, or an MPS daemon, is fsynced as before.
func TestOnlyClaimsWithSideEffectsAreFsynced(t *testing.T) {
	seen := recordStaging(t)
	e := newEnv(t)
	s := e.start()
	for _, c := range []*resourceapi.ResourceClaim{
		claim("whole", []string{"gpu-2"}),
		claim("mig", []string{"gpu-0"}), // MIG mode: the 7g instance is made
		claim("mps", []string{"gpu-3"}, mpsConfig),
	} {
		_, err := prep(s, c)
		require.NoError(t, err, c.Name)
		_, err = s.Unprepare(context.Background(), string(c.UID))
		require.NoError(t, err, c.Name)
	}
	assert.Equal(t, []string{
		"whole unsynced", "whole unsynced",
		"mig fsynced", "mig fsynced",
		"mps fsynced", "mps fsynced",
	}, *seen, "prepare's completed record, then unprepare's removal")
}

// What a power loss after a whole GPU's unsynced prepare leaves, and how the
// next boot's start reconciles it. The rename may have reached the disk
// without the data (a filesystem that does not flush a file renamed over
// another: an empty checkpoint), or not at all (the checkpoint before the
// prepare), or whole; the CDI spec may be there (a CDI directory on disk)
// or not (/var/run/cdi, tmpfs). In every case the new boot's start leaves
// no record of the earlier boot's claims and no spec nobody knows, and the
// kubelet's prepare of the claim again (it prepares every claim of its pods
// after a reboot) gives the claim its GPU.
func TestPowerLossAfterAnUnsyncedPrepare(t *testing.T) {
	for _, tc := range []struct {
		name      string
		onDisk    func(before, after []byte) []byte
		specsKept bool
	}{
		{"the checkpoint before the prepare, specs in tmpfs", func(before, _ []byte) []byte { return before }, false},
		{"the checkpoint before the prepare, specs on disk", func(before, _ []byte) []byte { return before }, true},
		{"an empty checkpoint, specs on disk", func(_, _ []byte) []byte { return []byte{} }, true},
		{"an empty checkpoint, specs in tmpfs", func(_, _ []byte) []byte { return []byte{} }, false},
		{"the new checkpoint whole", func(_, after []byte) []byte { return after }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			c := claim("u1", []string{"gpu-2"})
			e.claims = func(context.Context) ([]*resourceapi.ResourceClaim, error) {
				return []*resourceapi.ResourceClaim{c}, nil
			}
			s := e.start()
			path := filepath.Join(e.dir, "checkpoint.json")
			before, err := os.ReadFile(path)
			require.NoError(t, err)
			_, err = prep(s, c)
			require.NoError(t, err)
			after, err := os.ReadFile(path)
			require.NoError(t, err)
			require.NoError(t, s.Close())

			// The power loss, then the reboot.
			require.NoError(t, os.WriteFile(path, tc.onDisk(before, after), 0o600))
			if !tc.specsKept {
				require.NoError(t, os.RemoveAll(e.cdiDir))
			}
			e.bootID = "boot-2"
			restarted := e.start()
			t.Cleanup(func() { _ = restarted.Close() })

			for _, spec := range e.cdiSpecs() {
				_, ok := preparedOf(t, restarted, "u1")
				assert.True(t, ok, "a spec left (%s) belongs to a claim the state knows", spec)
			}
			devs, err := prep(restarted, c)
			require.NoError(t, err, "the kubelet prepares the claim again")
			require.Len(t, devs, 1)
			assert.Equal(t, "gpu-2", devs[0].Device)
			_, err = prep(restarted, claim("u2", []string{"gpu-2"}))
			require.Error(t, err, "the GPU is the claim's again: another claim is refused")
			_, err = restarted.Unprepare(context.Background(), "u1")
			require.NoError(t, err)
			assert.Empty(t, e.cdiSpecs())
			_, err = prep(restarted, claim("u2", []string{"gpu-2"}))
			require.NoError(t, err, "and free after its unprepare")
		})
	}
}
