package scalebench_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/bench/scalebench"
	"github.com/gpudra/gpudra/devcluster/chart"
)

// TestScaleBench runs make bench-scale's quick mode (BENCH_SCALE=quick: 50
// nodes that are only API objects, MIG off and MIG mode with the plugin's
// default policy, gpudra-controller as its own process) on a control plane
// of its own, and asserts only that every pod was bound: the figures are
// the benchmark's business, this keeps it working. About a minute; skipped
// with -short.
func TestScaleBench(t *testing.T) {
	if testing.Short() {
		t.Skip("the quick scale benchmark takes about a minute")
	}
	bin := t.TempDir()
	// The binaries of this tree, as make build makes them (the controller
	// and, for its --mig-devices default, the plugin); go's cache makes
	// this quick after the first time.
	for name, pkg := range map[string]string{"gpudra-controller": "./cmd/controller", "gpudra-kubelet-plugin": "./cmd/kubelet-plugin"} {
		cmd := exec.Command("go", "build", "-o", filepath.Join(bin, name), pkg)
		cmd.Dir = "../.."
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "go build %s: %s", pkg, out)
	}
	var stdout bytes.Buffer
	cfg := scalebench.Config{ControllerBinary: filepath.Join(bin, "gpudra-controller"), PluginBinary: filepath.Join(bin, "gpudra-kubelet-plugin"),
		Chart: chart.Default("../.."), Dir: t.TempDir(), ControlPlaneQPS: 1000, Stdout: &stdout}
	cfg.Quick()
	res, err := scalebench.Run(context.Background(), cfg)
	t.Log("\n" + stdout.String())
	require.NoError(t, err)
	require.NotEmpty(t, res.Points)
	require.NoError(t, res.AllBound())
}
