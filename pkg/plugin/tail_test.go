package plugin

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// stagedCheckpoints are the temporary checkpoint files in the plugin's
// data directory.
func (e *env) stagedCheckpoints() []string {
	e.t.Helper()
	staged, err := filepath.Glob(filepath.Join(e.dir, ".checkpoint.json.tmp-*"))
	require.NoError(e.t, err)
	return staged
}

// A prepare writes and syncs its completed record while it writes the CDI
// spec, and renames the record over the checkpoint after: a kill in
// between leaves the staged file, which the next start removes under the
// node lock, and the claim is not prepared.
func TestKillBetweenStagedRecordAndRenameLeavesNothing(t *testing.T) {
	e := newEnv(t)
	e.crashAt = func(s string) {
		if s == "after-cdi-write" {
			panic(s)
		}
	}
	s := e.start()
	func() {
		defer func() { require.Equal(t, "after-cdi-write", recover()) }()
		_, _ = prep(s, claim("u1", []string{"gpu-2"}))
	}()
	require.Len(t, e.stagedCheckpoints(), 1, "the completed record was staged, not renamed")
	e.crashAt = nil
	restarted := e.start()
	assert.Empty(t, e.stagedCheckpoints(), "the start removes it")
	_, ok := preparedOf(t, restarted, "u1")
	assert.False(t, ok, "the staged record never became the checkpoint")
	assert.Empty(t, e.cdiSpecs())
	_, err := prep(restarted, claim("u1", []string{"gpu-2"}))
	require.NoError(t, err)
	_, ok = preparedOf(t, restarted, "u1")
	assert.True(t, ok)
	assert.Empty(t, e.stagedCheckpoints())
}

// A CDI spec that cannot be written fails the prepare: the record staged
// beside it is removed, not put in place.
func TestFailedCDIWriteDropsTheStagedRecord(t *testing.T) {
	e := newEnv(t)
	s := e.start()
	require.NoError(t, os.RemoveAll(e.cdiDir))
	require.NoError(t, os.WriteFile(e.cdiDir, nil, 0o600)) // no directory to write the spec in
	_, err := prep(s, claim("u1", []string{"gpu-2"}))
	require.Error(t, err)
	assert.Empty(t, e.stagedCheckpoints())
	_, ok := preparedOf(t, s, "u1")
	assert.False(t, ok, "a failed prepare records nothing")

	require.NoError(t, os.Remove(e.cdiDir))
	require.NoError(t, os.MkdirAll(e.cdiDir, 0o755))
	_, err = prep(s, claim("u1", []string{"gpu-2"}))
	require.NoError(t, err, "the kubelet's retry succeeds")
	_, ok = preparedOf(t, s, "u1")
	assert.True(t, ok)
}

// The start builds the device index, so that the first prepare after a
// (re)start does not.
func TestStartBuildsTheDeviceIndex(t *testing.T) {
	e := newEnv(t)
	s := e.start()
	require.NotEmpty(t, s.index)
	assert.Contains(t, s.index, "gpu-2")
	assert.NotEmpty(t, s.indexFingerprint)
}
