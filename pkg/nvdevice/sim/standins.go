package sim

import (
	"context"
	_ "embed" // the stand-ins' sources
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// The driver's stand-ins (issue 34): a fake libcuda.so.1 in C (built with
// gcc as a shared library: a test fixture, not cgo) and an nvidia-smi -L
// in shell, that behave as the real ones do as far as a container can
// tell. Both learn the GPUs from the machine's device table written into
// them here: on a real host the kernel driver knows each GPU's name, UUID
// and memory, whatever container asks, and nothing in a container's
// environment or spec says it (the CDI specs set NVIDIA_VISIBLE_DEVICES=void
// and no CUDA_VISIBLE_DEVICES); which GPUs a process sees is decided, as
// for the real driver, by the /dev/nvidia<minor> nodes it has and may open.
// Carrying the table inside the two files the driver ships means the CDI
// spec mounts exactly the files it mounts for the real driver, nothing more.

//go:embed fakecuda/libcuda.c
var fakeLibCUDASource []byte

//go:embed fakecuda/nvidia-smi.sh
var fakeNvidiaSMI string

// fakeCUDATableMark starts the device table appended to the fake
// libcuda's file (libcuda.c's TABLE_MARK).
const fakeCUDATableMark = "\n#gpudra-fakecuda-table v1\n"

// DriverStandIns are working stand-ins for driver files that are otherwise
// empty in a simulated driver root (Machine.WriteDriverRoot). The zero
// value installs none.
type DriverStandIns struct {
	// LibCUDA is a fake libcuda built from fakecuda/libcuda.c
	// (BuildFakeLibCUDA, or make's bin/fakecuda/libcuda.so): installed as
	// libcuda.so.<version>, the machine's device table appended.
	LibCUDA string
	// NvidiaSMI installs fakecuda/nvidia-smi.sh, with the machine's device
	// table, as usr/bin/nvidia-smi.
	NvidiaSMI bool
}

// WriteDriverRoot lays out the machine's driver root under dir
// (WriteDriverRoot with the machine's driver version) with the stand-ins
// given in place of the empty libcuda and nvidia-smi. It does not point
// the machine at dir (SetDriverRoot).
func (m *Machine) WriteDriverRoot(dir string, s DriverStandIns) error {
	version := m.DriverVersion()
	if err := WriteDriverRoot(dir, version); err != nil {
		return err
	}
	table := m.DeviceTable()
	if s.LibCUDA != "" {
		lib, err := os.ReadFile(s.LibCUDA)
		if err != nil {
			return fmt.Errorf("fake driver root: libcuda stand-in: %w", err)
		}
		lib = append(lib, fakeCUDATableMark+table+"#end\n"...)
		if err := os.WriteFile(filepath.Join(dir, LibDir, "libcuda.so."+version), lib, 0o644); err != nil {
			return fmt.Errorf("fake driver root: %w", err)
		}
	}
	if s.NvidiaSMI {
		script := strings.Replace(fakeNvidiaSMI, "@TABLE@\n", table, 1)
		if err := os.WriteFile(filepath.Join(dir, BinDir, "nvidia-smi"), []byte(script), 0o755); err != nil {
			return fmt.Errorf("fake driver root: %w", err)
		}
	}
	return nil
}

// DeviceTable is what the driver's stand-ins know of the machine, one line
// each: "cuda <version>" (12080 for CUDA 12.8, as cuDriverGetVersion
// gives it), then per GPU in PCI bus order "gpu <minor> <PCI bus id>
// <UUID> <memory in bytes> <product name>".
func (m *Machine) DeviceTable() string {
	m.mu.Lock()
	cuda := m.inv.CUDADriverVersion
	m.mu.Unlock()
	gpus := m.Devices()
	sort.Slice(gpus, func(i, j int) bool { return gpus[i].PCI.BusID < gpus[j].PCI.BusID })
	var b strings.Builder
	fmt.Fprintf(&b, "cuda %d\n", cudaVersionNumber(cuda))
	for _, g := range gpus {
		fmt.Fprintf(&b, "gpu %d %s %s %d %s\n", g.Minor, g.PCI.BusID, g.UUID, g.MemoryMiB<<20, g.ProductName)
	}
	return b.String()
}

// cudaVersionNumber is "12.8" as CUDA numbers it: 12080.
func cudaVersionNumber(v string) int {
	major, minor, _ := strings.Cut(v, ".")
	ma, _ := strconv.Atoi(major)
	mi, _ := strconv.Atoi(minor)
	return ma*1000 + mi*10
}

// ErrNoCompiler: BuildFakeLibCUDA found no gcc.
var ErrNoCompiler = errors.New("no C compiler (gcc) to build the fake libcuda")

// BuildFakeLibCUDA compiles fakecuda/libcuda.c (embedded here) with gcc
// into dir/libcuda.so and returns its path: the DriverStandIns.LibCUDA a
// test can build where gcc is.
func BuildFakeLibCUDA(ctx context.Context, dir string) (string, error) {
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		return "", fmt.Errorf("%w: %w", ErrNoCompiler, err)
	}
	src, out := filepath.Join(dir, "libcuda.c"), filepath.Join(dir, "libcuda.so")
	if err := os.WriteFile(src, fakeLibCUDASource, 0o644); err != nil {
		return "", err
	}
	cmd := exec.CommandContext(ctx, gcc, "-shared", "-fPIC", "-O2", "-Wall", "-Wl,-soname,libcuda.so.1", "-o", out, src)
	if msg, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build the fake libcuda: %w: %s", err, strings.TrimSpace(string(msg)))
	}
	return out, nil
}
