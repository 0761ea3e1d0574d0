// Command fake-mps-control is a static Go port of
// hack/fake-nvidia-cuda-mps-control, the stand-in for
// nvidia-cuda-mps-control used by tests and devcluster where no GPU exists.
//
// It exists because the containers on devcluster's real node run the gpudra
// image, which has no shell, no flock and no mkfifo (a distroless image under
// containerd): the MPS server pod and the kubelet plugin there need a stand-in
// they can exec. It speaks the same protocol and writes the same log lines as
// the script, so either can be the daemon and the other its client:
//
//	-f            run as the control daemon (foreground) until told to quit
//	(no argument) a control client: each line of stdin is a command for the
//	              daemon whose pipe directory is $CUDA_MPS_PIPE_DIRECTORY
//
// Like the real one, a client reaches the daemon through the pipe directory
// only, never by pid: the daemon may run in another PID namespace than the
// client. The daemon holds a flock(2) on $pipe/control.lock while it lives
// (waiting up to 1 s for it: a client takes it for a moment to check for a
// daemon) and reads the FIFO $pipe/control; control.pid is its pid as its own
// namespace sees it, for tests. Commands are recorded in
// ${CUDA_MPS_LOG_DIRECTORY:-$pipe}/control.log.
//
// What it writes to files and to stderr is the script's, byte for byte,
// including the diagnostics bash, flock(1), mkfifo(1) and rm(1) would print
// (bash's carry "<argv[0]>: line N: ", N being the script's line) and bash's
// quirks: lines are stripped of leading and trailing blanks as `read` does,
// NUL bytes are dropped, a last line without a newline is not a command, a
// partial line the daemon does not get whole within 0.2 s is discarded, and
// a command that is all -n/-e/-E option letters reaches the FIFO as bash's
// echo prints it. The one deliberate difference: with
// CUDA_MPS_PIPE_DIRECTORY unset or empty the script prints
// "<argv[0]>: line 14: CUDA_MPS_PIPE_DIRECTORY: CUDA_MPS_PIPE_DIRECTORY is not set",
// this prints "CUDA_MPS_PIPE_DIRECTORY is not set"; both exit 1.
//
// Differences it does not try to avoid: signals other than SIGTERM, SIGINT
// and SIGQUIT get Go's default handling, not bash's; the C library's
// messages are glibc's; and mkfifo(1)'s shell quoting of a path with odd
// characters is not copied. The line numbers in its messages are the
// script's: move the script's lines and they must follow (the tests compare
// them with the script's).
package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// prog is what bash calls the script in its own diagnostics ($0).
var prog = os.Args[0]

func main() {
	// "In all cases, Bash ignores SIGQUIT."
	signal.Ignore(syscall.SIGQUIT)
	pipe := os.Getenv("CUDA_MPS_PIPE_DIRECTORY")
	if pipe == "" {
		fmt.Fprintln(os.Stderr, "CUDA_MPS_PIPE_DIRECTORY is not set")
		os.Exit(1)
	}
	logDir := os.Getenv("CUDA_MPS_LOG_DIRECTORY")
	if logDir == "" {
		logDir = pipe
	}
	log := logDir + "/control.log"
	if len(os.Args) > 1 && os.Args[1] == "-f" {
		daemon(pipe, log)
	}
	os.Exit(client(pipe, log))
}

// Kept open, and so locked, for as long as the daemon lives.
var lockFile *os.File

// daemon is the script's `-f` branch; it never returns.
func daemon(pipe, log string) {
	lockPath := pipe + "/control.lock"
	f, err := os.OpenFile(lockPath, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o666)
	if err != nil {
		bashError(17, lockPath, err)
		// flock(1) is then handed a descriptor that is not open.
		fmt.Fprintf(os.Stderr, "flock: 8: %s\n", strerror(syscall.EBADF))
		alreadyRunning()
	}
	lockFile = f
	if err := flockWait(int(f.Fd()), daemonLockWait); err != nil {
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			fmt.Fprintf(os.Stderr, "flock: 8: %s\n", strerror(err))
		}
		alreadyRunning()
	}
	// The real server keeps its shared memory with its clients in /dev/shm.
	// Only in the MPS server pod's container (gpudra-mps-server is its pid
	// 1), whose /dev/shm its clients mount: never in a host's own /dev/shm.
	shm := ""
	if comm, _ := os.ReadFile("/proc/1/comm"); strings.HasPrefix(string(comm), "gpudra-mps-") {
		shm = "/dev/shm/cuda.shm.fake-mps-control"
		if f, err := os.OpenFile(shm, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o666); err != nil {
			bashError(24, shm, err)
		} else {
			f.Close()
		}
	}
	control := pipe + "/control"
	if !isFIFO(control) {
		if err := syscall.Mkfifo(control, 0o666); err != nil {
			fmt.Fprintf(os.Stderr, "mkfifo: cannot create fifo '%s': %s\n", control, strerror(err))
		}
	}
	// Read-write: the open never blocks and the read never sees end of file.
	fifo, err := os.OpenFile(control, os.O_RDWR|os.O_CREATE, 0o666)
	if err != nil {
		bashError(28, control, err)
		fifo = nil
	}
	pid := os.Getpid()
	appendLine(29, log, fmt.Sprintf("daemon start pid=%d CUDA_VISIBLE_DEVICES=%s\n", pid, os.Getenv("CUDA_VISIBLE_DEVICES")))
	writeFile(30, pipe+"/control.pid", strconv.Itoa(pid)+"\n")

	// mu makes quitting one step, as a trap is run between the script's
	// commands, never within one: whoever takes it exits holding it.
	var mu sync.Mutex
	quit := func(line int) {
		if line == 1 {
			// The trap's echo ... >> "$log" 2>/dev/null: its redirections
			// are made left to right, so a log that cannot be opened is
			// still reported (at the trap's line 1), a failed write not.
			if f, err := os.OpenFile(log, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o666); err != nil {
				bashError(1, log, err)
			} else {
				_, _ = fmt.Fprintf(f, "daemon quit pid=%d\n", pid)
				f.Close()
			}
		} else {
			appendLine(line, log, fmt.Sprintf("daemon quit pid=%d\n", pid))
		}
		if shm != "" {
			rmF(shm)
		}
		os.Exit(0)
	}
	sigs := []os.Signal{syscall.SIGTERM}
	// A signal ignored when bash starts cannot be trapped: a daemon started
	// in the background by a script ignores SIGINT, and so does this one.
	if !signal.Ignored(syscall.SIGINT) {
		sigs = append(sigs, syscall.SIGINT)
	}
	trapped := make(chan os.Signal, 1)
	signal.Notify(trapped, sigs...)
	go func() {
		<-trapped
		mu.Lock()
		quit(1)
	}()

	// Like the real daemon, it goes when its pipe directory goes.
	for isDir(pipe) {
		if fifo == nil {
			fmt.Fprintf(os.Stderr, "%s: line 34: read: 9: invalid file descriptor: %s\n", prog, strerror(syscall.EBADF))
			continue
		}
		if line, ok := readLine(fifo, 200*time.Millisecond, 34, 9); ok && line == "quit" {
			mu.Lock()
			quit(35)
		}
	}
	mu.Lock()
	os.Exit(0)
}

func alreadyRunning() {
	fmt.Fprintln(os.Stderr, "An instance of this daemon is already running")
	os.Exit(1)
}

// client is the script's client: it returns the exit status.
func client(pipe, log string) int {
	if !alive(pipe) {
		fmt.Fprintln(os.Stderr, "Cannot find MPS control daemon process")
		return 1
	}
	for {
		line, ok := readLine(os.Stdin, 0, 48, 0)
		if !ok {
			return 0
		}
		appendLine(49, log, "command "+line+"\n")
		if !alive(pipe) {
			fmt.Fprintln(os.Stderr, "Cannot find MPS control daemon process")
			return 1
		}
		control := pipe + "/control"
		f, err := os.OpenFile(control, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o666)
		if err != nil {
			bashError(51, control, err)
			continue
		}
		if out := echo(line); out != "" {
			if _, err := f.WriteString(out); err != nil {
				if errors.Is(err, syscall.EPIPE) {
					os.Exit(128 + int(syscall.SIGPIPE)) // bash dies of SIGPIPE
				}
				fmt.Fprintf(os.Stderr, "%s: line 51: echo: write error: %s\n", prog, strerror(err))
			}
		}
		f.Close()
	}
}

// alive is the script's alive(): the daemon holds the lock while it lives,
// so taking it (as `flock -n control.lock true` does) means none does.
func alive(pipe string) bool {
	lockPath := pipe + "/control.lock"
	if _, err := os.Stat(lockPath); err != nil || !isFIFO(pipe+"/control") {
		return false
	}
	fd, err := syscall.Open(lockPath, syscall.O_RDONLY|syscall.O_NOCTTY|syscall.O_CREAT|syscall.O_CLOEXEC, 0o666)
	if errors.Is(err, syscall.EISDIR) {
		fd, err = syscall.Open(lockPath, syscall.O_RDONLY|syscall.O_NOCTTY|syscall.O_CLOEXEC, 0)
	}
	if err != nil {
		// flock(1) fails, which the script takes for a daemon holding it.
		fmt.Fprintf(os.Stderr, "flock: cannot open lock file %s: %s\n", lockPath, strerror(err))
		return true
	}
	defer syscall.Close(fd)
	if err := flock(fd); err != nil {
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			fmt.Fprintf(os.Stderr, "flock: %s: %s\n", lockPath, strerror(err))
		}
		return true
	}
	return false // closing fd releases the lock at once
}

// daemonLockWait is how long the daemon waits for its lock, as the
// script's `flock -w 1` does: a client checking for a daemon (alive) holds
// it for a moment, and a daemon starting then must not take that client
// for another daemon.
const daemonLockWait = time.Second

// flockWait takes an exclusive lock, waiting at most wait for it; like
// `flock -w`, it fails with EWOULDBLOCK when the lock stays taken.
func flockWait(fd int, wait time.Duration) error {
	deadline := time.Now().Add(wait)
	for {
		err := flock(fd)
		if !errors.Is(err, syscall.EWOULDBLOCK) || time.Now().After(deadline) {
			return err
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// flock takes an exclusive lock without waiting, as `flock -n` does.
func flock(fd int) error {
	for {
		err := syscall.Flock(fd, syscall.LOCK_EX|syscall.LOCK_NB)
		if err != syscall.EINTR {
			return err
		}
	}
}

// readLine reads a line as bash's `read -r` does, one byte at a time so
// that nothing past the newline is consumed: NUL bytes are dropped and the
// line is stripped of leading and trailing blanks. It fails at end of file
// or error, and, with a timeout, when no whole line came within it; what
// was read of a line then is lost, as with `read -t`. line and fd are the
// script's, for bash's message on a read error.
func readLine(f *os.File, timeout time.Duration, line, fd int) (string, bool) {
	if timeout > 0 {
		// A regular file has no deadline: it does not block either.
		_ = f.SetReadDeadline(time.Now().Add(timeout))
	}
	var s []byte
	b := make([]byte, 1)
	for {
		n, err := f.Read(b)
		if n == 1 {
			switch b[0] {
			case '\n':
				return strings.Trim(string(s), " \t\n"), true
			case 0:
			default:
				s = append(s, b[0])
			}
			continue
		}
		if err == nil {
			continue
		}
		if !errors.Is(err, io.EOF) && !errors.Is(err, os.ErrDeadlineExceeded) {
			fmt.Fprintf(os.Stderr, "%s: line %d: read: read error: %d: %s\n", prog, line, fd, strerror(err))
		}
		return "", false
	}
}

// echo is what bash's `echo "$s"` prints: an argument made only of the
// option letters n, e and E after a dash is taken for options, and there is
// nothing left to print but the newline, which -n leaves out.
func echo(s string) string {
	if len(s) > 1 && s[0] == '-' && strings.Trim(s[1:], "neE") == "" {
		if strings.Contains(s, "n") {
			return ""
		}
		return "\n"
	}
	return s + "\n"
}

// appendLine is `echo ... >> path` at the script's line.
func appendLine(line int, path, s string) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o666)
	if err != nil {
		bashError(line, path, err)
		return
	}
	defer f.Close()
	if _, err := f.WriteString(s); err != nil {
		fmt.Fprintf(os.Stderr, "%s: line %d: echo: write error: %s\n", prog, line, strerror(err))
	}
}

// writeFile is `echo ... > path` at the script's line.
func writeFile(line int, path, s string) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o666)
	if err != nil {
		bashError(line, path, err)
		return
	}
	defer f.Close()
	if _, err := f.WriteString(s); err != nil {
		fmt.Fprintf(os.Stderr, "%s: line %d: echo: write error: %s\n", prog, line, strerror(err))
	}
}

// rmF is `rm -f path`.
func rmF(path string) {
	if err := syscall.Unlink(path); err != nil && err != syscall.ENOENT {
		fmt.Fprintf(os.Stderr, "rm: cannot remove '%s': %s\n", path, strerror(err))
	}
}

// bashError is what bash prints when a redirection at the script's line
// fails: the command is then skipped and the script goes on.
func bashError(line int, path string, err error) {
	fmt.Fprintf(os.Stderr, "%s: line %d: %s: %s\n", prog, line, path, strerror(err))
}

// strerror is the C library's message for err's errno: Go's, capitalised.
func strerror(err error) string {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		s := errno.Error()
		return strings.ToUpper(s[:1]) + s[1:]
	}
	return err.Error()
}

// isFIFO is `[ -p path ]`.
func isFIFO(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode()&os.ModeNamedPipe != 0
}

// isDir is `[ -d path ]`.
func isDir(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.IsDir()
}
