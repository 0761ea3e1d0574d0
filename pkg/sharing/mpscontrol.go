package sharing

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/gpudra/gpudra/pkg/drivertools"
)

// MPSControl runs nvidia-cuda-mps-control.
type MPSControl interface {
	// Start starts a control daemon in the foreground (-f), in its own
	// session so that it outlives a plugin restart, and returns its pid.
	Start(env []string) (int, error)
	// Command sends one command to the daemon whose pipe directory env
	// names, as `echo <command> | nvidia-cuda-mps-control` does.
	Command(ctx context.Context, env []string, command string) error
	// Alive says whether the process runs (a zombie does not). A daemon
	// this process started is not alive only once it has been reaped.
	Alive(pid int) bool
	// Kill kills the daemon and its process group; a daemon this process
	// started has been reaped when it returns.
	Kill(pid int) error
}

// ExecMPSControl runs nvidia-cuda-mps-control (or a stand-in in tests)
// from the driver root, through the root's own loader.
type ExecMPSControl struct {
	// Runner runs it; the zero Runner runs from "/" (directly).
	Runner drivertools.Runner
	// Path is the binary as drivertools.Runner.Path takes it: a name,
	// looked for in drivertools.ToolDirs under the driver root, a path
	// under the driver root, or an absolute path outside it (a stand-in),
	// run directly. Empty: "nvidia-cuda-mps-control".
	Path string
}

// command builds the command that runs the binary with args and env added
// to its environment.
func (e ExecMPSControl) command(ctx context.Context, env []string, args ...string) (*exec.Cmd, error) {
	tool := e.Path
	if tool == "" {
		tool = "nvidia-cuda-mps-control"
	}
	cmd, err := e.Runner.Command(ctx, tool, args...)
	if err != nil {
		return nil, err
	}
	cmd.Env = append(cmd.Env, env...)
	return cmd, nil
}

// Start starts the daemon as a child of this process, which reaps it when
// it exits (see reap): a daemon of gpudra local or of the kubelet plugin
// never stays a zombie of the process that started it. The daemon must
// stay in the foreground (-f does: the real one and the stand-in alike);
// what it forks (the real daemon's nvidia-cuda-mps-server) is in its
// session, and is reaped too where it comes to this process.
func (e ExecMPSControl) Start(env []string) (int, error) {
	// No context: the daemon outlives the call (and a plugin restart).
	cmd, err := e.command(context.Background(), env, "-f")
	if err != nil {
		return 0, err
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return 0, err
	}
	pid := cmd.Process.Pid
	d := &startedDaemon{reaped: make(chan struct{})}
	startedDaemons.Store(pid, d)
	go d.reap(cmd, pid)
	return pid, nil
}

// startedDaemons are the daemons this process started and has not yet
// reaped, by pid (*startedDaemon).
var startedDaemons sync.Map

// startedDaemon is a daemon this process started.
type startedDaemon struct {
	// reaped is closed once the daemon has been waited for, and the
	// processes of its session that came to this process when it died
	// and had already exited with it.
	reaped chan struct{}
}

// How long the daemon's session is watched, after the daemon was reaped,
// for processes that came to this process: before the daemon counts as
// reaped, and then at most in the background.
const (
	orphansFirst  = time.Second
	orphansAtMost = 30 * time.Second
)

// reap waits for the daemon, so that it is no zombie, then reaps what it
// forked that came to this process. The daemon's children (the real
// daemon's nvidia-cuda-mps-server) are in its session; when it dies before
// them, or is killed with its process group, they go to the nearest
// process that reaps orphans: this one where it is PID 1 of its container
// (the kubelet plugin) or a subreaper, else init, which reaps them. Only
// processes of the daemon's session are waited for here: any other child
// is someone else's to wait for (os/exec's Wait).
func (d *startedDaemon) reap(cmd *exec.Cmd, pid int) {
	_ = cmd.Wait()
	reapSession(pid, time.Now().Add(orphansFirst))
	startedDaemons.CompareAndDelete(pid, d)
	close(d.reaped)
	reapSession(pid, time.Now().Add(orphansAtMost))
}

// wait waits until the daemon has been reaped, at most timeout.
func (d *startedDaemon) wait(timeout time.Duration) {
	select {
	case <-d.reaped:
	case <-time.After(timeout):
	}
}

// reapSession reaps this process's children in session sid (the session
// of a daemon it started, which has been reaped) as they exit, until none
// is left in it or deadline. The session's leader is the daemon: a
// process whose pid is sid now is a later one, not the daemon's.
func reapSession(sid int, deadline time.Time) {
	for pause := 10 * time.Millisecond; ; pause = min(2*pause, 200*time.Millisecond) {
		left := false
		for _, c := range childrenOf(os.Getpid()) {
			if c.session != sid || c.pid == sid {
				continue
			}
			if c.zombie {
				// A zombie leader whose other threads still exit (the
				// real server's, tearing down its GPU context) cannot be
				// waited for yet: it is left for the next round.
				var ws syscall.WaitStatus
				if got, err := syscall.Wait4(c.pid, &ws, syscall.WNOHANG, nil); got == c.pid || errors.Is(err, syscall.ECHILD) {
					continue
				}
			}
			left = true
		}
		if !left || time.Now().After(deadline) {
			return
		}
		time.Sleep(pause)
	}
}

// child is a child process, as its /proc/<pid>/stat says.
type child struct {
	pid, session int
	zombie       bool
}

// childrenOf lists the children of process parent, from /proc.
func childrenOf(parent int) []child {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var out []child
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// The command name is in parentheses and may hold anything: the
		// fields after it start at the last ')': state, ppid, pgrp,
		// session.
		i := bytes.LastIndexByte(stat, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(stat[i+1:]))
		if len(f) < 4 {
			continue
		}
		ppid, err1 := strconv.Atoi(f[1])
		session, err2 := strconv.Atoi(f[3])
		if err1 != nil || err2 != nil || ppid != parent {
			continue
		}
		out = append(out, child{pid: pid, session: session, zombie: f[0] == "Z"})
	}
	return out
}

func (e ExecMPSControl) Command(ctx context.Context, env []string, command string) error {
	cmd, err := e.command(ctx, env)
	if err != nil {
		return err
	}
	cmd.Stdin = strings.NewReader(command + "\n")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%w: %s", err, strings.TrimSpace(out.String()))
	}
	return nil
}

func (ExecMPSControl) Alive(pid int) bool {
	if pid <= 0 {
		return false
	}
	if processRuns(pid) {
		return true
	}
	// A daemon of this process that is dying: not alive once reaped.
	if d, ok := startedDaemons.Load(pid); ok {
		d.(*startedDaemon).wait(5 * time.Second)
	}
	return false
}

// processRuns says whether process pid runs: it exists and is no zombie.
func processRuns(pid int) bool {
	if err := syscall.Kill(pid, 0); err != nil && !errors.Is(err, syscall.EPERM) {
		return false
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true // no /proc: trust kill(0)
	}
	// The state follows the command name in parentheses.
	if i := bytes.LastIndexByte(stat, ')'); i >= 0 && i+2 < len(stat) {
		return stat[i+2] != 'Z' && stat[i+2] != 'X'
	}
	return true
}

func (ExecMPSControl) Kill(pid int) error {
	_ = syscall.Kill(-pid, syscall.SIGKILL)
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return err
	}
	if d, ok := startedDaemons.Load(pid); ok {
		d.(*startedDaemon).wait(5 * time.Second)
	}
	return nil
}
