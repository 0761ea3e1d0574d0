package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestDriverToolEnv(t *testing.T) {
	root := t.TempDir()
	lib := filepath.Join(root, "usr", "lib64")
	require.NoError(t, os.MkdirAll(lib, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(lib, "libnvidia-ml.so.1"), nil, 0o644))

	assert.Equal(t, []string{"LD_LIBRARY_PATH=" + lib}, driverToolEnv(root), "tools under a driver root find its libraries")
	assert.Nil(t, driverToolEnv("/"), "a host install needs nothing")
	assert.Nil(t, driverToolEnv(t.TempDir()), "no driver there: nothing to add")
}
