package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/local"
)

// finish waits for cmd at most timeout, then kills it and fails. Its
// output must go to files, not buffers: an MPS daemon it started keeps
// its descriptors after it exits.
func finish(t *testing.T, cmd *exec.Cmd, timeout time.Duration) error {
	t.Helper()
	cmd.WaitDelay = time.Second
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		return err
	case <-time.After(timeout):
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("%v still runs after %v", cmd.Args, timeout)
		return nil
	}
}

// outputFile is a file for a command's output, and a reader of it.
func outputFile(t *testing.T) (*os.File, func() string) {
	t.Helper()
	f, err := os.CreateTemp(t.TempDir(), "out")
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	return f, func() string { b, _ := os.ReadFile(f.Name()); return string(b) }
}

// A grant that fails (here the MPS control daemon cannot start) fails
// run and allocate with its error, at once, instead of waiting for ever.
func TestLocalFailedGrantIsReported(t *testing.T) {
	dir := t.TempDir()
	missing := filepath.Join(dir, "no-such-mps-control")
	for _, args := range [][]string{
		{"run", "--share", "mps", "--mps-control-binary", missing, "--name", "r", "--", "true"},
		{"allocate", "--share", "mps", "--mps-control-binary", missing, "--name", "a"},
	} {
		cmd := localCmd(t, dir, args...)
		f, out := outputFile(t)
		cmd.Stdout, cmd.Stderr = f, f
		require.NoError(t, cmd.Start())
		err := finish(t, cmd, 30*time.Second)
		require.Error(t, err, "%s: %s", args[0], out())
		assert.Contains(t, out(), "failed: granting it failed: MPS server for GPU-", args[0])
		assert.Contains(t, out(), "no-such-mps-control", args[0])
	}
	assert.Empty(t, psRows(t, dir), "the failed requests were withdrawn")
}

// ps shows a failed request with its error.
func TestPsShowsAFailedRequest(t *testing.T) {
	var b bytes.Buffer
	require.NoError(t, printPs(&b, []local.PsRow{{Name: "x", User: "bob", State: "Failed", Error: "boom", Asks: "1 device(s)"}}, "table"))
	assert.Contains(t, b.String(), "failed: boom")
}

// Two users of the state directory's group (each with another primary
// group), umask 022: the second shares the MPS daemon the first one's
// command started (its pipe usable), and when the first has gone, the
// second's release stops the daemon and removes its directory.
func TestLocalMPSAcrossUsersOfOneGroup(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to run commands as two other users")
	}
	defer syscall.Umask(syscall.Umask(0o022))
	control, err := filepath.Abs("../../hack/fake-nvidia-cuda-mps-control")
	require.NoError(t, err)
	bin, err := gpudraBinary()
	require.NoError(t, err)
	require.NoError(t, os.Chmod(filepath.Dir(bin), 0o755))
	base, err := os.MkdirTemp("", "gpudra-local-mps-users")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(base) })
	require.NoError(t, os.Chmod(base, 0o755))
	// alice and bob run a copy of the stand-in: the checkout may sit
	// under a directory only its owner can enter (/root, a 0700 home).
	script, err := os.ReadFile(control)
	require.NoError(t, err)
	control = filepath.Join(base, "nvidia-cuda-mps-control")
	require.NoError(t, os.WriteFile(control, script, 0o755)) //nolint:gosec // an executable for other users
	const gpuGroup, alice, bob = 61000, 61001, 61002
	state, sig := filepath.Join(base, "state"), filepath.Join(base, "signals")
	require.NoError(t, os.Mkdir(state, 0o755))
	require.NoError(t, os.Chown(state, 0, gpuGroup))
	require.NoError(t, os.Chmod(state, os.ModeSetgid|0o775))
	require.NoError(t, os.Mkdir(sig, 0o777))
	require.NoError(t, os.Chmod(sig, 0o777))
	as := func(uid uint32, script string) (*exec.Cmd, func() string, chan struct{}) {
		cmd := localCmd(t, base, "run", "--share", "mps", "--mps-control-binary", control, "--", "sh", "-c", script)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid, Groups: []uint32{gpuGroup}}}
		f, out := outputFile(t)
		cmd.Stdout, cmd.Stderr = f, f
		require.NoError(t, cmd.Start())
		t.Cleanup(func() { _ = cmd.Process.Kill() })
		exited := make(chan struct{})
		go func() {
			// Looks without reaping (finish waits for it): gone or a zombie.
			for {
				if _, err := os.Stat(filepath.Join("/proc", strconv.Itoa(cmd.Process.Pid), "cmdline")); err != nil || zombie(cmd.Process.Pid) {
					close(exited)
					return
				}
				time.Sleep(50 * time.Millisecond)
			}
		}()
		return cmd, out, exited
	}
	signal := func(name string) string { return filepath.Join(sig, name) }
	waitFor := func(name string) string {
		return `while [ ! -e ` + signal(name) + ` ]; do sleep 0.05; done`
	}
	first, firstOut, firstExited := as(alice, waitFor("bob-usable"))
	require.Eventually(t, func() bool {
		rows := psRows(t, base)
		return len(rows) == 1 && rows[0].State == "Allocated"
	}, 20*time.Second, 50*time.Millisecond, "alice's MPS run holds the GPU: %s", firstOut())
	second, secondOut, secondExited := as(bob, `p="$CUDA_MPS_PIPE_DIRECTORY"; test -p "$p/control" && test -w "$p/control" || { ls -la "$p"; exit 1; }; touch `+
		signal("bob-usable")+` && `+waitFor("alice-done"))
	require.Eventually(t, func() bool {
		select {
		case <-secondExited:
			return true
		case <-firstExited:
			return true
		default:
			_, err := os.Stat(signal("bob-usable"))
			return err == nil
		}
	}, 30*time.Second, 50*time.Millisecond)
	_, err = os.Stat(signal("bob-usable"))
	require.NoError(t, err, "bob's client could not use the daemon alice's command started: %s", secondOut())
	require.NoError(t, finish(t, first, 30*time.Second), "alice: %s", firstOut())
	require.NoError(t, os.WriteFile(signal("alice-done"), nil, 0o644))
	require.NoError(t, finish(t, second, 30*time.Second), "bob: %s", secondOut())

	mps := filepath.Join(state, "mps")
	fi, err := os.Stat(mps)
	require.NoError(t, err)
	assert.Equal(t, os.ModeSetgid|0o775, fi.Mode()&(os.ModeSetgid|0o777), "the MPS directory is the group's, as the state directory is")
	left, err := os.ReadDir(mps)
	require.NoError(t, err)
	assert.Empty(t, left, "bob, the last client, stopped the daemon alice's command started and removed its directory")
	assert.Empty(t, psRows(t, base))
}

// zombie says whether process pid has exited and waits to be reaped.
func zombie(pid int) bool {
	stat, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return true
	}
	i := strings.LastIndexByte(string(stat), ')')
	return i > 0 && i+2 < len(stat) && stat[i+2] == 'Z'
}

// TestLocalUsersCannotChangeAnothersAllocation (issue 47): bob, a member
// of the state directory's group, can neither release alice's allocation
// through the CLI nor rewrite, remove or move any file that records it;
// alice's allocation stays, and bob is handed other GPUs than hers.
func TestLocalUsersCannotChangeAnothersAllocation(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to run commands as two other users")
	}
	defer syscall.Umask(syscall.Umask(0o002))
	bin, err := gpudraBinary()
	require.NoError(t, err)
	require.NoError(t, os.Chmod(filepath.Dir(bin), 0o755))
	base, err := os.MkdirTemp("", "gpudra-local-owners")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(base) })
	require.NoError(t, os.Chmod(base, 0o755))
	const gpuGroup, alice, bob = 61010, 61011, 61012
	state := filepath.Join(base, "state")
	// Shared with the group, as docs/local.md says to do.
	require.NoError(t, os.Mkdir(state, 0o755))
	require.NoError(t, os.Chown(state, 0, gpuGroup))
	require.NoError(t, os.Chmod(state, os.ModeSetgid|0o775))
	as := func(uid uint32, cmd *exec.Cmd) (string, error) {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid, Groups: []uint32{gpuGroup}}}
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	held := func() []string {
		for _, r := range psRows(t, base) {
			if r.Name == "held" {
				return r.UUIDs
			}
		}
		return nil
	}

	out, err := as(alice, localCmd(t, base, "allocate", "--gpus", "4", "--name", "held"))
	require.NoError(t, err, out)
	alices := held()
	require.Len(t, alices, 4)

	out, err = as(bob, localCmd(t, base, "release", "held"))
	require.Error(t, err, "bob released alice's allocation: %s", out)
	assert.Contains(t, out, "only they may release it")

	// Every file that records alice's allocation, and its directory.
	var files []string
	require.NoError(t, filepath.WalkDir(state, func(path string, d os.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		if b, err := os.ReadFile(path); err == nil && bytes.Contains(b, []byte(`"held"`)) {
			files = append(files, path)
		}
		return nil
	}))
	require.NotEmpty(t, files, "no file records alice's allocation")
	for _, f := range files {
		for _, attempt := range []struct{ what, script string }{
			{"rewrite", `printf '{}' > "$1"`},
			{"append to", `printf ' ' >> "$1"`},
			{"remove", `rm -f "$1" && test ! -e "$1"`},
			{"rename", `mv "$1" "$1.bob"`},
			{"replace", `printf '{}' > "$(dirname "$1")/.bob" && mv "$(dirname "$1")/.bob" "$1"`},
		} {
			out, err := as(bob, exec.Command("sh", "-c", attempt.script, "sh", f))
			assert.Error(t, err, "bob could %s %s: %s", attempt.what, f, out)
		}
		if dir := filepath.Dir(f); dir != state {
			out, err := as(bob, exec.Command("rm", "-rf", dir))
			assert.Error(t, err, "bob could remove %s: %s", dir, out)
			out, err = as(bob, exec.Command("mv", dir, filepath.Join(base, "elsewhere")))
			assert.Error(t, err, "bob could move %s out of the state directory: %s", dir, out)
			// A rename in place is the group's right on the directory (no
			// sticky bit): it hides nothing, entries are found by owner.
			_, _ = as(bob, exec.Command("mv", dir, dir+".bob"))
		}
	}
	assert.Equal(t, alices, held(), "alice's allocation stays, on her GPUs")

	out, err = as(bob, localCmd(t, base, "allocate", "--gpus", "4", "--name", "bobs"))
	require.NoError(t, err, out)
	rows := psRows(t, base)
	require.Len(t, rows, 2)
	for _, r := range rows {
		if r.Name == "bobs" {
			require.Len(t, r.UUIDs, 4)
			for _, u := range r.UUIDs {
				assert.NotContains(t, alices, u, "bob was handed one of alice's GPUs")
			}
		}
	}
	out, err = as(alice, localCmd(t, base, "release", "held"))
	require.NoError(t, err, out)
	assert.Nil(t, held(), "alice releases her own")
}
