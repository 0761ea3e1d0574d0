package sharing

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"

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
	// Alive says whether the process runs (a zombie does not).
	Alive(pid int) bool
	// Kill kills the daemon and its process group.
	Kill(pid int) error
}

// ExecMPSControl runs nvidia-cuda-mps-control (or a stand-in in tests)
// from the driver root, through the root's own loader.
type ExecMPSControl struct {
	// Runner runs it; the zero Runner runs from "/" (directly).
	Runner drivertools.Runner
	// Path is the binary as drivertools.Runner.Path takes it: a name in
	// usr/bin under the driver root, a path under the driver root, or an
	// absolute path outside it (a stand-in), run directly. Empty:
	// "nvidia-cuda-mps-control".
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
	// Reap it when it exits, so that a dead daemon is not a zombie that
	// looks alive.
	go func() { _ = cmd.Wait() }()
	return cmd.Process.Pid, nil
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
	return nil
}
