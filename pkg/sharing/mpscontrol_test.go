package sharing

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/drivertools"
)

// nvidia-cuda-mps-control found in usr/bin under a driver root (and in
// usr/local/nvidia/bin, where hosts with the driver under /usr/local/nvidia
// have it), with an
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

	// The same daemon from usr/local/nvidia/bin.
	nvidiaRoot := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(nvidiaRoot, "usr/local/nvidia/bin"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(nvidiaRoot, "usr/local/nvidia/bin/nvidia-cuda-mps-control"), b, 0o755))
	control = ExecMPSControl{Runner: drivertools.Runner{Root: nvidiaRoot}}
	pipe = t.TempDir()
	env = []string{"CUDA_MPS_PIPE_DIRECTORY=" + pipe, "CUDA_VISIBLE_DEVICES=GPU-0"}
	pid, err = control.Start(env)
	require.NoError(t, err)
	t.Cleanup(func() { _ = control.Kill(pid) })
	require.Eventually(t, func() bool { return control.Command(context.Background(), env, "get_server_list") == nil }, 5*time.Second, 10*time.Millisecond)
	require.NoError(t, control.Kill(pid))
	assert.False(t, control.Alive(pid))

	missing := ExecMPSControl{Runner: drivertools.Runner{Root: t.TempDir()}}
	_, err = missing.Start(env)
	assert.ErrorContains(t, err, "driver tool nvidia-cuda-mps-control: not found under driver root ")
	assert.ErrorContains(t, err, filepath.Join(missing.Runner.Root, "usr/local/nvidia/bin/nvidia-cuda-mps-control"), "every place looked at")
	assert.ErrorContains(t, missing.Command(context.Background(), env, "quit"), "driver tool nvidia-cuda-mps-control: not found under driver root ")
}

// zombieChildren are this process's children in state Z.
func zombieChildren() []int {
	var out []int
	for _, c := range childrenOf(os.Getpid()) {
		if c.zombie {
			out = append(out, c.pid)
		}
	}
	return out
}

// inSession are this process's children in session sid.
func inSession(sid int) []int {
	var out []int
	for _, c := range childrenOf(os.Getpid()) {
		if c.session == sid {
			out = append(out, c.pid)
		}
	}
	return out
}

// setSubreaper makes this process reap orphans of its descendants, as the
// kubelet plugin does as PID 1 of its container, for the test.
func setSubreaper(t *testing.T) {
	const prSetChildSubreaper = 36
	if _, _, e := syscall.RawSyscall(syscall.SYS_PRCTL, prSetChildSubreaper, 1, 0); e != 0 {
		t.Skipf("prctl(PR_SET_CHILD_SUBREAPER): %v", e)
	}
	t.Cleanup(func() { _, _, _ = syscall.RawSyscall(syscall.SYS_PRCTL, prSetChildSubreaper, 0, 0) })
}

// Every MPS control daemon started the way gpudra local and the kubelet
// plugin start one (ProcessServers over ExecMPSControl) is reaped when it
// is stopped: told to quit, or killed. So are the processes it forked
// (the real daemon's nvidia-cuda-mps-server, in its session), which come
// to this process when it reaps orphans (PID 1 of a container, here a
// subreaper): no child of this process is left a zombie.
func TestStartedDaemonsAreReaped(t *testing.T) {
	setSubreaper(t)
	before := zombieChildren()
	// A daemon like the real one: it forks a server into its session. One
	// server exits a moment after the daemon (it outlives it), the other
	// only goes with the daemon's process group.
	wrapper := func(server string) string {
		p := filepath.Join(t.TempDir(), "nvidia-cuda-mps-control")
		require.NoError(t, os.WriteFile(p, []byte("#!/bin/sh\nif [ \"${1:-}\" = -f ]; then\n  daemon=$$\n  "+server+" &\nfi\nexec "+standIn(t)+" \"$@\"\n"), 0o755))
		return p
	}
	linger := wrapper(`( while kill -0 "$daemon" 2>/dev/null; do sleep 0.05; done; sleep 0.2 )`)
	busy := wrapper(`( exec sleep 300 )`)
	// The real server, killed while it tears down its GPU context: its main
	// thread is a zombie while its other threads still exit, and cannot
	// be waited for until they have (seen on an H100).
	threads := ""
	if threadedServer := buildThreadedServer(t); threadedServer != "" {
		threads = wrapper(`( while kill -0 "$daemon" 2>/dev/null; do sleep 0.05; done; exec ` + threadedServer + ` )`)
	}
	for _, tc := range []struct {
		name    string
		control string
		kill    bool
		server  bool
	}{
		{name: "stand-in, told to quit", control: standIn(t)},
		{name: "stand-in, killed", control: standIn(t), kill: true},
		{name: "a daemon whose server outlives it, told to quit", control: linger, server: true},
		{name: "a daemon killed with its server", control: busy, kill: true, server: true},
		{name: "a daemon whose server's threads outlive its main thread", control: threads, server: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.control == "" {
				t.Skip("gcc is not installed: it builds the threaded server")
			}
			control := ExecMPSControl{Path: tc.control}
			servers := &ProcessServers{Root: t.TempDir(), Control: control}
			s := MPSServerFor(servers.Root, []string{"GPU-0"})
			ctx := context.Background()
			started, err := servers.Ensure(ctx, s)
			require.NoError(t, err)
			require.True(t, started)
			pid, err := RecordedDaemonPID(s.Dir)
			require.NoError(t, err)
			t.Cleanup(func() { _ = control.Kill(pid) })
			env := s.Config().Env()
			require.Eventually(t, func() bool { return control.Command(ctx, env, "get_server_list") == nil }, 5*time.Second, 10*time.Millisecond)
			if tc.server {
				require.Eventually(t, func() bool { return len(childrenOf(pid)) > 0 }, 5*time.Second, 10*time.Millisecond, "the daemon's server")
			}

			if tc.kill {
				require.NoError(t, control.Kill(pid))
			} else {
				require.NoError(t, servers.Stop(ctx, s))
				assert.Contains(t, controlLog(t, s), "daemon quit pid="+strconv.Itoa(pid), "it quit, not killed")
			}
			assert.NotContains(t, zombieChildren(), pid, "the daemon is reaped when Stop (or Kill) returns")
			assert.False(t, control.Alive(pid))
			assert.Eventually(t, func() bool {
				return len(inSession(pid)) == 0 && len(slices.DeleteFunc(zombieChildren(), func(z int) bool { return slices.Contains(before, z) })) == 0
			}, 5*time.Second, 20*time.Millisecond, "no child left a zombie: in the daemon's session %v, zombies %v (before the test %v)", inSession(pid), zombieChildren(), before)
		})
	}
}

// threadedServerSource exits its main thread at once and its process 0.5 s
// later, from another thread: for that time the process is a zombie (its
// leader's state) that wait4 cannot reap yet.
const threadedServerSource = `
#include <pthread.h>
#include <unistd.h>
static void *linger(void *arg) { (void)arg; usleep(500000); _exit(0); }
int main(void) {
	pthread_t t;
	pthread_create(&t, NULL, linger, NULL);
	pthread_exit(NULL);
}
`

// buildThreadedServer builds threadedServerSource; "" without gcc.
func buildThreadedServer(t *testing.T) string {
	t.Helper()
	if _, err := exec.LookPath("gcc"); err != nil {
		return ""
	}
	dir := t.TempDir()
	src := filepath.Join(dir, "server.c")
	require.NoError(t, os.WriteFile(src, []byte(threadedServerSource), 0o644))
	out := filepath.Join(dir, "nvidia-cuda-mps-server")
	b, err := exec.Command("gcc", "-O", "-pthread", "-o", out, src).CombinedOutput()
	require.NoError(t, err, "%s", b)
	return out
}
