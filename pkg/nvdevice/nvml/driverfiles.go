//go:build cgo && linux

package nvml

import (
	"context"
	"fmt"
	"path/filepath"

	"github.com/NVIDIA/nvidia-container-toolkit/pkg/nvcdi"
	"github.com/go-logr/logr"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// DriverFiles discovers the driver's user-space files under the driver root
// with the NVIDIA container toolkit's nvcdi, in its "management" mode: it
// finds the driver version from libcuda.so.<version> under the root (not
// through NVML), then the libraries of that version, the GSP firmware, the
// binaries, the IPC sockets and the hooks (update-ldcache, create-symlinks,
// enable-cuda-compat). It does not call NVML.
func (b *Backend) DriverFiles(ctx context.Context) (nvdevice.DriverFiles, error) {
	return discoverDriverFiles(ctx, b.opts.DriverRoot)
}

// hookPlaceholder is the hook path handed to nvcdi; pkg/cdi replaces it
// with the host's nvidia-cdi-hook (or drops the hooks).
const hookPlaceholder = "/nvidia-cdi-hook"

func discoverDriverFiles(ctx context.Context, root string) (nvdevice.DriverFiles, error) {
	if root == "" {
		root = DefaultDriverRoot
	}
	root = filepath.Clean(root)
	lib, err := nvcdi.New(
		nvcdi.WithMode(nvcdi.ModeManagement),
		nvcdi.WithDriverRoot(root),
		nvcdi.WithNVIDIACDIHookPath(hookPlaceholder),
		nvcdi.WithLogger(nvcdiLogger{klog.FromContext(ctx).WithName("nvcdi")}),
	)
	if err != nil {
		return nvdevice.DriverFiles{}, fmt.Errorf("nvcdi over driver root %s: %w", root, err)
	}
	edits, err := lib.GetCommonEdits()
	if err != nil {
		return nvdevice.DriverFiles{}, fmt.Errorf("discover the driver's files under %s: %w", root, err)
	}
	out := nvdevice.DriverFiles{Root: root}
	for _, m := range edits.Mounts {
		host := m.HostPath
		if root != "/" && !filepath.IsAbs(host) {
			host = filepath.Join(root, host)
		}
		out.Mounts = append(out.Mounts, nvdevice.DriverMount{HostPath: host, ContainerPath: m.ContainerPath, Options: m.Options})
	}
	for _, h := range edits.Hooks {
		out.Hooks = append(out.Hooks, nvdevice.DriverHook{HookName: h.HookName, Args: h.Args, Env: h.Env})
	}
	for _, e := range edits.Env {
		const prefix = "NVIDIA_VISIBLE_DEVICES="
		if len(e) >= len(prefix) && e[:len(prefix)] == prefix {
			continue // visibility is the claim spec's business
		}
		out.Env = append(out.Env, e)
	}
	out.Version, err = driverVersionFromMounts(out.Mounts)
	if err != nil {
		return nvdevice.DriverFiles{}, fmt.Errorf("driver root %s: %w", root, err)
	}
	return out, nil
}

// driverVersionFromMounts is the suffix of libcuda.so.<version>, the file
// nvcdi took the version from.
func driverVersionFromMounts(ms []nvdevice.DriverMount) (string, error) {
	for _, m := range ms {
		base := filepath.Base(m.ContainerPath)
		const prefix = "libcuda.so."
		if len(base) > len(prefix) && base[:len(prefix)] == prefix {
			return base[len(prefix):], nil
		}
	}
	return "", fmt.Errorf("no libcuda.so.<version> among the driver's files: %w", nvdevice.ErrNotFound)
}

// nvcdiLogger sends nvcdi's messages to klog: its warnings about optional
// files it did not find are details, not news.
type nvcdiLogger struct{ l logr.Logger }

func (n nvcdiLogger) Debugf(f string, a ...interface{})   { n.l.V(5).Info(fmt.Sprintf(f, a...)) }
func (n nvcdiLogger) Tracef(f string, a ...interface{})   { n.l.V(6).Info(fmt.Sprintf(f, a...)) }
func (n nvcdiLogger) Infof(f string, a ...interface{})    { n.l.V(4).Info(fmt.Sprintf(f, a...)) }
func (n nvcdiLogger) Warningf(f string, a ...interface{}) { n.l.V(2).Info(fmt.Sprintf(f, a...)) }
func (n nvcdiLogger) Errorf(f string, a ...interface{})   { n.l.Error(nil, fmt.Sprintf(f, a...)) }
