package cudacheck_test

import (
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/probe/cudacheck"
)

// TestCheckAgainstFakeDriver runs the built gpudra-cuda-check binary
// against the simulated driver's libcuda stand-in (fakecuda/libcuda.c,
// built with gcc, installed by sim.Machine.WriteDriverRoot with the
// machine's device table) and its nvidia-smi, over /dev directories with
// 0, 1 and 2 GPU nodes, and under an MPS pinned-memory limit as on the
// real H100 and H200: 4 GiB allowed and 12 GiB refused under 8 GiB.
func TestCheckAgainstFakeDriver(t *testing.T) {
	ctx := context.Background()
	tmp := t.TempDir()
	lib, err := sim.BuildFakeLibCUDA(ctx, tmp)
	if errors.Is(err, sim.ErrNoCompiler) {
		t.Skip("no gcc to build the fake libcuda: ", err)
	}
	require.NoError(t, err)

	machine, err := sim.NewBuiltin("dgx-h100-nomig", "cudacheck-test")
	require.NoError(t, err)
	root := filepath.Join(tmp, "driver")
	require.NoError(t, machine.WriteDriverRoot(root, sim.DriverStandIns{LibCUDA: lib, NvidiaSMI: true}))
	libDir := filepath.Join(root, sim.LibDir)
	smi := filepath.Join(root, sim.BinDir, "nvidia-smi")

	check := filepath.Join(tmp, "gpudra-cuda-check")
	build := exec.CommandContext(ctx, filepath.Join(runtime.GOROOT(), "bin", "go"), "build", "-o", check, "github.com/gpudra/gpudra/cmd/gpudra-cuda-check")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "%s", out)
	bin, err := elf.Open(check)
	require.NoError(t, err)
	interp := false
	for _, p := range bin.Progs {
		interp = interp || p.Type == elf.PT_INTERP
	}
	_ = bin.Close()
	assert.True(t, interp, "purego without cgo still makes a dynamically linked binary (it needs the image's libc)")

	gpus := machine.Devices()
	byMinor := map[int]nvdevice.GPU{}
	for _, g := range gpus {
		byMinor[g.Minor] = g
	}
	// dev makes a /dev with nvidiactl (unless ctl is false) and the given
	// GPUs' nodes, real character devices with the driver's numbers.
	dev := func(name string, ctl bool, minors ...int) string {
		d := filepath.Join(tmp, name)
		require.NoError(t, os.MkdirAll(d, 0o755))
		nodes := map[string]int{}
		if ctl {
			nodes["nvidiactl"] = 255
		}
		for _, m := range minors {
			nodes[fmt.Sprintf("nvidia%d", m)] = m
		}
		for n, minor := range nodes {
			err := unix.Mknod(filepath.Join(d, n), unix.S_IFCHR|0o666, int(unix.Mkdev(195, uint32(minor))))
			if errors.Is(err, unix.EPERM) {
				t.Skip("mknod refused (not root): the fake driver needs real character devices: ", err)
			}
			require.NoError(t, err)
		}
		return d
	}
	// An MPS control daemon's pipe directory, with its control FIFO; and
	// one without.
	pipe, noMPS := filepath.Join(tmp, "mps"), filepath.Join(tmp, "no-mps")
	require.NoError(t, os.MkdirAll(pipe, 0o755))
	require.NoError(t, os.MkdirAll(noMPS, 0o755))
	require.NoError(t, unix.Mkfifo(filepath.Join(pipe, "control"), 0o600))
	run := func(devDir string, env []string, args ...string) (*cudacheck.Result, int, string) {
		t.Helper()
		cmd := exec.CommandContext(ctx, check, args...)
		// No MPS daemon unless env says where one is (a later entry wins).
		cmd.Env = append([]string{"PATH=/usr/bin:/bin", "GPUDRA_FAKECUDA_DEV=" + devDir, "CUDA_MPS_PIPE_DIRECTORY=" + noMPS}, env...)
		out, err := cmd.Output()
		code := 0
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			code = exit.ExitCode()
		} else {
			require.NoError(t, err)
		}
		r, err := cudacheck.ParseOutput(string(out))
		require.NoError(t, err)
		return r, code, string(out)
	}
	withLib := func(args ...string) []string {
		return append([]string{"--libcuda", filepath.Join(libDir, "libcuda.so.1")}, args...)
	}
	nvidiaSMI := func(devDir string) (string, int) {
		cmd := exec.CommandContext(ctx, smi, "-L")
		cmd.Env = []string{"PATH=/usr/bin:/bin", "GPUDRA_FAKECUDA_DEV=" + devDir}
		out, err := cmd.CombinedOutput()
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			return string(out), exit.ExitCode()
		}
		require.NoError(t, err)
		return string(out), 0
	}
	smiLine := func(i int, g nvdevice.GPU) string {
		return fmt.Sprintf("GPU %d: %s (UUID: %s)\n", i, g.ProductName, g.UUID)
	}

	t.Run("no GPU node", func(t *testing.T) {
		d := dev("dev0", true)
		r, code, _ := run(d, nil, withLib("--alloc", "1Gi")...)
		assert.Equal(t, cudacheck.NoDevice, r.Outcome)
		assert.Equal(t, "CUDA_ERROR_NO_DEVICE", r.Init)
		assert.Equal(t, 12080, r.DriverVersion, "the driver's CUDA version reads without a device")
		assert.Equal(t, cudacheck.NotRun, r.Alloc.Result)
		assert.Equal(t, 3, code)
		out, code := nvidiaSMI(d)
		assert.Equal(t, "No devices were found\n", out)
		assert.Equal(t, 6, code)
	})
	t.Run("no driver nodes at all", func(t *testing.T) {
		d := dev("dev-none", false)
		r, code, _ := run(d, nil, withLib()...)
		assert.Equal(t, cudacheck.NoDevice, r.Outcome)
		assert.Equal(t, 3, code)
		out, code := nvidiaSMI(d)
		assert.Contains(t, out, "couldn't communicate with the NVIDIA driver")
		assert.Equal(t, 9, code)
	})
	t.Run("no libcuda", func(t *testing.T) {
		r, code, out := run(dev("dev-nolib", true, 0), nil, "--libcuda", filepath.Join(tmp, "nowhere", "libcuda.so.1"), "--alloc", "1Gi")
		assert.Equal(t, cudacheck.NoDevice, r.Outcome)
		assert.Contains(t, r.LoadError, "nowhere/libcuda.so.1")
		assert.Equal(t, 3, code)
		assert.Contains(t, out, "gpudra-cuda-check: no-device: libcuda not loadable")
	})

	one := dev("dev1", true, 3)
	t.Run("one GPU node", func(t *testing.T) {
		r, code, out := run(one, nil, withLib("--alloc", "1Gi")...)
		assert.Equal(t, cudacheck.OK, r.Outcome, out)
		assert.Equal(t, 0, code)
		assert.Equal(t, "12.8", r.CUDAVersion)
		assert.Equal(t, []cudacheck.Device{{Ordinal: 0, Name: "NVIDIA H100 80GB HBM3", UUID: byMinor[3].UUID, MemoryBytes: byMinor[3].MemoryMiB << 20}}, r.Devices,
			"the GPU of the node's minor, with the simulated machine's UUID")
		assert.Equal(t, &cudacheck.Alloc{Device: 0, Bytes: 1 << 30, Result: cudacheck.OK}, r.Alloc)
		assert.Equal(t, filepath.Join(libDir, "libcuda.so."+machine.DriverVersion()), r.Library)
		smiOut, code := nvidiaSMI(one)
		assert.Equal(t, smiLine(0, byMinor[3]), smiOut)
		assert.Equal(t, 0, code)
	})
	t.Run("loaded by soname", func(t *testing.T) {
		r, _, out := run(one, []string{"LD_LIBRARY_PATH=" + libDir})
		assert.Equal(t, cudacheck.OK, r.Outcome, out)
		assert.Equal(t, filepath.Join(libDir, "libcuda.so."+machine.DriverVersion()), r.Library, "libcuda.so.1 through the dynamic loader")
	})
	t.Run("beyond the device's memory", func(t *testing.T) {
		r, code, _ := run(one, nil, withLib("--alloc", "12Gi")...)
		assert.Equal(t, cudacheck.OK, r.Outcome, "an exclusive client allocates 12 GiB")
		r, code, _ = run(one, nil, withLib("--alloc", "100Gi")...)
		assert.Equal(t, cudacheck.Failed, r.Outcome)
		assert.Equal(t, "CUDA_ERROR_OUT_OF_MEMORY", r.Alloc.Result)
		assert.Equal(t, 1, code)
	})
	t.Run("MPS pinned memory limit", func(t *testing.T) {
		for _, limit := range []string{"0=8192M", "0=8G", "8G"} {
			mps := []string{"CUDA_MPS_PIPE_DIRECTORY=" + pipe, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=" + limit}
			r, code, out := run(one, mps, withLib("--alloc", "4Gi")...)
			assert.Equal(t, cudacheck.OK, r.Outcome, "%s: %s", limit, out)
			assert.Equal(t, 0, code)
			r, code, out = run(one, mps, withLib("--alloc", "12Gi")...)
			assert.Equal(t, cudacheck.Failed, r.Outcome, "%s: %s", limit, out)
			assert.Equal(t, "CUDA_ERROR_OUT_OF_MEMORY", r.Alloc.Result, limit)
			assert.Equal(t, "cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY", r.Error, limit)
			assert.Contains(t, out, "cuMemAlloc 12 GiB on device 0: CUDA_ERROR_OUT_OF_MEMORY", limit)
			assert.Equal(t, 1, code)
		}
		// As on a real H200 (driver 580.159.04): a limit for another device
		// ordinal leaves device 0 alone; "8GB" is no limit; without an MPS
		// daemon the variable is ignored.
		for _, env := range [][]string{
			{"CUDA_MPS_PIPE_DIRECTORY=" + pipe, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=1=8G"},
			{"CUDA_MPS_PIPE_DIRECTORY=" + pipe, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8GB"},
			{"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8G"},
		} {
			r, _, out := run(one, env, withLib("--alloc", "12Gi")...)
			assert.Equal(t, cudacheck.OK, r.Outcome, "%s: %s", env, out)
		}
	})

	two := dev("dev2", true, 5, 1)
	t.Run("two GPU nodes", func(t *testing.T) {
		r, code, out := run(two, nil, withLib("--alloc", "2Gi", "--device", "1")...)
		assert.Equal(t, cudacheck.OK, r.Outcome, out)
		assert.Equal(t, 0, code)
		require.Len(t, r.Devices, 2)
		assert.Equal(t, []string{byMinor[1].UUID, byMinor[5].UUID}, []string{r.Devices[0].UUID, r.Devices[1].UUID}, "in PCI bus order")
		assert.Equal(t, &cudacheck.Alloc{Device: 1, Bytes: 2 << 30, Result: cudacheck.OK}, r.Alloc)
		smiOut, _ := nvidiaSMI(two)
		assert.Equal(t, smiLine(0, byMinor[1])+smiLine(1, byMinor[5]), smiOut)
		assert.NotContains(t, smiOut+strings.Join([]string{r.Devices[0].UUID, r.Devices[1].UUID}, ""), byMinor[0].UUID, "no other GPU")

		// The MPS limit is per ordinal as the client sees them.
		mps := []string{"CUDA_MPS_PIPE_DIRECTORY=" + pipe, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=40G,1=8G"}
		r, _, _ = run(two, mps, withLib("--alloc", "12Gi", "--device", "1")...)
		assert.Equal(t, "CUDA_ERROR_OUT_OF_MEMORY", r.Alloc.Result)
		r, _, _ = run(two, mps, withLib("--alloc", "12Gi", "--device", "0")...)
		assert.Equal(t, cudacheck.OK, r.Alloc.Result)

		// CUDA_VISIBLE_DEVICES narrows what CUDA enumerates, by UUID or ordinal.
		r, _, _ = run(two, []string{"CUDA_VISIBLE_DEVICES=" + byMinor[5].UUID}, withLib()...)
		require.Len(t, r.Devices, 1)
		assert.Equal(t, byMinor[5].UUID, r.Devices[0].UUID)
		r, _, _ = run(two, []string{"CUDA_VISIBLE_DEVICES=1,0"}, withLib()...)
		assert.Equal(t, []string{byMinor[5].UUID, byMinor[1].UUID}, []string{r.Devices[0].UUID, r.Devices[1].UUID})
		r, _, _ = run(two, []string{"CUDA_VISIBLE_DEVICES="}, withLib()...)
		assert.Equal(t, cudacheck.NoDevice, r.Outcome)
	})
	t.Run("a node of a GPU the driver does not know", func(t *testing.T) {
		r, _, _ := run(dev("dev-unknown", true, 200), nil, withLib()...)
		assert.Equal(t, cudacheck.NoDevice, r.Outcome)
	})
}

// TestDriverStandInsDefault: without stand-ins the driver root keeps its
// empty files.
func TestDriverStandInsDefault(t *testing.T) {
	machine, err := sim.NewBuiltin("dgx-h100-nomig", "cudacheck-test")
	require.NoError(t, err)
	root := t.TempDir()
	require.NoError(t, machine.WriteDriverRoot(root, sim.DriverStandIns{}))
	for _, p := range []string{filepath.Join(sim.LibDir, "libcuda.so."+machine.DriverVersion()), filepath.Join(sim.BinDir, "nvidia-smi")} {
		fi, err := os.Stat(filepath.Join(root, p))
		require.NoError(t, err)
		assert.Zero(t, fi.Size(), p)
	}
}
