package sim

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// The fake driver root has the layout of the NVIDIA driver's user-space
// files on a Debian or Ubuntu x86_64 host, as the driver's .run installer
// and the distribution packages lay them out: empty files and the soname
// symlinks, with the real names.
const (
	// LibDir is where the driver's libraries are, relative to the root.
	LibDir = "usr/lib/x86_64-linux-gnu"
	// BinDir is where its binaries are.
	BinDir = "usr/bin"
	// PersistencedSocket is nvidia-persistenced's socket.
	PersistencedSocket = "run/nvidia-persistenced/socket"
)

// DriverLibraries are the libraries a CUDA or NCCL job loads (the
// toolkit's "compute" and "utility" capabilities), each with its soname
// symlink ("" where the driver ships none).
var DriverLibraries = []struct{ Name, Soname string }{
	{"libcuda.so", "libcuda.so.1"},
	{"libcudadebugger.so", "libcudadebugger.so.1"},
	{"libnvidia-ml.so", "libnvidia-ml.so.1"},
	{"libnvidia-ptxjitcompiler.so", "libnvidia-ptxjitcompiler.so.1"},
	{"libnvidia-nvvm.so", "libnvidia-nvvm.so.4"},
	{"libnvidia-gpucomp.so", ""},
	{"libnvidia-opencl.so", "libnvidia-opencl.so.1"},
	{"libnvidia-cfg.so", "libnvidia-cfg.so.1"},
	{"libnvidia-allocator.so", "libnvidia-allocator.so.1"},
	{"libnvidia-pkcs11-openssl3.so", ""},
}

// DriverBinaries are the driver's binaries a container may use; the same
// list the toolkit's nvcdi looks for.
var DriverBinaries = []string{
	"nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server",
}

// driverFirmware is the GSP firmware of the version (H100 runs gsp_ga10x).
var driverFirmware = []string{"gsp_ga10x.bin", "gsp_tu10x.bin"}

// WriteDriverRoot lays out a fake driver root of the given version under
// dir, replacing the files of any other version there (a driver upgrade).
// Its files are empty; Machine.WriteDriverRoot (standins.go) can put a
// working libcuda and nvidia-smi in their place.
func WriteDriverRoot(dir, version string) error {
	if version == "" {
		version = defaultDriverVersion
	}
	lib := filepath.Join(dir, LibDir)
	// A driver upgrade removes the old version's files.
	old, _ := filepath.Glob(filepath.Join(lib, "lib*.so*"))
	oldFw, _ := filepath.Glob(filepath.Join(dir, "lib/firmware/nvidia/*"))
	for _, p := range append(old, oldFw...) {
		if err := os.RemoveAll(p); err != nil {
			return fmt.Errorf("fake driver root: %w", err)
		}
	}
	fw := filepath.Join(dir, "lib/firmware/nvidia", version)
	for _, d := range []string{lib, filepath.Join(dir, BinDir), fw, filepath.Dir(filepath.Join(dir, PersistencedSocket))} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("fake driver root: %w", err)
		}
	}
	write := func(p string, mode os.FileMode) error {
		if err := os.WriteFile(p, nil, mode); err != nil {
			return fmt.Errorf("fake driver root: %w", err)
		}
		return nil
	}
	for _, l := range DriverLibraries {
		file := l.Name + "." + version
		if err := write(filepath.Join(lib, file), 0o644); err != nil {
			return err
		}
		if l.Soname != "" {
			if err := os.Symlink(file, filepath.Join(lib, l.Soname)); err != nil {
				return fmt.Errorf("fake driver root: %w", err)
			}
		}
	}
	// The development symlink the toolkit's create-symlinks hook makes in
	// containers exists on the host too.
	if err := os.Symlink("libcuda.so.1", filepath.Join(lib, "libcuda.so")); err != nil {
		return fmt.Errorf("fake driver root: %w", err)
	}
	for _, b := range DriverBinaries {
		if err := write(filepath.Join(dir, BinDir, b), 0o755); err != nil {
			return err
		}
	}
	for _, f := range driverFirmware {
		if err := write(filepath.Join(fw, f), 0o644); err != nil {
			return err
		}
	}
	if err := write(filepath.Join(dir, DriverRootMarker), 0o644); err != nil {
		return err
	}
	return writeSocket(filepath.Join(dir, PersistencedSocket))
}

// DriverRootMarker is a file WriteDriverRoot leaves at the root of the
// driver root it writes: what tells a simulated driver root from a host's
// (IsSimulatedDriverRoot).
const DriverRootMarker = ".gpudra-simulated-driver-root"

// IsSimulatedDriverRoot says whether dir is a driver root WriteDriverRoot
// wrote: the plugin's --backend sim then takes its driver files from it,
// and never from a host's real driver.
func IsSimulatedDriverRoot(dir string) bool {
	_, err := os.Stat(filepath.Join(dir, DriverRootMarker))
	return err == nil
}

// writeSocket leaves a unix socket at p, as nvidia-persistenced does; where
// the path is too long for a socket, an empty file stands in (discovery and
// CDI only look at the name).
func writeSocket(p string) error {
	if _, err := os.Lstat(p); err == nil {
		return nil
	}
	if len(p) < 100 {
		l, err := net.ListenUnix("unix", &net.UnixAddr{Name: p, Net: "unix"})
		if err == nil {
			l.SetUnlinkOnClose(false)
			return l.Close()
		}
	}
	if err := os.WriteFile(p, nil, 0o666); err != nil {
		return fmt.Errorf("fake driver root: %w", err)
	}
	return nil
}

// DriverVersion is the machine's driver version, for WriteDriverRoot.
func (m *Machine) DriverVersion() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.inv.DriverVersion
}

// SetDriverRoot points the machine at a driver root (WriteDriverRoot);
// DriverFiles reads it.
func (m *Machine) SetDriverRoot(dir string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.driverRoot = dir
}

// DriverFiles discovers the driver's files under the machine's driver root
// the way the toolkit's nvcdi does in management mode (what the NVML
// backend runs): the version from libcuda.so.<version>, every library of
// that version, the GSP firmware, the binaries, the persistenced socket,
// and the same hooks. nvcdi itself needs cgo (it imports go-nvml), which
// the simulator must not.
func (m *Machine) DriverFiles(context.Context) (nvdevice.DriverFiles, error) {
	m.mu.Lock()
	root := m.driverRoot
	m.mu.Unlock()
	if root == "" {
		return nvdevice.DriverFiles{}, fmt.Errorf("simulated machine has no driver root: %w", nvdevice.ErrNotFound)
	}
	lib := filepath.Join(root, LibDir)
	cuda, _ := filepath.Glob(filepath.Join(lib, "libcuda.so.*.*"))
	if len(cuda) != 1 {
		return nvdevice.DriverFiles{}, fmt.Errorf("driver root %s: want one libcuda.so.<version>, found %d: %w", root, len(cuda), nvdevice.ErrNotFound)
	}
	version := strings.TrimPrefix(filepath.Base(cuda[0]), "libcuda.so.")
	f := nvdevice.DriverFiles{Root: root, Version: version}
	ro := []string{"ro", "nosuid", "nodev", "rbind", "rprivate"}
	add := func(hostPath string, opts []string) {
		f.Mounts = append(f.Mounts, nvdevice.DriverMount{HostPath: hostPath,
			ContainerPath: "/" + strings.TrimPrefix(hostPath, root+"/"), Options: opts})
	}
	libs, _ := filepath.Glob(filepath.Join(lib, "*.so."+version))
	sort.Strings(libs)
	for _, p := range libs {
		add(p, ro)
	}
	for _, pattern := range []string{"gsp*.bin", "ucodes*.bin"} {
		fw, _ := filepath.Glob(filepath.Join(root, "lib/firmware/nvidia", version, pattern))
		for _, p := range fw {
			add(p, ro)
		}
	}
	for _, b := range DriverBinaries {
		p := filepath.Join(root, BinDir, b)
		if _, err := os.Stat(p); err == nil {
			add(p, ro)
		} else if !errors.Is(err, os.ErrNotExist) {
			return nvdevice.DriverFiles{}, fmt.Errorf("driver root %s: %w", root, err)
		}
	}
	if _, err := os.Lstat(filepath.Join(root, PersistencedSocket)); err == nil {
		add(filepath.Join(root, PersistencedSocket), []string{"nosuid", "nodev", "rbind", "rprivate", "noexec"})
	}
	libDir := "/" + LibDir
	hookEnv := []string{"NVIDIA_CTK_DEBUG=false"}
	f.Hooks = []nvdevice.DriverHook{
		{HookName: "createContainer", Args: []string{"nvidia-cdi-hook", "create-symlinks", "--link", "libcuda.so.1::" + libDir + "/libcuda.so"}, Env: hookEnv},
		{HookName: "createContainer", Args: []string{"nvidia-cdi-hook", "enable-cuda-compat", "--host-driver-version=" + version}, Env: hookEnv},
		{HookName: "createContainer", Args: []string{"nvidia-cdi-hook", "update-ldcache", "--folder", libDir}, Env: hookEnv},
	}
	f.Env = []string{"NVIDIA_CTK_LIBCUDA_DIR=" + libDir}
	return f, nil
}
