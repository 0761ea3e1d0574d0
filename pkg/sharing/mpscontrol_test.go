package sharing

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/drivertools"
)

// nvidia-cuda-mps-control found in usr/bin under a driver root, with an
// inherited LD_LIBRARY_PATH stripped: Start, Command, Alive and Kill work as
// with a plain path.
func TestExecMPSControlFromTheDriverRoot(t *testing.T) {
	root := t.TempDir()
	b, err := os.ReadFile(standIn(t))
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(filepath.Join(root, "usr/bin"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(root, "usr/bin/nvidia-cuda-mps-control"), b, 0o755))
	t.Setenv("LD_LIBRARY_PATH", filepath.Join(root, "usr/lib64"))

	control := ExecMPSControl{Runner: drivertools.Runner{Root: root}}
	pipe := t.TempDir()
	env := []string{"CUDA_MPS_PIPE_DIRECTORY=" + pipe, "CUDA_VISIBLE_DEVICES=GPU-0"}
	pid, err := control.Start(env)
	require.NoError(t, err)
	t.Cleanup(func() { _ = control.Kill(pid) })
	assert.True(t, control.Alive(pid))
	require.Eventually(t, func() bool { _, err := os.Stat(filepath.Join(pipe, "control.pid")); return err == nil }, 5*time.Second, 10*time.Millisecond)
	require.NoError(t, control.Command(context.Background(), env, "set_default_active_thread_percentage 50"))
	log, err := os.ReadFile(filepath.Join(pipe, "control.log"))
	require.NoError(t, err)
	assert.Equal(t, "daemon start pid="+strconv.Itoa(pid)+" CUDA_VISIBLE_DEVICES=GPU-0\ncommand set_default_active_thread_percentage 50\n", string(log))
	require.NoError(t, control.Kill(pid))
	assert.Eventually(t, func() bool { return !control.Alive(pid) }, 5*time.Second, 10*time.Millisecond)

	missing := ExecMPSControl{Runner: drivertools.Runner{Root: t.TempDir()}}
	_, err = missing.Start(env)
	assert.ErrorContains(t, err, "driver tool nvidia-cuda-mps-control: not found at ")
	assert.ErrorContains(t, missing.Command(context.Background(), env, "quit"), "driver tool nvidia-cuda-mps-control: not found at ")
}
