package nvml

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

func TestFindLibrary(t *testing.T) {
	root := t.TempDir()
	_, err := FindLibrary(Options{DriverRoot: root})
	require.ErrorIs(t, err, nvdevice.ErrLibraryNotFound)

	dir := filepath.Join(root, "usr/lib/x86_64-linux-gnu")
	require.NoError(t, os.MkdirAll(dir, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, LibraryName), nil, 0o644))
	got, err := FindLibrary(Options{DriverRoot: root})
	require.NoError(t, err)
	assert.Equal(t, filepath.Join(dir, LibraryName), got)

	_, err = FindLibrary(Options{LibraryPath: filepath.Join(root, "nope.so")})
	require.ErrorIs(t, err, nvdevice.ErrLibraryNotFound)
	assert.Contains(t, err.Error(), "nope.so")
}
