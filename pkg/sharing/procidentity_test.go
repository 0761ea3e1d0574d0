package sharing

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/prepared"
)

// foreignProcess is a process that is not an MPS daemon, standing for one
// that reuses a recorded pid (recycled, or in a new PID namespace).
func foreignProcess(t *testing.T) int {
	t.Helper()
	cmd := exec.Command("sleep", "60")
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	return cmd.Process.Pid
}

func alive(pid int) bool { return (ExecMPSControl{}).Alive(pid) }

// TestRecycledPIDIsNeitherAdoptedNorKilled: the pid file of a prepared MPS
// claim names a process that is not its daemon. Resume must start a daemon
// for the claim instead of adopting that process, and the sweep of an
// unknown claim must not kill it.
func TestRecycledPIDIsNeitherAdoptedNorKilled(t *testing.T) {
	for _, format := range []string{"bare pid (older release)", "identity of another process"} {
		t.Run(format, func(t *testing.T) {
			root := t.TempDir()
			m, err := NewManager(Options{Root: root, MPSControl: ExecMPSControl{Path: standIn(t)}})
			require.NoError(t, err)
			ctx := context.Background()
			kept := shareClaim("kept", "GPU-0", 20)
			// The claim's server, and an earlier release's per-claim
			// directory of a claim that is not prepared.
			for _, dir := range []string{serverOf(root, kept).Dir, filepath.Join(MPSRoot(root), "unknown-claim")} {
				require.NoError(t, os.MkdirAll(filepath.Join(dir, "pipe"), 0o755))
				pid := foreignProcess(t)
				content := []byte(itoa(pid))
				if format != "bare pid (older release)" {
					id, err := readProcIdentity("/proc", pid)
					require.NoError(t, err)
					id.StartTime++ // the pid's process started at another time: not the daemon
					content, err = json.Marshal(id)
					require.NoError(t, err)
				}
				require.NoError(t, os.WriteFile(filepath.Join(dir, "daemon.pid"), content, 0o644))
				defer func(pid int) { assert.True(t, alive(pid), "foreign process %d of %s survives", pid, dir) }(pid)
			}
			require.NoError(t, m.Resume(ctx, []prepared.Claim{kept}))
			daemon, err := RecordedDaemonPID(serverOf(root, kept).Dir)
			require.NoError(t, err)
			id, err := readProcIdentity("/proc", daemon)
			require.NoError(t, err)
			assert.Contains(t, id.Cmdline, "fake-nvidia-cuda-mps-control", "a real daemon was started for the claim, not the foreign process adopted")
			require.NoError(t, m.Unprepare(ctx, kept, nil))
			assert.Eventually(t, func() bool { return !alive(daemon) }, 5*time.Second, 20*time.Millisecond, "the claim's own daemon is stopped at unprepare")
			assert.NoDirExists(t, filepath.Join(MPSRoot(root), "unknown-claim"))
		})
	}
}

func TestProcIdentityOfThisProcess(t *testing.T) {
	id, err := readProcIdentity("/proc", os.Getpid())
	require.NoError(t, err)
	assert.NotZero(t, id.StartTime)
	assert.Contains(t, id.Cmdline, filepath.Base(os.Args[0]))
	again, err := readProcIdentity("/proc", os.Getpid())
	require.NoError(t, err)
	assert.Equal(t, id, again)
	_, err = readProcIdentity("/proc", 1<<30)
	assert.Error(t, err)
}
