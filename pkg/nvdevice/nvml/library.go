// Package nvml is gpudra's real GPU backend over go-nvml. It is the only cgo
// package of the project: without cgo it builds to a stub whose New says so.
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
}

// librarySearchDirs are the places distributions and the GPU operator put NVML.
var librarySearchDirs = []string{
	"/usr/lib64",
	"/usr/lib/x86_64-linux-gnu",
	"/usr/lib/aarch64-linux-gnu",
	"/lib64",
	"/lib/x86_64-linux-gnu",
	"/lib/aarch64-linux-gnu",
	"/usr/lib",
	"/lib",
}

// FindLibrary returns the path of libnvidia-ml.so.1 under the driver root.
// It only looks at files: NVML must never be called before the library is
// known to load, since a call into a missing symbol kills the process.
func FindLibrary(opts Options) (string, error) {
	if opts.LibraryPath != "" {
		if _, err := os.Stat(opts.LibraryPath); err != nil {
			return "", fmt.Errorf("%w: %s: %v", nvdevice.ErrLibraryNotFound, opts.LibraryPath, err)
		}
		return opts.LibraryPath, nil
	}
	root := opts.DriverRoot
	if root == "" {
		root = DefaultDriverRoot
	}
	var looked []string
	for _, dir := range librarySearchDirs {
		p := filepath.Join(root, dir, LibraryName)
		looked = append(looked, filepath.Join(root, dir))
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("%w: looked for %s in %s (driver root %q; set --driver-root where the driver is installed)",
		nvdevice.ErrLibraryNotFound, LibraryName, strings.Join(looked, ", "), root)
}
