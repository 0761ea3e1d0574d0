package cdi

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
	"tags.cncf.io/container-device-interface/pkg/parser"
	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// The driver's user-space files are in one spec per node, kind
// "gpu.gpudra.dev/driver", with one device, "common", that every prepared
// device's CDI ids include: the runtime injects it once per container
// however many claims name it.
const (
	DriverClass  = "driver"
	DriverDevice = "common"
)

// DriverDeviceID is the CDI id of the common device.
var DriverDeviceID = parser.QualifiedName(Vendor, DriverClass, DriverDevice)

// DriverSpecName is the common spec's file name (without extension); it
// never matches a claim's transient spec name.
const DriverSpecName = Vendor + "-" + DriverClass

// DriverOptions say how the discovered files are seen by the container
// runtime on the host.
type DriverOptions struct {
	// HostRoot is the driver root on the host, where the runtime finds the
	// files: it replaces DriverFiles.Root in every host path. Empty: the
	// files are where they were discovered.
	HostRoot string
	// HookPath is the toolkit's nvidia-cdi-hook on the host. Empty: no
	// hooks (the runtime would fail every container whose hook binary is
	// missing); containers then find the libraries through their soname
	// mounts in the standard library directory.
	HookPath string
}

// BuildDriverSpec is the pure step: the common spec for a driver's files.
// Every file is mounted read-only. With a hook path the toolkit's hooks
// (update-ldcache, create-symlinks) let the container find the libraries;
// without, every soname symlink next to a library (libcuda.so.1 ->
// libcuda.so.570.172.08) is mounted too, from the file it names, so that a
// container finds the libraries by soname in the standard directory.
func BuildDriverSpec(f nvdevice.DriverFiles, o DriverOptions) (*cdispec.Spec, error) {
	if f.Version == "" {
		return nil, fmt.Errorf("driver files under %s: no driver version", f.Root)
	}
	if len(f.Mounts) == 0 {
		return nil, fmt.Errorf("driver %s under %s: no files found", f.Version, f.Root)
	}
	edits := cdispec.ContainerEdits{}
	seen := map[string]bool{}
	mount := func(host, ctr string, opts []string) {
		if seen[ctr] {
			return
		}
		seen[ctr] = true
		edits.Mounts = append(edits.Mounts, &cdispec.Mount{HostPath: hostPath(f.Root, o.HostRoot, host),
			ContainerPath: ctr, Options: readOnly(opts)})
	}
	for _, m := range f.Mounts {
		mount(m.HostPath, m.ContainerPath, m.Options)
	}
	if o.HookPath == "" {
		// Without the hooks (whose ldconfig and create-symlinks make these
		// links in the container) the sonames are mounted as files.
		for _, m := range f.Mounts {
			for _, link := range sonameLinks(m.HostPath) {
				mount(m.HostPath, filepath.Join(filepath.Dir(m.ContainerPath), link), m.Options)
			}
		}
	} else {
		for _, h := range f.Hooks {
			edits.Hooks = append(edits.Hooks, &cdispec.Hook{HookName: h.HookName, Path: o.HookPath,
				Args: slices.Clone(h.Args), Env: slices.Clone(h.Env)})
		}
		edits.Env = slices.Clone(f.Env)
	}
	spec := &cdispec.Spec{Kind: Vendor + "/" + DriverClass, Devices: []cdispec.Device{{Name: DriverDevice, ContainerEdits: edits}},
		Annotations: map[string]string{Vendor + "/driver-version": f.Version}}
	version, err := cdiapi.MinimumRequiredVersion(spec)
	if err != nil {
		return nil, fmt.Errorf("driver spec: CDI version: %w", err)
	}
	spec.Version = version
	return spec, nil
}

// hostPath moves a path discovered under root to the host's driver root.
func hostPath(root, hostRoot, p string) string {
	if hostRoot == "" || root == "" {
		return p
	}
	rel, err := filepath.Rel(root, p)
	if err != nil || strings.HasPrefix(rel, "..") {
		return p
	}
	return filepath.Join(hostRoot, rel)
}

// readOnly makes the mount options read-only: "rw" becomes "ro", and "ro"
// is added if missing. A unix socket stays usable on a read-only mount
// (connect needs no write access to the file system).
func readOnly(opts []string) []string {
	out := []string{"ro"}
	for _, o := range opts {
		if o != "ro" && o != "rw" {
			out = append(out, o)
		}
	}
	return out
}

// sonameLinks are the names of the symlinks in the library's directory
// that point at it (directly), the sonames a loader looks for.
func sonameLinks(lib string) []string {
	if !strings.Contains(filepath.Base(lib), ".so.") {
		return nil
	}
	entries, err := os.ReadDir(filepath.Dir(lib))
	if err != nil {
		return nil
	}
	var out []string
	for _, e := range entries {
		if e.Type()&os.ModeSymlink == 0 {
			continue
		}
		target, err := os.Readlink(filepath.Join(filepath.Dir(lib), e.Name()))
		if err != nil {
			continue
		}
		if target == filepath.Base(lib) || target == lib {
			out = append(out, e.Name())
		}
	}
	return out
}

// WriteDriver stores the common spec atomically, replacing an earlier one
// (a driver upgrade).
func (w *Writer) WriteDriver(spec *cdispec.Spec) error {
	if err := w.cache.WriteSpec(spec, DriverSpecName); err != nil {
		return fmt.Errorf("write the driver's CDI spec: %w", err)
	}
	return nil
}
