// Package mpsserver runs one MPS control daemon (nvidia-cuda-mps-control
// -f) for a set of devices, as the main process of its own pod: the MPS
// server pod that the kubelet plugin creates for a GPU when the first MPS
// claim on it is prepared, and deletes when the last one is unprepared.
//
// The daemon is a child of this process, not of the kubelet plugin, so a
// restart or an upgrade of the plugin's container leaves it running: the
// workloads keep their MPS server (docs/sharing.md).
package mpsserver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/drivertools"
)

// Layout of a server's directory, the same host directory in the server
// pod and in the plugin; the pipe and shm directories are also mounted
// into every client container.
const (
	PipeSubdir = "pipe" // CUDA_MPS_PIPE_DIRECTORY
	LogSubdir  = "log"  // CUDA_MPS_LOG_DIRECTORY
	ShmSubdir  = "shm"  // /dev/shm of the server and of its clients
)

// PrepareDirs makes a server's pipe, log and shm directories open to every
// user, sticky, as /tmp and /dev/shm are: the control daemon runs as root,
// but it starts each MPS server as the user of the client it serves
// (setuid), and that server writes its log, its files in the pipe directory
// and its shared memory there. Owned by root with mode 0755 they refused
// every client that does not run as root: its server got EACCES and exited,
// and the client failed (the field's report: an strace of the daemon under
// Bottlerocket, bottlerocket-os/bottlerocket#4673). Sticky: a user's server
// removes no other user's files. This is the server pod's (Run, as root);
// the plugin's own processes (sharing.ProcessServers: gpudra local, where a
// group shares the directories, and no server pods) keep theirs.
func PrepareDirs(dir string) error {
	const want = os.ModeSticky | 0o777
	for _, d := range []string{PipeSubdir, LogSubdir, ShmSubdir} {
		p := filepath.Join(dir, d)
		if err := os.MkdirAll(p, 0o755); err != nil {
			return fmt.Errorf("MPS server directory: %w", err)
		}
		fi, err := os.Stat(p)
		if err != nil {
			return fmt.Errorf("MPS server directory: %w", err)
		}
		if fi.Mode()&want == want {
			continue
		}
		if err := os.Chmod(p, fi.Mode()&(os.ModeSetgid|os.ModeSetuid)|want); err != nil {
			return fmt.Errorf("MPS server directory: %w", err)
		}
	}
	return nil
}

// Config is one MPS server.
type Config struct {
	// Tools runs the control daemon from the driver root, through the
	// root's own loader.
	Tools drivertools.Runner
	// ControlBinary is nvidia-cuda-mps-control as drivertools.Runner.Path
	// takes it; empty: "nvidia-cuda-mps-control".
	ControlBinary string
	// Dir is the server's directory (see the Layout constants).
	Dir string
	// Devices are the UUIDs the daemon serves (CUDA_VISIBLE_DEVICES).
	Devices []string
	// QuitTimeout is how long the daemon has to quit when asked before it
	// is killed; 0: 10 s.
	QuitTimeout time.Duration
}

// AddFlags registers the server's flags on fs (gpudra-mps-server's, or
// devcluster's stand-in for its container) and returns the Config they fill
// in.
func AddFlags(fs *pflag.FlagSet) *Config {
	cfg := &Config{}
	fs.StringVar(&cfg.Tools.Root, "driver-root", "/driver-root", "where the NVIDIA driver is installed, as this container sees it")
	fs.StringVar(&cfg.ControlBinary, "control-binary", "", "nvidia-cuda-mps-control: a path under the driver root, or an absolute path outside it (default usr/bin/nvidia-cuda-mps-control)")
	fs.StringVar(&cfg.Dir, "dir", "", "the server's directory: pipe/, log/ and shm/ are under it")
	fs.Func("devices", "comma-separated UUIDs of the devices the server serves", func(s string) error {
		for _, d := range strings.Split(s, ",") {
			if d = strings.TrimSpace(d); d != "" {
				cfg.Devices = append(cfg.Devices, d)
			}
		}
		return nil
	})
	return cfg
}

// Env is the environment of the control daemon and of control clients
// (nvidia-cuda-mps-control without -f) that talk to it.
func (c Config) Env() []string {
	return []string{
		"CUDA_MPS_PIPE_DIRECTORY=" + filepath.Join(c.Dir, PipeSubdir),
		"CUDA_MPS_LOG_DIRECTORY=" + filepath.Join(c.Dir, LogSubdir),
		"CUDA_VISIBLE_DEVICES=" + strings.Join(c.Devices, ","),
	}
}

// MaxSocketPath is the longest path a unix socket may have (sun_path is 108
// bytes with its terminating NUL).
const MaxSocketPath = 107

// LongestSocket is the longest name of the sockets the control daemon makes
// in its pipe directory (control, control_privileged; driver 580 on an
// H200). A pipe directory too long for it makes the daemon exit at once,
// status 1, with nothing said (testdata/real-gpus/h200).
const LongestSocket = "control_privileged"

// CheckPipeDir says why the daemon's sockets would not fit under the pipe
// directory, or nil when they do.
func CheckPipeDir(pipeDir string) error {
	if n := len(pipeDir) + 1 + len(LongestSocket); n > MaxSocketPath {
		return fmt.Errorf("the MPS pipe directory %s is %d bytes: the daemon's socket %s there would be %d, over the %d a unix socket path may have",
			pipeDir, len(pipeDir), LongestSocket, n, MaxSocketPath)
	}
	return nil
}

func (c Config) validate() error {
	var errs []error
	if c.Dir == "" {
		errs = append(errs, errors.New("--dir: required"))
	} else if !filepath.IsAbs(c.Dir) {
		errs = append(errs, fmt.Errorf("--dir: %q is not an absolute path", c.Dir))
	} else if err := CheckPipeDir(filepath.Join(c.Dir, PipeSubdir)); err != nil {
		errs = append(errs, fmt.Errorf("--dir: %w: give it a shorter path", err))
	}
	if len(c.Devices) == 0 {
		errs = append(errs, errors.New("--devices: at least one device UUID is required"))
	}
	return errors.Join(errs...)
}

func (c Config) binary() string {
	if c.ControlBinary == "" {
		return "nvidia-cuda-mps-control"
	}
	return c.ControlBinary
}

// Run starts the control daemon and waits. When ctx ends (the pod is
// deleted: SIGTERM) the daemon is told to quit, and killed with its
// process group if it does not within QuitTimeout. A daemon that exits on
// its own is an error: the kubelet restarts the container.
func Run(ctx context.Context, cfg Config) error {
	if err := cfg.validate(); err != nil {
		return err
	}
	logger := klog.FromContext(ctx).WithValues("devices", cfg.Devices)
	if err := PrepareDirs(cfg.Dir); err != nil {
		return err
	}
	// Not ctx: the daemon is stopped by "quit", not by a signal.
	cmd, err := cfg.Tools.Command(context.Background(), cfg.binary(), "-f")
	if err != nil {
		return fmt.Errorf("--control-binary: %w", err)
	}
	cmd.Env = append(cmd.Env, cfg.Env()...)
	if p, err := cfg.Tools.Find(cfg.binary()); err == nil {
		// The daemon starts nvidia-cuda-mps-server by name: from its own
		// directory, with the driver's libraries.
		cmd.Env = append(cmd.Env, cfg.Tools.ChildEnv(p)...)
	}
	// In the foreground (-f) the daemon logs to its stdout, not to
	// control.log: its output goes to the container's log and, as the
	// daemon itself writes it with -d, to log/control.log, where the node
	// (gpu-smoke, a person on the host) finds the clients it served.
	logFile, err := os.OpenFile(filepath.Join(cfg.Dir, LogSubdir, "control.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("the MPS control daemon's log: %w", err)
	}
	defer logFile.Close()
	out := io.MultiWriter(os.Stderr, logFile)
	cmd.Stdout, cmd.Stderr = out, out
	// Its own process group: the control daemon's server children go with
	// it when it has to be killed.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start the MPS control daemon: %w", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	logger.Info("MPS control daemon started", "pid", cmd.Process.Pid, "dir", cfg.Dir)

	select {
	case err := <-exited:
		return fmt.Errorf("the MPS control daemon exited: %v", err)
	case <-ctx.Done():
	}
	logger.Info("Stopping the MPS control daemon", "pid", cmd.Process.Pid)
	if err := quit(cfg); err != nil {
		logger.Info("MPS control quit failed; the daemon is killed if it does not exit", "err", err)
	}
	timeout := cfg.QuitTimeout
	if timeout == 0 {
		timeout = 10 * time.Second
	}
	select {
	case <-exited:
		return nil
	case <-time.After(timeout):
	}
	logger.Info("MPS control daemon did not quit; killing it", "pid", cmd.Process.Pid, "timeout", timeout)
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	<-exited
	return nil
}

// quit sends "quit" to the daemon as a control client.
func quit(cfg Config) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	cmd, err := cfg.Tools.Command(ctx, cfg.binary())
	if err != nil {
		return err
	}
	cmd.Env = append(cmd.Env, cfg.Env()...)
	cmd.Stdin = strings.NewReader("quit\n")
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%w: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}
