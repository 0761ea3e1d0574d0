package noderuntime

import (
	"context"
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

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/prepared"
	"github.com/gpudra/gpudra/pkg/probe/cudacheck"
)

// TestCUDACheckInContainer (issue 34): gpudra-cuda-check, bound into a
// real runc container (OCIRuntime.CUDACheck) whose image is the host's
// /usr, loads the libcuda.so.1 that the node's CDI driver spec mounts from
// a simulated driver root carrying the fake libcuda and nvidia-smi
// (sim.Machine.WriteDriverRoot with DriverStandIns), and sees exactly the
// claimed GPUs, by the UUIDs the simulated machine gives them; under an
// MPS claim's 8 GiB limit 4 GiB is allocated and 12 GiB refused. A
// container with no claim has no device.
func TestCUDACheckInContainer(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("real containers need root")
	}
	bin := func(env, def string) string {
		if p := os.Getenv(env); p != "" {
			return p
		}
		p, _ := filepath.Abs(def)
		return p
	}
	runc := bin("RUNC", "../../bin/runc")
	if _, err := os.Stat(runc); err != nil {
		t.Skipf("%v (make bin/runc builds it; RUNC names another)", err)
	}
	ctx := context.Background()
	tmp := t.TempDir()
	// The probe of this tree (PROBE names another): the runtime passes it
	// flags that an older bin/gpudra-probe does not know.
	probeBin := os.Getenv("PROBE")
	if probeBin == "" {
		probeBin = filepath.Join(tmp, "gpudra-probe")
		build := exec.CommandContext(ctx, filepath.Join(runtime.GOROOT(), "bin", "go"), "build", "-o", probeBin, "./cmd/gpudra-probe")
		build.Dir, build.Env = "../..", append(os.Environ(), "CGO_ENABLED=0")
		built, err := build.CombinedOutput()
		require.NoError(t, err, "%s", built)
	}
	lib, err := sim.BuildFakeLibCUDA(ctx, tmp)
	if errors.Is(err, sim.ErrNoCompiler) {
		t.Skip("no gcc to build the fake libcuda: ", err)
	}
	require.NoError(t, err)
	check := filepath.Join(tmp, "gpudra-cuda-check")
	build := exec.CommandContext(ctx, filepath.Join(runtime.GOROOT(), "bin", "go"), "build", "-o", check, "./cmd/gpudra-cuda-check")
	build.Dir, build.Env = "../..", append(os.Environ(), "CGO_ENABLED=0")
	built, err := build.CombinedOutput()
	require.NoError(t, err, "%s", built)

	// The node: a simulated machine whose driver root carries the
	// stand-ins, and the CDI specs its plugin would write.
	machine, err := sim.NewBuiltin("dgx-h100-nomig", "cuda-check")
	require.NoError(t, err)
	root := filepath.Join(tmp, "driver")
	require.NoError(t, machine.WriteDriverRoot(root, sim.DriverStandIns{LibCUDA: lib, NvidiaSMI: true}))
	machine.SetDriverRoot(root)
	files, err := machine.DriverFiles(ctx)
	require.NoError(t, err)
	cdiDir := filepath.Join(tmp, "cdi")
	w, err := cdi.NewWriter(cdiDir)
	require.NoError(t, err)
	driverSpec, err := cdi.BuildDriverSpec(files, cdi.DriverOptions{})
	require.NoError(t, err)
	require.NoError(t, w.WriteDriver(driverSpec))
	host, err := machine.Host(ctx)
	require.NoError(t, err)
	gpus := machine.Devices()
	claim := func(uid string, env map[string]string, mounts []cdi.Mount, minors ...int) []string {
		c := cdi.Claim{UID: uid, Env: env, Mounts: mounts}
		ids := []string{cdi.DriverDeviceID}
		for _, m := range minors {
			d := prepared.Device{Device: fmt.Sprintf("gpu-%d", m), UUID: gpus[m].UUID, Nodes: []prepared.DeviceNode{cdi.GPUNode(host.Majors, gpus[m].Minor)}}
			c.Devices = append(c.Devices, d)
			ids = append(ids, cdi.QualifiedName(uid, d.CDIName()))
		}
		spec, err := cdi.BuildSpec(c, host.Majors)
		require.NoError(t, err)
		require.NoError(t, w.Write(uid, spec))
		return ids
	}

	rt := &OCIRuntime{Runc: runc, Probe: probeBin, CUDACheck: check, HostImage: true, Root: filepath.Join(tmp, "rt")}
	require.NoError(t, rt.Usable())
	n := 0
	run := func(ids []string, command ...string) string {
		t.Helper()
		_, spec, err := ResolveContainerSpec(cdiDir, RuntimeEdits{CDIDevices: ids}, nil, nil)
		require.NoError(t, err)
		spec.Process.Args = append([]string{"--"}, command...)
		n++
		id := fmt.Sprintf("cuda-check-%d", n)
		report, err := rt.Start(ctx, id, spec)
		require.NoError(t, err)
		t.Cleanup(func() { _ = rt.Stop(context.Background(), id) })
		require.NotNil(t, report.Command)
		t.Logf("%q: exit %d:\n%s", command, report.Command.ExitCode, report.Command.Output)
		return report.Command.Output
	}
	result := func(out string) *cudacheck.Result {
		t.Helper()
		r, err := cudacheck.ParseOutput(out)
		require.NoError(t, err, out)
		return r
	}

	// An MPS claim as pkg/sharing makes it: the pipe directory of a running
	// control daemon (its control FIFO) and the client's limit.
	pipe := filepath.Join(tmp, "mps-pipe")
	require.NoError(t, os.MkdirAll(pipe, 0o755))
	require.NoError(t, unix.Mkfifo(filepath.Join(pipe, "control"), 0o600))
	mps := claim("mps", map[string]string{"CUDA_MPS_PIPE_DIRECTORY": "/var/run/gpudra/mps", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8192M"},
		[]cdi.Mount{{HostPath: pipe, ContainerPath: "/var/run/gpudra/mps"}}, 3)
	out := run(mps, CUDACheckPath, "--alloc", "4Gi")
	r := result(out)
	assert.Equal(t, cudacheck.OK, r.Outcome, out)
	require.Len(t, r.Devices, 1, out)
	assert.Equal(t, gpus[3].UUID, r.Devices[0].UUID, "the claimed GPU, by the machine's UUID")
	assert.Equal(t, "NVIDIA H100 80GB HBM3", r.Devices[0].Name)
	assert.Equal(t, "/usr/lib/x86_64-linux-gnu/libcuda.so.1", r.Library, "the soname the CDI spec mounted, through the loader")
	r = result(run(mps, CUDACheckPath, "--alloc", "12Gi"))
	assert.Equal(t, "CUDA_ERROR_OUT_OF_MEMORY", r.Alloc.Result, "12 GiB under an 8 GiB MPS limit")

	two := claim("two", nil, nil, 1, 6)
	out = run(two, "sh", "-c", "nvidia-smi -L; "+CUDACheckPath+" --alloc 12Gi --device 1")
	r = result(out)
	assert.Equal(t, cudacheck.OK, r.Outcome, out)
	require.Len(t, r.Devices, 2, out)
	assert.Equal(t, []string{gpus[1].UUID, gpus[6].UUID}, []string{r.Devices[0].UUID, r.Devices[1].UUID})
	assert.True(t, strings.HasPrefix(out, "GPU 0: NVIDIA H100 80GB HBM3 (UUID: "+gpus[1].UUID+")\nGPU 1: NVIDIA H100 80GB HBM3 (UUID: "+gpus[6].UUID+")\n"),
		"nvidia-smi -L lists the same two: %s", out)

	out = run(nil, CUDACheckPath, "--alloc", "1Gi")
	r = result(out)
	assert.Equal(t, cudacheck.NoDevice, r.Outcome, out)
	assert.NotEmpty(t, r.LoadError, "no claim: no driver files, no libcuda")
}
