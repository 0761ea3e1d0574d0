// Package nvml is gpudra's real GPU backend over go-nvml and go-nvlib. It is
// the only cgo package of the project: without cgo (or off Linux) it builds
// to a stub whose New says so, so every binary still builds with
// CGO_ENABLED=0.
package nvml

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// DefaultDriverRoot is where the driver lives on a host with a plain install.
const DefaultDriverRoot = "/"

// LibraryName is the NVML library every driver install ships.
const LibraryName = "libnvidia-ml.so.1"

// Options configure the backend.
type Options struct {
	// DriverRoot is where the NVIDIA driver is installed: "/" on a plain
	// host, "/run/nvidia/driver" with the GPU operator's driver container.
	DriverRoot string
	// LibraryPath overrides the search for libnvidia-ml.so.1.
	LibraryPath string
	// ProcRoot is the host's /proc, where the backend's Host reads the
	// device majors and the MIG capability minors; empty: "/proc".
	ProcRoot string
	// ComputePolicy is the Host's compute policy: NVML cannot set time
	// slices, so the caller supplies what can (drivertools.NvidiaSMI).
	// Nil: time-sliced claims are refused.
	ComputePolicy nvdevice.ComputePolicy
}

// librarySearchDirs are the places distributions, the .run installer and the
// GPU operator put NVML, relative to the driver root.
var librarySearchDirs = []string{
	"/usr/lib64",
	"/usr/lib/x86_64-linux-gnu",
	"/usr/lib/aarch64-linux-gnu",
	"/lib64",
	"/lib/x86_64-linux-gnu",
	"/lib/aarch64-linux-gnu",
	"/usr/lib/x86_64-linux-gnu/nvidia/current", // Debian's nvidia-driver packages
	"/usr/lib/aarch64-linux-gnu/nvidia/current",
	"/usr/lib",
	"/lib",
}

// maxSymlinkHops bounds symlink resolution inside the driver root.
const maxSymlinkHops = 16

// FindLibrary returns the path of libnvidia-ml.so.1 under the driver root.
// It only looks at files and never loads anything: NVML must not be dlopened
// or called unless the library is known to be there.
//
// Absolute symlinks are resolved inside the driver root (a driver container
// mounted at /run/nvidia/driver links /usr/lib64/libnvidia-ml.so.1 to its
// own /usr/lib64/...), so the returned path can be dlopened from the host.
func FindLibrary(opts Options) (string, error) {
	if opts.LibraryPath != "" {
		p, err := resolveInRoot("/", opts.LibraryPath)
		if err != nil {
			return "", fmt.Errorf("%w: %s: %v", nvdevice.ErrLibraryNotFound, opts.LibraryPath, err)
		}
		return p, nil
	}
	root := opts.DriverRoot
	if root == "" {
		root = DefaultDriverRoot
	}
	looked := make([]string, 0, len(librarySearchDirs))
	for _, dir := range librarySearchDirs {
		looked = append(looked, filepath.Join(root, dir))
		if p, err := resolveInRoot(root, filepath.Join(dir, LibraryName)); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("%w: looked for %s in %s under driver root %q (set --driver-root to where the driver is installed)",
		nvdevice.ErrLibraryNotFound, LibraryName, strings.Join(looked, ", "), root)
}

// resolveInRoot follows symlinks of rel (a path inside root) and returns the
// host path of the regular file it ends at. Absolute link targets are taken
// relative to root.
func resolveInRoot(root, rel string) (string, error) {
	p := filepath.Join(root, rel)
	for range maxSymlinkHops {
		fi, err := os.Lstat(p)
		if err != nil {
			return "", err
		}
		if fi.Mode()&os.ModeSymlink == 0 {
			if !fi.Mode().IsRegular() {
				return "", fmt.Errorf("%s is not a regular file", p)
			}
			return p, nil
		}
		target, err := os.Readlink(p)
		if err != nil {
			return "", err
		}
		if filepath.IsAbs(target) {
			p = filepath.Join(root, target)
		} else {
			p = filepath.Join(filepath.Dir(p), target)
		}
	}
	return "", fmt.Errorf("%s: too many levels of symbolic links", filepath.Join(root, rel))
}
