package sharing

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
)

// procIdentity tells a process from any later one that reuses its pid: the
// kernel's start time of the process (clock ticks since boot, field 22 of
// /proc/<pid>/stat) and its command line. A pid alone is not enough: pids
// are recycled, and a plugin in a new container (a new PID namespace) sees
// pids that name other processes, which `stop` would then kill with their
// process group.
type procIdentity struct {
	PID       int    `json:"pid"`
	StartTime uint64 `json:"startTime"`
	Cmdline   string `json:"cmdline"`
}

// ProcessStart is what /proc says of a running process: the kernel's
// start time (clock ticks since boot, field 22 of stat), which with the pid
// tells it from a later process that reuses the pid, and whether it is a
// zombie (dead, not yet reaped).
type ProcessStart struct {
	StartTime uint64
	Zombie    bool
}

// ReadProcessStart reads pid's start time from procRoot.
func ReadProcessStart(procRoot string, pid int) (ProcessStart, error) {
	dir := filepath.Join(procRoot, strconv.Itoa(pid))
	stat, err := os.ReadFile(filepath.Join(dir, "stat"))
	if err != nil {
		return ProcessStart{}, err
	}
	// The command name is in parentheses and may hold spaces: the fields
	// after it start at the last ')'.
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return ProcessStart{}, fmt.Errorf("%s/stat: no command name", dir)
	}
	fields := strings.Fields(string(stat[i+1:]))
	// fields[0] is the state (field 3); the start time is field 22.
	if len(fields) < 20 {
		return ProcessStart{}, fmt.Errorf("%s/stat: %d fields", dir, len(fields)+2)
	}
	start, err := strconv.ParseUint(fields[19], 10, 64)
	if err != nil {
		return ProcessStart{}, fmt.Errorf("%s/stat: start time %q: %w", dir, fields[19], err)
	}
	return ProcessStart{StartTime: start, Zombie: fields[0] == "Z" || fields[0] == "X"}, nil
}

// readProcIdentity reads a running process's identity from procRoot.
func readProcIdentity(procRoot string, pid int) (procIdentity, error) {
	dir := filepath.Join(procRoot, strconv.Itoa(pid))
	ps, err := ReadProcessStart(procRoot, pid)
	if err != nil {
		return procIdentity{}, err
	}
	start := ps.StartTime
	// The command line reads empty while the process is between two execs
	// (env, then a shell, then the daemon): read it again briefly. A zombie's
	// stays empty: no wait for it.
	var cmdline []byte
	reads := wait.Backoff{Duration: 10 * time.Millisecond, Steps: 100}
	if ps.Zombie {
		reads.Steps = 1
	}
	err = wait.ExponentialBackoff(reads, func() (bool, error) {
		var err error
		cmdline, err = os.ReadFile(filepath.Join(dir, "cmdline"))
		return len(cmdline) > 0, err
	})
	if err != nil && !wait.Interrupted(err) {
		return procIdentity{}, err
	}
	return procIdentity{PID: pid, StartTime: start, Cmdline: string(bytes.TrimRight(cmdline, "\x00"))}, nil
}

// pidFile is where a claim's daemon identity is recorded.
func pidFile(dir string) string { return filepath.Join(dir, "daemon.pid") }

func writeIdentity(dir string, id procIdentity) error {
	b, err := json.Marshal(id)
	if err != nil {
		return err
	}
	return os.WriteFile(pidFile(dir), b, 0o644)
}

// errNotOurs says the pid file names a process that is not the daemon
// that was recorded (or is in no form this release wrote).
var errNotOurs = errors.New("the recorded process is gone or its pid now names another process")

// verifyIdentity reads the recorded identity and checks that the process
// with that pid is still that process. A bare pid (an older release's
// file) cannot be verified and is never trusted.
func verifyIdentity(procRoot, dir string) (procIdentity, error) {
	b, err := os.ReadFile(pidFile(dir))
	if err != nil {
		return procIdentity{}, err
	}
	var rec procIdentity
	if err := json.Unmarshal(b, &rec); err != nil || rec.PID <= 0 || rec.StartTime == 0 {
		return procIdentity{}, fmt.Errorf("pid file %s has no process identity: %w", pidFile(dir), errNotOurs)
	}
	return rec, rec.check(procRoot)
}

// daemonCommand is in the command line of every MPS control daemon the
// plugin starts, directly or through the driver root's loader. The command
// line is not compared whole: a process may exec on its way to the daemon
// (env, a shell, the loader) after its identity was read, which keeps its
// start time.
const daemonCommand = "nvidia-cuda-mps-control"

// check says whether the process with the identity's pid is still that
// process: the same start time, and still an MPS control daemon.
func (id procIdentity) check(procRoot string) error {
	now, err := readProcIdentity(procRoot, id.PID)
	if err != nil {
		return fmt.Errorf("pid %d: %w", id.PID, errNotOurs)
	}
	if now.StartTime != id.StartTime || !strings.Contains(now.Cmdline, daemonCommand) {
		return fmt.Errorf("pid %d started at %d running %q, recorded %d running %q: %w",
			id.PID, now.StartTime, now.Cmdline, id.StartTime, id.Cmdline, errNotOurs)
	}
	return nil
}

// RecordedDaemonPID is the pid recorded for the MPS daemon whose claim
// directory is dir (for tests and diagnostics; it does not say the process
// is still that daemon).
func RecordedDaemonPID(dir string) (int, error) {
	b, err := os.ReadFile(pidFile(dir))
	if err != nil {
		return 0, err
	}
	var rec procIdentity
	if err := json.Unmarshal(b, &rec); err != nil {
		return 0, fmt.Errorf("pid file %s: %w", pidFile(dir), err)
	}
	return rec.PID, nil
}
