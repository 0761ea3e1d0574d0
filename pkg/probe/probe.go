// Package probe is what runs inside devcluster's real containers (issue
// 27): it reports, as one JSON document, what the container sees of the
// GPUs (device nodes, whether each opens), its environment, its mounts
// (driver files and whether each is read-only) and its sharing directories,
// then keeps running until it is stopped, as a workload does, or exits
// when told to (a job's container that completes). It reads
// only what any process can read from inside, so the report is evidence of
// what the runtime did with the CDI spec, not of what the spec said.
package probe

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Report is what the probe saw from inside its container.
type Report struct {
	PID      int               `json:"pid"`
	Hostname string            `json:"hostname"`
	Devices  []Device          `json:"devices"`
	Env      map[string]string `json:"env"`
	Mounts   []Mount           `json:"mounts"`
	// Dirs lists, per sharing directory that exists (the IPC directory
	// named by GPUDRA_IPC_DIR, the MPS pipe directory, /dev/shm), the
	// names in it.
	Dirs map[string][]string `json:"dirs"`
	// Wrote is the file the probe wrote into the IPC directory.
	Wrote   string   `json:"wrote,omitempty"`
	Command *Command `json:"command,omitempty"`
}

// Device is one /dev/nvidia* node.
type Device struct {
	Path  string `json:"path"`
	Type  string `json:"type"` // c, b or - (not a device node)
	Major uint32 `json:"major"`
	Minor uint32 `json:"minor"`
	// Opens is whether open(2) for reading and writing succeeded;
	// OpenError says why not: EPERM is the device cgroup refusing it,
	// ENXIO a node the cgroup allows with no driver behind it (the
	// simulator's case).
	Opens     bool   `json:"opens"`
	OpenError string `json:"openError,omitempty"`
}

// Mount is one line of /proc/self/mountinfo.
type Mount struct {
	MountPoint string `json:"mountPoint"`
	Root       string `json:"root"`
	FSType     string `json:"fsType"`
	ReadOnly   bool   `json:"readOnly"`
	// Driver marks the NVIDIA driver's files (libraries and binaries
	// whose names say so).
	Driver bool `json:"driver"`
}

// Command is what the pod asked the probe to run, and what it did.
type Command struct {
	Args     []string `json:"args"`
	ExitCode int      `json:"exitCode"`
	Output   string   `json:"output"`
}

// Config says where the report goes and what else to do.
type Config struct {
	// ReportFile, when set, receives the report too (written to a
	// temporary name and renamed, so a reader never sees half of it).
	ReportFile string
	// Exec is a command to run after looking, its output in the report.
	Exec []string
	// Exit: do not keep running after the report. ExitAfter: keep
	// running this long after it, then exit (a job's container that
	// completes); either way, a command (Exec) that failed fails the
	// probe.
	Exit      bool
	ExitAfter time.Duration
	// Out receives the report (stdout).
	Out io.Writer
}

// Run looks, reports and then waits for ctx (the container's stop signal).
// Where the container has an IPC directory (GPUDRA_IPC_DIR), it first
// writes a file named after its hostname there, so that the containers
// sharing a claim show each other what they wrote (Report.Dirs).
func Run(ctx context.Context, cfg Config) error {
	var wrote string
	if dir := os.Getenv("GPUDRA_IPC_DIR"); dir != "" {
		host, _ := os.Hostname()
		wrote = filepath.Join(dir, host)
		if err := os.WriteFile(wrote, []byte(host), 0o644); err != nil {
			return fmt.Errorf("write into the IPC directory: %w", err)
		}
	}
	r, err := Look()
	if err != nil {
		return err
	}
	r.Wrote = wrote
	if len(cfg.Exec) > 0 {
		out, err := exec.CommandContext(ctx, cfg.Exec[0], cfg.Exec[1:]...).CombinedOutput()
		r.Command = &Command{Args: cfg.Exec, Output: string(out)}
		var exit *exec.ExitError
		switch {
		case errors.As(err, &exit):
			r.Command.ExitCode = exit.ExitCode()
		case err != nil:
			r.Command.ExitCode = -1
			r.Command.Output += err.Error()
		}
	}
	doc, err := json.Marshal(r)
	if err != nil {
		return err
	}
	if cfg.Out != nil {
		if _, err := fmt.Fprintf(cfg.Out, "%s\n", doc); err != nil {
			return err
		}
	}
	if cfg.ReportFile != "" {
		tmp := cfg.ReportFile + ".tmp"
		if err := os.WriteFile(tmp, doc, 0o644); err != nil {
			return fmt.Errorf("write report: %w", err)
		}
		if err := os.Rename(tmp, cfg.ReportFile); err != nil {
			return fmt.Errorf("write report: %w", err)
		}
	}
	if !cfg.Exit && cfg.ExitAfter <= 0 {
		<-ctx.Done()
		return nil
	}
	select {
	case <-ctx.Done():
		// Stopped before its time: as a workload stopped, not failed.
		return nil
	case <-time.After(cfg.ExitAfter):
	}
	if r.Command != nil && r.Command.ExitCode != 0 {
		return fmt.Errorf("command %q exited with %d", r.Command.Args, r.Command.ExitCode)
	}
	return nil
}

// Look reads what the container sees.
func Look() (*Report, error) {
	r := &Report{PID: os.Getpid(), Env: map[string]string{}, Dirs: map[string][]string{}}
	r.Hostname, _ = os.Hostname()
	for _, kv := range os.Environ() {
		k, v, _ := strings.Cut(kv, "=")
		r.Env[k] = v
	}
	paths, err := filepath.Glob("/dev/nvidia*")
	if err != nil {
		return nil, err
	}
	caps, _ := filepath.Glob("/dev/nvidia-caps/*")
	for _, p := range append(paths, caps...) {
		if fi, err := os.Stat(p); err == nil && fi.IsDir() {
			continue
		}
		r.Devices = append(r.Devices, device(p))
	}
	sort.Slice(r.Devices, func(i, j int) bool { return r.Devices[i].Path < r.Devices[j].Path })
	if r.Mounts, err = mounts("/proc/self/mountinfo"); err != nil {
		return nil, err
	}
	for _, dir := range []string{os.Getenv("GPUDRA_IPC_DIR"), "/var/run/gpudra/mps", "/dev/shm"} {
		if dir == "" {
			continue
		}
		entries, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		names := []string{}
		for _, e := range entries {
			names = append(names, e.Name())
		}
		r.Dirs[dir] = names
	}
	return r, nil
}

func device(path string) Device {
	d := Device{Path: path, Type: "-"}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		d.OpenError = err.Error()
		return d
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFCHR:
		d.Type = "c"
	case unix.S_IFBLK:
		d.Type = "b"
	}
	d.Major, d.Minor = unix.Major(st.Rdev), unix.Minor(st.Rdev)
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		d.OpenError = err.Error()
		var errno syscall.Errno
		if errors.As(err, &errno) {
			d.OpenError = unix.ErrnoName(errno) // EPERM, ENXIO, ...
		}
		return d
	}
	d.Opens = true
	_ = f.Close()
	return d
}

// mounts parses mountinfo: "id parent major:minor root mountpoint options
// optional... - fstype source superoptions".
func mounts(path string) ([]Mount, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("read mounts: %w", err)
	}
	defer f.Close()
	var out []Mount
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 7 {
			continue
		}
		m := Mount{Root: unescape(fields[3]), MountPoint: unescape(fields[4])}
		for _, o := range strings.Split(fields[5], ",") {
			if o == "ro" {
				m.ReadOnly = true
			}
		}
		for i := 6; i < len(fields)-1; i++ {
			if fields[i] == "-" {
				m.FSType = fields[i+1]
				break
			}
		}
		base := filepath.Base(m.MountPoint)
		m.Driver = strings.HasPrefix(base, "libnvidia") || strings.HasPrefix(base, "libcuda") || strings.HasPrefix(base, "nvidia-smi") ||
			strings.HasPrefix(base, "nvidia-cuda-mps") || strings.HasPrefix(base, "libnvidia-ml")
		out = append(out, m)
	}
	return out, sc.Err()
}

// unescape undoes mountinfo's octal escapes (\040 for a space).
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v int
			if _, err := fmt.Sscanf(s[i+1:i+4], "%3o", &v); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
