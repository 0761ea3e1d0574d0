package nvml

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// TestNewWithoutDriver runs with and without cgo: on a machine with no
// NVIDIA driver New says so in one line, and loads nothing.
func TestNewWithoutDriver(t *testing.T) {
	root := t.TempDir()
	_, err := New(context.Background(), Options{DriverRoot: root})
	require.ErrorIs(t, err, nvdevice.ErrLibraryNotFound)
	msg := err.Error()
	assert.True(t, strings.HasPrefix(msg, "NVIDIA driver library not found: looked for libnvidia-ml.so.1 in "+root+"/usr/lib64, "+root+"/usr/lib/x86_64-linux-gnu, "), msg)
	for _, dir := range librarySearchDirs {
		assert.Contains(t, msg, root+dir, "the message lists every place it looked")
	}
	assert.Contains(t, msg, `under driver root "`+root+`"`)
	assert.NotContains(t, msg, "\n", "one line")
}

func TestFindLibrary(t *testing.T) {
	const version = "libnvidia-ml.so.570.172.08"
	for _, tc := range []struct {
		name string
		// setup lays out the driver root and returns the options and the
		// path FindLibrary should answer ("" for not found).
		setup func(t *testing.T, root string) (Options, string)
	}{
		{"empty driver root", func(t *testing.T, root string) (Options, string) {
			return Options{DriverRoot: root}, ""
		}},
		{"plain file in a Debian directory", func(t *testing.T, root string) (Options, string) {
			p := write(t, root, "usr/lib/x86_64-linux-gnu/"+LibraryName)
			return Options{DriverRoot: root}, p
		}},
		{"first directory wins", func(t *testing.T, root string) (Options, string) {
			p := write(t, root, "usr/lib64/"+LibraryName)
			write(t, root, "usr/lib/"+LibraryName)
			return Options{DriverRoot: root}, p
		}},
		{"relative symlink as ldconfig makes", func(t *testing.T, root string) (Options, string) {
			p := write(t, root, "usr/lib64/"+version)
			link(t, version, filepath.Join(root, "usr/lib64", LibraryName))
			return Options{DriverRoot: root}, p
		}},
		{"absolute symlink is resolved inside the driver root", func(t *testing.T, root string) (Options, string) {
			p := write(t, root, "usr/lib64/"+version)
			link(t, "/usr/lib64/"+version, filepath.Join(root, "usr/lib64", LibraryName))
			return Options{DriverRoot: root}, p
		}},
		{"dangling symlink", func(t *testing.T, root string) (Options, string) {
			link(t, version, filepath.Join(root, "usr/lib64", LibraryName))
			return Options{DriverRoot: root}, ""
		}},
		{"symlink loop", func(t *testing.T, root string) (Options, string) {
			link(t, "b", filepath.Join(root, "usr/lib64", LibraryName))
			link(t, LibraryName, filepath.Join(root, "usr/lib64", "b"))
			return Options{DriverRoot: root}, ""
		}},
		{"a directory is not the library", func(t *testing.T, root string) (Options, string) {
			require.NoError(t, os.MkdirAll(filepath.Join(root, "usr/lib64", LibraryName), 0o755))
			return Options{DriverRoot: root}, ""
		}},
		{"library path override", func(t *testing.T, root string) (Options, string) {
			p := write(t, root, "opt/nvidia/"+LibraryName)
			write(t, root, "usr/lib64/"+LibraryName)
			return Options{DriverRoot: root, LibraryPath: p}, p
		}},
		{"missing library path override", func(t *testing.T, root string) (Options, string) {
			write(t, root, "usr/lib64/"+LibraryName)
			return Options{DriverRoot: root, LibraryPath: filepath.Join(root, "nope.so")}, ""
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts, want := tc.setup(t, t.TempDir())
			got, err := FindLibrary(opts)
			if want == "" {
				require.ErrorIs(t, err, nvdevice.ErrLibraryNotFound)
				if opts.LibraryPath != "" {
					assert.Contains(t, err.Error(), opts.LibraryPath)
				}
				return
			}
			require.NoError(t, err)
			assert.Equal(t, want, got)
		})
	}
}

func write(t *testing.T, root, rel string) string {
	t.Helper()
	p := filepath.Join(root, rel)
	require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
	require.NoError(t, os.WriteFile(p, []byte("ELF"), 0o644))
	return p
}

func link(t *testing.T, target, at string) {
	t.Helper()
	require.NoError(t, os.MkdirAll(filepath.Dir(at), 0o755))
	require.NoError(t, os.Symlink(target, at))
}
