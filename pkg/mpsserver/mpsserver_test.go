package mpsserver

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spf13/pflag"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func standIn(t *testing.T) string {
	p, err := filepath.Abs("../../hack/fake-nvidia-cuda-mps-control")
	require.NoError(t, err)
	return p
}

func TestFlags(t *testing.T) {
	fs := pflag.NewFlagSet("gpudra-mps-server", pflag.ContinueOnError)
	cfg := AddFlags(fs)
	require.NoError(t, fs.Parse([]string{"--driver-root=/run/nvidia/driver", "--dir=/var/lib/x", "--devices=GPU-a, GPU-b", "--control-binary=usr/bin/mps"}))
	assert.Equal(t, "/run/nvidia/driver", cfg.Tools.Root)
	assert.Equal(t, []string{"GPU-a", "GPU-b"}, cfg.Devices)
	assert.Equal(t, []string{"CUDA_MPS_PIPE_DIRECTORY=/var/lib/x/pipe", "CUDA_MPS_LOG_DIRECTORY=/var/lib/x/log", "CUDA_VISIBLE_DEVICES=GPU-a,GPU-b"}, cfg.Env())
}

func TestBadConfigNamesTheFlag(t *testing.T) {
	tests := []struct {
		cfg  Config
		want string
	}{
		{Config{Devices: []string{"GPU-a"}}, "--dir: required"},
		{Config{Dir: "relative", Devices: []string{"GPU-a"}}, `--dir: "relative" is not an absolute path`},
		{Config{Dir: "/x"}, "--devices: at least one device UUID is required"},
		// The path the daemon exited on at once on an H200, in
		// gpu-smoke's devcluster (testdata/real-gpus/h200).
		{Config{Dir: "/tmp/gpu-smoke-560586586/nodes/nvml-gpu/plugins/gpu.gpudra.dev/sharing/mps/mps-7038c92eaccf", Devices: []string{"GPU-a"}},
			"--dir: the MPS pipe directory /tmp/gpu-smoke-560586586/nodes/nvml-gpu/plugins/gpu.gpudra.dev/sharing/mps/mps-7038c92eaccf/pipe is 96 bytes: " +
				"the daemon's socket control_privileged there would be 115, over the 107 a unix socket path may have: give it a shorter path"},
	}
	for _, tc := range tests {
		assert.EqualError(t, Run(context.Background(), tc.cfg), tc.want)
	}
	err := Run(context.Background(), Config{Dir: t.TempDir(), Devices: []string{"GPU-a"}, ControlBinary: "/nonexistent/nvidia-cuda-mps-control"})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "--control-binary")
}

// The daemon runs until the pod is deleted, then quits when told to.
func TestRunStartsAndQuits(t *testing.T) {
	dir := t.TempDir()
	cfg := Config{ControlBinary: standIn(t), Dir: dir, Devices: []string{"GPU-a"}}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, cfg) }()
	pidFile := filepath.Join(dir, PipeSubdir, "control.pid")
	require.Eventually(t, func() bool { _, err := os.Stat(pidFile); return err == nil }, 5*time.Second, 20*time.Millisecond)
	b, err := os.ReadFile(pidFile)
	require.NoError(t, err)
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	require.NoError(t, err)
	require.NoError(t, syscall.Kill(pid, 0), "the daemon runs")

	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after the pod was deleted")
	}
	log, err := os.ReadFile(filepath.Join(dir, LogSubdir, "control.log"))
	require.NoError(t, err)
	assert.Contains(t, string(log), "daemon start pid="+strconv.Itoa(pid)+" CUDA_VISIBLE_DEVICES=GPU-a")
	assert.Contains(t, string(log), "command quit")
	assert.Contains(t, string(log), "daemon quit", "it quit when told, it was not killed")
}

// In the foreground the real daemon logs to its stdout only (driver 580 on
// an H200): what it says goes to log/control.log too, where the node finds
// the clients it served.
func TestDaemonOutputKeptInControlLog(t *testing.T) {
	dir := t.TempDir()
	daemon := filepath.Join(t.TempDir(), "nvidia-cuda-mps-control")
	require.NoError(t, os.WriteFile(daemon, []byte("#!/bin/sh\necho 'NEW CLIENT 487 from user 0: Server already exists'\nexit 3\n"), 0o755))
	require.Error(t, Run(context.Background(), Config{ControlBinary: daemon, Dir: dir, Devices: []string{"GPU-a"}}))
	log, err := os.ReadFile(filepath.Join(dir, LogSubdir, "control.log"))
	require.NoError(t, err)
	assert.Contains(t, string(log), "NEW CLIENT 487 from user 0")
}

// A daemon that exits on its own fails the container, so that the kubelet
// restarts it.
func TestDaemonExitIsAnError(t *testing.T) {
	exits := filepath.Join(t.TempDir(), "nvidia-cuda-mps-control")
	require.NoError(t, os.WriteFile(exits, []byte("#!/bin/sh\nexit 3\n"), 0o755))
	err := Run(context.Background(), Config{ControlBinary: exits, Dir: t.TempDir(), Devices: []string{"GPU-a"}})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "the MPS control daemon exited: exit status 3")
}

// TestServerOfANonRootClientCanWrite: the real control daemon (root) starts
// each MPS server as the user of the client it serves, and that server
// writes its log, its files in the pipe directory and its shared memory
// (bottlerocket-os/bottlerocket#4673: a server of uid 1000 got EACCES and
// the client failed). The stand-in daemon here does what that server does,
// as uid 65534; each write must succeed.
func TestServerOfANonRootClientCanWrite(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the stand-in daemon starts its server as another user")
	}
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		t.Skip("needs setpriv (util-linux)")
	}
	// The server pod's mount point is reached through directories any user
	// may enter (the runtime makes them 0755).
	top := t.TempDir()
	for _, d := range []string{filepath.Dir(top), top} {
		require.NoError(t, os.Chmod(d, 0o755))
	}
	dir := filepath.Join(top, "server")
	results := filepath.Join(t.TempDir(), "results")
	daemon := filepath.Join(t.TempDir(), "nvidia-cuda-mps-control")
	script := fmt.Sprintf(`#!/bin/sh
server() {
  %s --reuid=65534 --regid=65534 --clear-groups sh -c '
    for f in "$CUDA_MPS_LOG_DIRECTORY/server.log" "$CUDA_MPS_PIPE_DIRECTORY/server-65534" "$1/shm/cuda.shm.65534"; do
      if echo x >> "$f" 2>/dev/null; then echo "ok $f"; else echo "refused $f"; fi
    done' server %q
}
server > %q
exit 3
`, setpriv, dir, results)
	require.NoError(t, os.WriteFile(daemon, []byte(script), 0o755))
	require.Error(t, Run(context.Background(), Config{ControlBinary: daemon, Dir: dir, Devices: []string{"GPU-a"}}), "the stand-in exits")
	out, err := os.ReadFile(results)
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	require.Len(t, lines, 3, "%s", out)
	for _, l := range lines {
		assert.True(t, strings.HasPrefix(l, "ok "), "the server of uid 65534 was refused: %s", l)
	}
	for _, d := range []string{PipeSubdir, LogSubdir, ShmSubdir} {
		fi, err := os.Stat(filepath.Join(dir, d))
		require.NoError(t, err)
		assert.Equal(t, os.ModeDir|os.ModeSticky|0o777, fi.Mode(), "%s: sticky, open to every user", d)
	}
}
