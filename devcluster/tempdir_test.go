package devcluster

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestTempDirHasOneLength: the cluster's directory always has the same
// length, so that the longest unix socket below it either always fits or
// never does: with os.MkdirTemp's names (1 to 10 digits), a test failed
// only when the name came out one digit longer. The longest socket a test
// makes (a device-plugin-mode node's registration socket for its third
// plugin instance) fits under 108 bytes.
func TestTempDirHasOneLength(t *testing.T) {
	var want int
	for i := 0; i < 50; i++ {
		dir, err := tempDir()
		require.NoError(t, err)
		t.Cleanup(func() { _ = os.Remove(dir) })
		assert.True(t, strings.HasPrefix(filepath.Base(dir), "dc"), dir)
		if want == 0 {
			want = len(dir)
		}
		assert.Len(t, dir, want, "every name has one length")
		st, err := os.Stat(dir)
		require.NoError(t, err)
		assert.Equal(t, os.FileMode(0o700), st.Mode().Perm(), "only its owner enters it")
	}
	sock := filepath.Join(strings.Repeat("x", want), "nodes", "dp-h100-switch-0", "plugins_registry", "gpu.gpudra.dev-dp-h100-switch-0-plugin-3-reg.sock")
	assert.Less(t, len(sock), 108, "%s", sock)
}
