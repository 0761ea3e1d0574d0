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
