package main

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/local"
)

// gpudraBinary builds this command once, for tests that run it as real
// processes (gpudra local run holds GPUs for its child's life).
var gpudraBinary = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "gpudra-cli")
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "gpudra")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	if err != nil {
		return "", &buildError{out: string(out), err: err}
	}
	return bin, nil
})

type buildError struct {
	out string
	err error
}

func (e *buildError) Error() string { return e.err.Error() + ": " + e.out }

// localCmd is gpudra local SUB over a simulated DGX H100 with MIG off and
// state in dir.
func localCmd(t *testing.T, dir string, args ...string) *exec.Cmd {
	t.Helper()
	bin, err := gpudraBinary()
	require.NoError(t, err)
	full := append([]string{"local", args[0], "--backend", "sim", "--machine", "dgx-h100-nomig", "--node-name", "box",
		"--state-dir", filepath.Join(dir, "state"), "--plugin-data-dir", filepath.Join(dir, "plugin")}, args[1:]...)
	return exec.Command(bin, full...)
}

func psRows(t *testing.T, dir string) []local.PsRow {
	t.Helper()
	out, err := localCmd(t, dir, "ps", "-o", "json").Output()
	require.NoError(t, err)
	var rows []local.PsRow
	require.NoError(t, json.Unmarshal(out, &rows))
	return rows
}

func TestLocalRunTwoDisjointThenAThirdWaits(t *testing.T) {
	dir := t.TempDir()
	start := func(name string, hold string) (*exec.Cmd, *bytes.Buffer) {
		out := filepath.Join(dir, name)
		cmd := localCmd(t, dir, "run", "--gpus", "4", "--same-nvlink", "--name", name, "--",
			"sh", "-c", `echo "$CUDA_VISIBLE_DEVICES" > `+out+`; sleep `+hold)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		require.NoError(t, cmd.Start())
		return cmd, &stderr
	}
	a, _ := start("a", "2")
	b, _ := start("b", "2")
	require.Eventually(t, func() bool { return len(psRows(t, dir)) == 2 }, 10*time.Second, 50*time.Millisecond)
	c, cErr := start("c", "0")
	require.Eventually(t, func() bool { return strings.Contains(cErr.String(), "c waits, position 1") }, 10*time.Second, 50*time.Millisecond,
		"the third waits: %s", cErr)
	for _, cmd := range []*exec.Cmd{a, b, c} {
		require.NoError(t, cmd.Wait())
	}
	read := func(name string) []string {
		data, err := os.ReadFile(filepath.Join(dir, name))
		require.NoError(t, err)
		return strings.Split(strings.TrimSpace(string(data)), ",")
	}
	ga, gb, gc := read("a"), read("b"), read("c")
	require.Len(t, ga, 4)
	require.Len(t, gb, 4)
	require.Len(t, gc, 4)
	for _, u := range ga {
		assert.NotContains(t, gb, u, "a and b hold disjoint GPUs")
	}
	assert.Empty(t, psRows(t, dir), "everything released when the children exit")
}

func TestLocalRunExitCodeAndKill(t *testing.T) {
	dir := t.TempDir()
	cmd := localCmd(t, dir, "run", "--gpus", "1", "--", "sh", "-c", "exit 7")
	err := cmd.Run()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit)
	assert.Equal(t, 7, exit.ExitCode(), "the child's exit code")

	// kill -9 of the holder: its GPUs are free within a poll.
	holder := localCmd(t, dir, "run", "--gpus", "8", "--name", "big", "--", "sleep", "300")
	holder.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	require.NoError(t, holder.Start())
	t.Cleanup(func() { _ = syscall.Kill(-holder.Process.Pid, syscall.SIGKILL) })
	require.Eventually(t, func() bool {
		rows := psRows(t, dir)
		return len(rows) == 1 && rows[0].State == "Allocated"
	}, 10*time.Second, 50*time.Millisecond)
	require.NoError(t, holder.Process.Signal(syscall.SIGKILL))
	_ = holder.Wait()
	out, err := localCmd(t, dir, "run", "--gpus", "8", "--", "true").CombinedOutput()
	require.NoError(t, err, "the killed holder's 8 GPUs are free: %s", out)
}

func TestLocalRefusesWherePluginRuns(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "plugin"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "plugin", "checkpoint.json"), []byte("{}"), 0o600))
	out, err := localCmd(t, dir, "allocate", "--gpus", "1").CombinedOutput()
	require.Error(t, err)
	assert.Contains(t, string(out), "gpudra's kubelet plugin manages this machine's GPUs")
	assert.Contains(t, string(out), filepath.Join(dir, "plugin", "checkpoint.json"))
}

// Several users, each as themselves: the state directory's group decides
// who may allocate, and a user releases only their own.
func TestLocalUsersAndTheStateDirectory(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to run commands as another user")
	}
	bin, err := gpudraBinary()
	require.NoError(t, err)
	require.NoError(t, os.Chmod(filepath.Dir(bin), 0o755))
	base, err := os.MkdirTemp("", "gpudra-local-users")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(base) })
	require.NoError(t, os.Chmod(base, 0o755))
	const nobody = 65534
	as := func(uid uint32, args ...string) (string, error) {
		cmd := localCmd(t, base, args...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: nobody}}
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	state := filepath.Join(base, "state")
	// The admin's state directory, not (yet) shared with nobody's group.
	require.NoError(t, os.Mkdir(state, 0o755))
	out, err := as(0, "allocate", "--gpus", "1", "--name", "roots")
	require.NoError(t, err, out)
	out, err = as(nobody, "allocate", "--gpus", "1", "--name", "theirs")
	require.Error(t, err)
	assert.Contains(t, out, "not writable by you")

	// Shared with the group (setgid, as docs/local.md says to do).
	require.NoError(t, os.Chown(state, 0, nobody))
	require.NoError(t, os.Chmod(state, os.ModeSetgid|0o775))
	for _, f := range []string{"state.json", "state.lock"} {
		require.NoError(t, os.Chown(filepath.Join(state, f), 0, nobody))
	}
	out, err = as(nobody, "allocate", "--gpus", "1", "--name", "theirs")
	require.NoError(t, err, out)
	out, err = as(nobody, "release", "roots")
	require.Error(t, err)
	assert.Contains(t, out, "only they may release it")
	out, err = as(nobody, "release", "theirs")
	require.NoError(t, err, out)
	rows := psRows(t, base)
	require.Len(t, rows, 1)
	assert.Equal(t, "roots", rows[0].Name)
}

// An MPS run gets its GPU's daemon (the stand-in, a real process, started
// for it and stopped after it) and the client's environment.
func TestLocalRunMPS(t *testing.T) {
	dir := t.TempDir()
	control, err := filepath.Abs("../../hack/fake-nvidia-cuda-mps-control")
	require.NoError(t, err)
	out, err := localCmd(t, dir, "run", "--share", "mps", "--mps-control-binary", control, "--mps-thread-percentage", "30", "--",
		"sh", "-c", `echo "$CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"; test -p "$CUDA_MPS_PIPE_DIRECTORY/control"`).Output()
	require.NoError(t, err, "the daemon's pipe exists while the client runs: %s", out)
	fields := strings.Fields(strings.TrimSpace(string(out)))
	require.Len(t, fields, 2, string(out))
	assert.True(t, strings.HasPrefix(fields[0], filepath.Join(dir, "state", "mps")), fields[0])
	assert.Equal(t, "30", fields[1])
	_, err = os.Stat(fields[0])
	assert.True(t, os.IsNotExist(err), "the last client gone, so is the daemon's directory")

	out, err = localCmd(t, dir, "run", "--share", "mps", "--gpus", "2", "--mps-control-binary", control, "--", "true").CombinedOutput()
	require.Error(t, err)
	assert.Contains(t, string(out), "one GPU (or MIG device) per request")
}
