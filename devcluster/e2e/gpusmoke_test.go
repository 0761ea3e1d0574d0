package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/devcluster/chart"
)

// gpuSmokeBundle is the gpu-smoke bundle make test-e2e builds without cgo
// (make gpu-smoke-bundle BUNDLE_CGO=0): the program and run.sh a GPU node
// runs, in their simulated mode.
func gpuSmokeBundle(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("GPU_SMOKE_BUNDLE")
	if dir == "" {
		t.Skip("GPU_SMOKE_BUNDLE names the gpu-smoke bundle's directory (make test-e2e builds it)")
	}
	if os.Geteuid() != 0 {
		t.Skip("gpu-smoke runs real containers: it needs root")
	}
	// As on a GPU node: the bundle alone, away from the source tree.
	copied := filepath.Join(t.TempDir(), "bundle")
	out, err := exec.Command("cp", "-a", dir, copied).CombinedOutput()
	require.NoError(t, err, "%s", out)
	return copied
}

// The gpu-smoke bundle's run.sh, in its simulated mode, passes end to end
// (the DeviceClasses from the chart, the whole-GPU pod seeing its GPU
// through nvidia-smi and CUDA, the pod without a claim seeing none, two MPS
// clients under and over the limit, the timings) on a machine where
// neither the Go module cache nor the source tree can be reached and HOME,
// GOPATH and GOMODCACHE name nothing: the binaries carry all they need.
func TestGPUSmokeBundleSimulated(t *testing.T) {
	bundle := gpuSmokeBundle(t)
	modCache, err := exec.Command("go", "env", "GOMODCACHE").Output()
	require.NoError(t, err)
	source, err := filepath.Abs("../..")
	require.NoError(t, err)
	results := filepath.Join(t.TempDir(), "results")
	missing := filepath.Join(t.TempDir(), "missing")
	// A mount namespace of its own hides the module cache and the source
	// tree under empty file systems.
	hide := `set -e; for d in "$@"; do [ "$d" = -- ] && break; mount -t tmpfs gpudra-hidden "$d"; done; while [ "$1" != -- ]; do shift; done; shift; exec "$@"`
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sh", "-c", hide, "sh",
		strings.TrimSpace(string(modCache)), source, "--",
		"env", "-i", "PATH="+os.Getenv("PATH"), "HOME="+missing, "GOPATH="+filepath.Join(missing, "go"),
		"GOMODCACHE="+filepath.Join(missing, "mod"), "RESULTS="+results, "GPU_SMOKE_ARGS=--timing-claims=10",
		filepath.Join(bundle, "run.sh"), "--simulated")
	start := time.Now()
	out, err := cmd.CombinedOutput()
	t.Logf("run.sh --simulated took %s", time.Since(start).Round(time.Second))
	require.NoError(t, err, "run.sh --simulated:\n%s", out)
	result, err := os.ReadFile(filepath.Join(results, "RESULT"))
	require.NoError(t, err)
	assert.Equal(t, "PASS\n", string(result))
	for _, f := range []string{"inventory.txt", "inventory.json", "slices.yaml", "compare.txt", "pods/with-gpu.json", "pods/no-gpu.json",
		"pods/mps-under.json", "pods/mps-over.json", "timings.txt", "timings.json", "gpu-smoke.log"} {
		assert.FileExists(t, filepath.Join(results, f))
	}
	text := string(out)
	assert.Contains(t, text, "== the chart's DeviceClasses: [gpu.gpudra.dev", "the chart's own classes were installed")
	assert.Contains(t, text, "mps-over: allocation of 12Gi (limit 8Gi): CUDA_ERROR_OUT_OF_MEMORY", "the MPS limit held for the client over it")
	assert.Contains(t, text, "mps-under: allocation of 4Gi (limit 8Gi): ok")
	timings, err := os.ReadFile(filepath.Join(results, "timings.txt"))
	require.NoError(t, err)
	assert.Contains(t, string(timings), "nvml-gpu")
	assert.Contains(t, string(timings), "sim-h100")
}

// Without the whole-GPU DeviceClass (a chart rendered with it disabled),
// gpu-smoke fails, and says why before its cluster stops: the pod's
// conditions carry the scheduler's "device class ... does not exist", with
// the claims, the slices and the log's errors beside them.
func TestGPUSmokeDiagnosesAMissingDeviceClass(t *testing.T) {
	bundle := gpuSmokeBundle(t)
	source, err := filepath.Abs("../..")
	require.NoError(t, err)
	rendered, err := chart.Render(context.Background(), chart.Default(source), chart.RenderedDirPlaceholder,
		"--set", "deviceClasses.gpu.enabled=false")
	require.NoError(t, err)
	chart := filepath.Join(t.TempDir(), "chart.yaml")
	require.NoError(t, os.WriteFile(chart, []byte(rendered), 0o600))
	results := filepath.Join(t.TempDir(), "results")
	cmd := exec.Command(filepath.Join(bundle, "bin", "gpu-smoke"), "--simulated", "dgx-h100-nomig", "--results", results,
		"--rendered-chart", chart, "--pod-timeout", "15s",
		"--runc", filepath.Join(bundle, "bin", "runc"), "--probe", filepath.Join(bundle, "bin", "gpudra-probe"),
		"--cuda-check", filepath.Join(bundle, "bin", "gpudra-cuda-check"), "--mps-server", filepath.Join(bundle, "bin", "gpudra-mps-server"),
		"--fake-libcuda", filepath.Join(bundle, "stand-ins", "libcuda.so"), "--mps-control-binary", filepath.Join(bundle, "stand-ins", "nvidia-cuda-mps-control"))
	out, err := cmd.CombinedOutput()
	require.Error(t, err, "gpu-smoke passed without the gpu.gpudra.dev class:\n%s", out)
	text := string(out)
	assert.Contains(t, text, "gpu-smoke: FAIL: pods with-gpu are not Running")
	assert.Contains(t, text, "== diagnostics")
	assert.Contains(t, text, "device class gpu.gpudra.dev does not exist", "the scheduler's reason is shown")
	assert.Contains(t, text, "-- claim gpu-smoke/one-gpu: not allocated")
	assert.Contains(t, text, "-- ResourceSlices of node nvml-gpu: ")
	assert.Contains(t, text, "-- the last 20 errors in the log")
	result, err := os.ReadFile(filepath.Join(results, "RESULT"))
	require.NoError(t, err)
	assert.True(t, strings.HasPrefix(string(result), "FAIL: pods with-gpu are not Running"), "%s", result)
	diag, err := os.ReadFile(filepath.Join(results, "diagnostics.txt"))
	require.NoError(t, err)
	assert.Contains(t, string(diag), "device class gpu.gpudra.dev does not exist")
}

// Where no GPU is, run.sh stops at once with one line that says so.
func TestGPUSmokeBundleWithoutGPU(t *testing.T) {
	if _, err := os.Stat("/dev/nvidiactl"); err == nil {
		t.Skip("this machine has an NVIDIA GPU")
	}
	bundle := gpuSmokeBundle(t)
	cmd := exec.Command(filepath.Join(bundle, "run.sh"))
	cmd.Env = append(os.Environ(), "RESULTS="+filepath.Join(t.TempDir(), "results"))
	start := time.Now()
	out, err := cmd.CombinedOutput()
	took := time.Since(start)
	require.Error(t, err)
	assert.Equal(t, "gpu-smoke: FAIL: no NVIDIA GPU here (/dev/nvidiactl does not exist): run it on a node with an NVIDIA GPU and driver, or with --simulated\n", string(out))
	assert.Less(t, took, 5*time.Second, "it stops at once")
}
