package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The stand-ins under test, by name: the Go port, built for the test, and
// the bash script it ports.
const (
	goImpl   = "go"
	bashImpl = "bash"
)

// binaries builds the port into a temporary directory and finds the
// script; the script's path is "" where bash, flock or mkfifo is missing.
func binaries(t *testing.T) map[string]string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "fake-mps-control")
	build := exec.Command("go", "build", "-o", bin, ".")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "go build: %s", out)
	script, err := filepath.Abs("../../../hack/fake-nvidia-cuda-mps-control")
	require.NoError(t, err)
	require.FileExists(t, script)
	for _, tool := range []string{"bash", "flock", "mkfifo"} {
		if _, err := exec.LookPath(tool); err != nil {
			script = ""
		}
	}
	return map[string]string{goImpl: bin, bashImpl: script}
}

// pick is the path of the named implementation, or skips the test.
func pick(t *testing.T, bins map[string]string, name string) string {
	t.Helper()
	if bins[name] == "" {
		t.Skip("bash, flock or mkfifo is missing: the script cannot run here")
	}
	return bins[name]
}

// environ is this process's environment without CUDA_* variables, plus extra.
func environ(extra ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "CUDA_") {
			env = append(env, kv)
		}
	}
	return append(env, extra...)
}

// run runs path to its end and returns its stderr and exit status.
func run(t *testing.T, path string, env []string, stdin string, args ...string) (string, int) {
	t.Helper()
	cmd := exec.Command(path, args...)
	cmd.Env = env
	cmd.Stdin = strings.NewReader(stdin)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		return stderr.String(), exitCode(t, err)
	case <-time.After(20 * time.Second):
		_ = cmd.Process.Kill()
		<-done
		require.FailNow(t, "did not finish", "%s %v", path, args)
		return "", 0
	}
}

func exitCode(t *testing.T, err error) int {
	t.Helper()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		return exit.ExitCode()
	}
	require.NoError(t, err)
	return 0
}

type runningDaemon struct {
	cmd    *exec.Cmd
	stderr bytes.Buffer
	done   chan struct{}
	err    error
}

// startDaemon starts path -f; the test's cleanup kills it if it still runs.
func startDaemon(t *testing.T, path string, env []string) *runningDaemon {
	t.Helper()
	d := &runningDaemon{cmd: exec.Command(path, "-f"), done: make(chan struct{})}
	d.cmd.Env = env
	d.cmd.Stderr = &d.stderr
	require.NoError(t, d.cmd.Start())
	go func() { d.err = d.cmd.Wait(); close(d.done) }()
	t.Cleanup(func() {
		select {
		case <-d.done:
		default:
			_ = d.cmd.Process.Kill()
			<-d.done
		}
	})
	return d
}

// wait waits for the daemon to exit and returns its exit status and stderr.
func (d *runningDaemon) wait(t *testing.T) (int, string) {
	t.Helper()
	select {
	case <-d.done:
		return exitCode(t, d.err), d.stderr.String()
	case <-time.After(10 * time.Second):
		require.FailNow(t, "the daemon did not exit")
		return 0, ""
	}
}

// poll calls cond every 10 ms, in the test's goroutine, until it holds or
// 10 s have passed; it fails the test then.
func poll(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			require.FailNow(t, "timed out waiting: "+what)
		}
	}
}

// ready waits for the daemon to write control.pid, which it does once its
// FIFO is open, and returns the pid it wrote: its own.
func (d *runningDaemon) ready(t *testing.T, pipe string) int {
	t.Helper()
	var pid string
	poll(t, "control.pid", func() bool {
		select {
		case <-d.done:
			require.FailNow(t, "the daemon exited", "%v: %s", d.err, d.stderr.String())
		default:
		}
		b, err := os.ReadFile(filepath.Join(pipe, "control.pid"))
		pid = string(b)
		return err == nil && strings.HasSuffix(pid, "\n")
	})
	assert.Equal(t, strconv.Itoa(d.cmd.Process.Pid)+"\n", pid, "control.pid is the daemon's pid")
	return d.cmd.Process.Pid
}

// inLoop waits until the daemon has read a line from its FIFO: it is past
// setting its trap then, in its loop.
func inLoop(t *testing.T, pipe string) {
	t.Helper()
	fifo, err := os.OpenFile(filepath.Join(pipe, "control"), os.O_RDWR, 0)
	require.NoError(t, err)
	defer fifo.Close()
	_, err = fifo.WriteString("noop\n")
	require.NoError(t, err)
	raw, err := fifo.SyscallConn()
	require.NoError(t, err)
	poll(t, "the daemon to read its FIFO", func() bool {
		var unread int32
		var errno syscall.Errno
		require.NoError(t, raw.Control(func(fd uintptr) {
			_, _, errno = syscall.Syscall(syscall.SYS_IOCTL, fd, syscall.TIOCINQ, uintptr(unsafe.Pointer(&unread)))
		}))
		require.Zero(t, errno)
		return unread == 0
	})
}

// A daemon and a client of either implementation serve each other exactly
// as two of the script do.
func TestDaemonAndClient(t *testing.T) {
	bins := binaries(t)
	tests := []struct {
		name, daemon, client string
		// logInPipe leaves CUDA_MPS_LOG_DIRECTORY unset: the log is then
		// in the pipe directory.
		logInPipe bool
	}{
		{name: "go", daemon: goImpl, client: goImpl},
		{name: "bash", daemon: bashImpl, client: bashImpl},
		{name: "go daemon, bash client", daemon: goImpl, client: bashImpl, logInPipe: true},
		{name: "bash daemon, go client", daemon: bashImpl, client: goImpl, logInPipe: true},
		{name: "go, log in pipe directory", daemon: goImpl, client: goImpl, logInPipe: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			daemonBin, clientBin := pick(t, bins, tc.daemon), pick(t, bins, tc.client)
			pipe := t.TempDir()
			env := environ("CUDA_MPS_PIPE_DIRECTORY=" + pipe)
			logPath := filepath.Join(pipe, "control.log")
			if !tc.logInPipe {
				logDir := t.TempDir()
				env = append(env, "CUDA_MPS_LOG_DIRECTORY="+logDir)
				logPath = filepath.Join(logDir, "control.log")
			}

			stderr, code := run(t, clientBin, env, "quit\n")
			assert.Equal(t, 1, code, "a client with no daemon fails")
			assert.Equal(t, "Cannot find MPS control daemon process\n", stderr)
			assert.NoFileExists(t, logPath, "a client that finds no daemon records nothing")

			d := startDaemon(t, daemonBin, append(env, "CUDA_VISIBLE_DEVICES=GPU-a,GPU-b"))
			pid := d.ready(t, pipe)
			fi, err := os.Stat(filepath.Join(pipe, "control"))
			require.NoError(t, err)
			assert.NotZero(t, fi.Mode()&os.ModeNamedPipe, "the daemon makes its FIFO")

			// A second daemon, of the client's implementation, finds the lock taken.
			stderr, code = run(t, clientBin, env, "", "-f")
			assert.Equal(t, 1, code, "a second daemon fails")
			assert.Equal(t, "An instance of this daemon is already running\n", stderr)

			stderr, code = run(t, clientBin, env, "set_default_active_thread_percentage 50\nquit\n")
			assert.Equal(t, 0, code, "the client")
			assert.Empty(t, stderr, "the client")

			code, stderr = d.wait(t)
			assert.Equal(t, 0, code, "the daemon quits when told to")
			assert.Empty(t, stderr, "the daemon")
			log, err := os.ReadFile(logPath)
			require.NoError(t, err)
			want := fmt.Sprintf("daemon start pid=%d CUDA_VISIBLE_DEVICES=GPU-a,GPU-b\n"+
				"command set_default_active_thread_percentage 50\n"+
				"command quit\n"+
				"daemon quit pid=%d\n", pid, pid)
			assert.Equal(t, want, string(log))

			// The FIFO stays, but the lock went with the daemon.
			assert.FileExists(t, filepath.Join(pipe, "control"))
			stderr, code = run(t, clientBin, env, "quit\n")
			assert.Equal(t, 1, code, "a client after the daemon quit fails")
			assert.Equal(t, "Cannot find MPS control daemon process\n", stderr)
			log, err = os.ReadFile(logPath)
			require.NoError(t, err)
			assert.Equal(t, want, string(log), "a client that finds no daemon records nothing")
		})
	}
}

// A client's check that a daemon runs takes the daemon's lock for a
// moment (alive): a daemon starting in that moment waits it out instead of
// taking the client for a daemon and exiting, which left the MPS server of
// a plugin that probed it at once unanswered until the next start.
func TestDaemonWaitsOutAClientsCheck(t *testing.T) {
	bins := binaries(t)
	for _, impl := range []string{goImpl, bashImpl} {
		t.Run(impl, func(t *testing.T) {
			bin := pick(t, bins, impl)
			pipe := t.TempDir()
			lock, err := os.OpenFile(filepath.Join(pipe, "control.lock"), os.O_RDONLY|os.O_CREATE, 0o666)
			require.NoError(t, err)
			defer lock.Close()
			require.NoError(t, syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB))
			d := startDaemon(t, bin, environ("CUDA_MPS_PIPE_DIRECTORY="+pipe))
			time.Sleep(300 * time.Millisecond)
			require.NoError(t, lock.Close(), "the client's check ends")
			pid := d.ready(t, pipe)
			log, err := os.ReadFile(filepath.Join(pipe, "control.log"))
			require.NoError(t, err)
			assert.Equal(t, fmt.Sprintf("daemon start pid=%d CUDA_VISIBLE_DEVICES=\n", pid), string(log))
		})
	}
}

// Like the real daemon, the daemon goes when its pipe directory goes,
// without a quit line.
func TestDaemonEndsWithItsPipeDirectory(t *testing.T) {
	bins := binaries(t)
	for _, impl := range []string{goImpl, bashImpl} {
		t.Run(impl, func(t *testing.T) {
			bin := pick(t, bins, impl)
			pipe, logDir := filepath.Join(t.TempDir(), "pipe"), t.TempDir()
			require.NoError(t, os.Mkdir(pipe, 0o755))
			d := startDaemon(t, bin, environ("CUDA_MPS_PIPE_DIRECTORY="+pipe, "CUDA_MPS_LOG_DIRECTORY="+logDir))
			pid := d.ready(t, pipe)
			select {
			case <-d.done:
				require.FailNow(t, "the daemon exited with its pipe directory still there")
			case <-time.After(500 * time.Millisecond):
			}
			require.NoError(t, os.RemoveAll(pipe))
			code, stderr := d.wait(t)
			assert.Equal(t, 0, code)
			assert.Empty(t, stderr)
			log, err := os.ReadFile(filepath.Join(logDir, "control.log"))
			require.NoError(t, err)
			assert.Equal(t, fmt.Sprintf("daemon start pid=%d CUDA_VISIBLE_DEVICES=\n", pid), string(log))
		})
	}
}

// SIGTERM and SIGINT make the daemon quit as the command quit does.
func TestDaemonQuitsOnSignal(t *testing.T) {
	bins := binaries(t)
	for _, impl := range []string{goImpl, bashImpl} {
		for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
			t.Run(impl+" "+sig.String(), func(t *testing.T) {
				bin := pick(t, bins, impl)
				pipe := t.TempDir()
				d := startDaemon(t, bin, environ("CUDA_MPS_PIPE_DIRECTORY="+pipe, "CUDA_VISIBLE_DEVICES=GPU-a"))
				pid := d.ready(t, pipe)
				inLoop(t, pipe)
				require.NoError(t, d.cmd.Process.Signal(sig))
				code, stderr := d.wait(t)
				assert.Equal(t, 0, code)
				assert.Empty(t, stderr)
				log, err := os.ReadFile(filepath.Join(pipe, "control.log"))
				require.NoError(t, err)
				assert.Equal(t, fmt.Sprintf("daemon start pid=%d CUDA_VISIBLE_DEVICES=GPU-a\ndaemon quit pid=%d\n", pid, pid), string(log))
			})
		}
	}
}

// What a client writes to the FIFO and the log, and to stderr when it
// cannot write the log, is the script's, quirks of bash's read and echo
// included. The test is the daemon here: it holds the lock and reads the
// FIFO.
func TestClientWritesWhatTheScriptWrites(t *testing.T) {
	bins := binaries(t)
	const stdin = "  padded \t line \t\n" +
		"-n\n" + // bash's echo takes these three for options
		"-e\n" +
		"-nE\n" +
		"-x\n" +
		`a\b` + "\n" + // read -r: the backslash stays
		"nul\x00byte\n" + // read drops NUL bytes
		"unterminated" // read fails at end of file: never a command
	const wantFIFO = "padded \t line\n" + "" + "\n" + "" + "-x\n" + `a\b` + "\n" + "nulbyte\n"
	const wantLog = "command padded \t line\n" +
		"command -n\n" +
		"command -e\n" +
		"command -nE\n" +
		"command -x\n" +
		`command a\b` + "\n" +
		"command nulbyte\n"
	for _, impl := range []string{goImpl, bashImpl} {
		for _, logMissing := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s, log directory missing %v", impl, logMissing), func(t *testing.T) {
				bin := pick(t, bins, impl)
				pipe := t.TempDir()
				logDir := t.TempDir()
				if logMissing {
					logDir = filepath.Join(logDir, "missing")
				}
				require.NoError(t, syscall.Mkfifo(filepath.Join(pipe, "control"), 0o600))
				fifo, err := os.OpenFile(filepath.Join(pipe, "control"), os.O_RDWR, 0)
				require.NoError(t, err)
				defer fifo.Close()
				lock, err := os.Create(filepath.Join(pipe, "control.lock"))
				require.NoError(t, err)
				defer lock.Close()
				require.NoError(t, syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB))

				stderr, code := run(t, bin, environ("CUDA_MPS_PIPE_DIRECTORY="+pipe, "CUDA_MPS_LOG_DIRECTORY="+logDir), stdin)
				assert.Equal(t, 0, code)
				require.NoError(t, fifo.SetReadDeadline(time.Now().Add(300*time.Millisecond)))
				got, err := io.ReadAll(fifo)
				require.ErrorIs(t, err, os.ErrDeadlineExceeded)
				assert.Equal(t, wantFIFO, string(got), "the FIFO")
				if logMissing {
					// bash's own message for the failed >> "$log" at the script's line 49.
					want := strings.Repeat(fmt.Sprintf("%s: line 49: %s/control.log: No such file or directory\n", bin, logDir), 7)
					assert.Equal(t, want, stderr)
					assert.NoDirExists(t, logDir)
					return
				}
				assert.Empty(t, stderr)
				log, err := os.ReadFile(filepath.Join(logDir, "control.log"))
				require.NoError(t, err)
				assert.Equal(t, wantLog, string(log))
			})
		}
	}
}

// Failures are reported as the script reports them, but for the one
// difference the port documents: an unset pipe directory.
func TestErrors(t *testing.T) {
	bins := binaries(t)
	missing := filepath.Join(t.TempDir(), "missing")
	tests := []struct {
		name string
		env  []string
		args []string
		// want is the stderr, with {prog} the program's path and {dir}
		// the missing directory; wantBash the script's where it differs.
		want, wantBash string
	}{
		{
			name:     "pipe directory unset",
			env:      environ(),
			want:     "CUDA_MPS_PIPE_DIRECTORY is not set\n",
			wantBash: "{prog}: line 14: CUDA_MPS_PIPE_DIRECTORY: CUDA_MPS_PIPE_DIRECTORY is not set\n",
		},
		{
			name:     "daemon, pipe directory empty",
			env:      environ("CUDA_MPS_PIPE_DIRECTORY="),
			args:     []string{"-f"},
			want:     "CUDA_MPS_PIPE_DIRECTORY is not set\n",
			wantBash: "{prog}: line 14: CUDA_MPS_PIPE_DIRECTORY: CUDA_MPS_PIPE_DIRECTORY is not set\n",
		},
		{
			name: "daemon, pipe directory missing",
			env:  environ("CUDA_MPS_PIPE_DIRECTORY=" + missing),
			args: []string{"-f"},
			want: "{prog}: line 17: {dir}/control.lock: No such file or directory\n" +
				"flock: 8: Bad file descriptor\n" +
				"An instance of this daemon is already running\n",
		},
		{
			name: "client, pipe directory missing",
			env:  environ("CUDA_MPS_PIPE_DIRECTORY=" + missing),
			want: "Cannot find MPS control daemon process\n",
		},
	}
	for _, impl := range []string{goImpl, bashImpl} {
		for _, tc := range tests {
			t.Run(impl+", "+tc.name, func(t *testing.T) {
				bin := pick(t, bins, impl)
				stderr, code := run(t, bin, tc.env, "quit\n", tc.args...)
				assert.Equal(t, 1, code)
				want := tc.want
				if impl == bashImpl && tc.wantBash != "" {
					want = tc.wantBash
				}
				assert.Equal(t, strings.NewReplacer("{prog}", bin, "{dir}", missing).Replace(want), stderr)
				assert.NoDirExists(t, missing)
			})
		}
	}
}
