// Package noderuntime is devcluster's container runtime: what containerd and
// runc do on a real node, played with the real runc binary and the real CDI
// library. It resolves the kubelet's CDI ids into an OCI spec
// (ResolveContainerSpec; the GPUs a container sees are named from its device
// nodes), runs workload containers in runc with gpudra's probe as their
// process (OCIRuntime.Start) and process pods' containers (MPS servers,
// OCIRuntime.Run), finds and kills a container's processes (ContainerMarker),
// keeps the kubelet's container log links (ContainerLog), and opens sockets
// inside a pod's network namespace (ListenInNetns, DialInNetns). What is
// simulated is only below it: the GPUs behind the device nodes.
package noderuntime

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	oci "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/gpudra/gpudra/pkg/probe"
)

// OCIRuntime runs a pod's containers as real Linux containers (issue 27):
// runc executes the OCI spec that the CDI library made from the kubelet's
// CDI ids, the way containerd hands its spec to runc, with the project's
// static probe (cmd/gpudra-probe) as the container's only file. runc, not
// libcontainer in this process: libcontainer's init needs cgo and a
// re-exec of the caller, and runc is what containerd and CRI-O run; it is
// built from the Go module proxy at a pinned version (make runc).
type OCIRuntime struct {
	// Runc and Probe are the binaries.
	Runc, Probe string
	// HostImage gives every container the host's /usr, read-only, as its
	// image (and /tmp): for a command that needs a libc, as make
	// gpu-smoke's nvidia-smi. Default: a root holding only the probe.
	HostImage bool
	// CUDACheck is gpudra-cuda-check (cmd/gpudra-cuda-check): with it,
	// every container has it at CUDACheckPath, read-only, as it has the
	// probe, for a pod's probe command (nodeagent.ProbeCommandAnnotation) to run:
	// `["/gpudra-cuda-check","--alloc","1Gi"]`. It is dynamically linked
	// (purego): it runs where the image has a libc (HostImage).
	CUDACheck string
	// MPSServer is a static gpudra-mps-server: with it, process pods (MPS
	// servers) run as real containers too; without, in this process.
	MPSServer string
	// Root holds runc's state and the containers' bundles.
	Root string
	// Timings, when set, records how long each Start took (runc run to the
	// probe's report): the start-up the runtime adds to a pod.
	Timings *Timings
}

// Timings are durations recorded from several goroutines.
type Timings struct {
	mu sync.Mutex
	d  []time.Duration
}

func (t *Timings) add(d time.Duration) {
	if t == nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.d = append(t.d, d)
}

// Percentile is the p-th percentile (0..1) of the recorded durations,
// nearest rank, and how many there are.
func (t *Timings) Percentile(p float64) (time.Duration, int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.d) == 0 {
		return 0, 0
	}
	s := slices.Clone(t.d)
	slices.Sort(s)
	return s[int(p*float64(len(s)-1)+0.5)], len(s)
}

// reportDir is where the probe writes its report inside the container.
const reportDir = "/gpudra-report"

// CUDACheckPath is where a container finds OCIRuntime.CUDACheck.
const CUDACheckPath = "/gpudra-cuda-check"

// Usable says why this runtime cannot run here (not root, a binary
// missing), or nil.
func (r *OCIRuntime) Usable() error {
	if os.Geteuid() != 0 {
		return errors.New("real containers need root (runc creates namespaces, device nodes and cgroups)")
	}
	bins := []string{r.Runc, r.Probe}
	if r.CUDACheck != "" {
		bins = append(bins, r.CUDACheck)
	}
	for _, b := range bins {
		if _, err := os.Stat(b); err != nil {
			return fmt.Errorf("real containers: %w", err)
		}
	}
	return nil
}

// Start runs one container from the CDI-edited spec, whose process args
// are the probe's (probeArgs), and returns what the probe reported from
// inside; the container keeps running until Stop, or until the probe
// exits when its arguments say so (Exited).
func (r *OCIRuntime) Start(ctx context.Context, id string, edited *oci.Spec) (*probe.Report, error) {
	bundle := filepath.Join(r.Root, "bundles", id)
	// A sync retried after a start (the pod's status write failed) finds
	// the container of the earlier try: it goes, as a new attempt's would.
	// Only then: runc is not run once more for every new container.
	if _, err := os.Stat(bundle); err == nil {
		if err := r.Stop(ctx, id); err != nil {
			return nil, err
		}
	}
	started := time.Now()
	defer func() { r.Timings.add(time.Since(started)) }()
	if err := os.MkdirAll(filepath.Join(bundle, "rootfs"), 0o755); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Join(bundle, "report"), 0o755); err != nil {
		return nil, err
	}
	spec, err := r.spec(id, bundle, edited)
	if err != nil {
		return nil, err
	}
	if err := WriteJSON(filepath.Join(bundle, "config.json"), spec); err != nil {
		return nil, err
	}
	log, err := os.Create(filepath.Join(bundle, "output"))
	if err != nil {
		return nil, err
	}
	defer log.Close()
	cmd := exec.CommandContext(ctx, r.Runc, "--root", filepath.Join(r.Root, "state"), "run", "--detach", "--bundle", bundle, id)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Run(); err != nil {
		out, _ := os.ReadFile(log.Name())
		return nil, fmt.Errorf("runc run %s: %w: %s", id, err, strings.TrimSpace(string(out)))
	}
	report := filepath.Join(bundle, "report", "report.json")
	deadline := time.Now().Add(10 * time.Second)
	for {
		data, err := os.ReadFile(report)
		if err == nil {
			var rep probe.Report
			if err := json.Unmarshal(data, &rep); err != nil {
				return nil, fmt.Errorf("container %s: probe report: %w", id, err)
			}
			return &rep, nil
		}
		if time.Now().After(deadline) {
			out, _ := os.ReadFile(log.Name())
			return nil, fmt.Errorf("container %s: no probe report after 10 s: %s", id, strings.TrimSpace(string(out)))
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Stop kills and deletes a container and its bundle; one already gone is
// no error.
func (r *OCIRuntime) Stop(ctx context.Context, id string) error {
	state := filepath.Join(r.Root, "state")
	out, err := exec.CommandContext(ctx, r.Runc, "--root", state, "delete", "--force", id).CombinedOutput()
	if err != nil && !strings.Contains(string(out), "does not exist") {
		return fmt.Errorf("runc delete %s: %w: %s", id, err, strings.TrimSpace(string(out)))
	}
	return os.RemoveAll(filepath.Join(r.Root, "bundles", id))
}

// PID is the host PID of the container's first process (the probe), as
// runc's state tells it.
func (r *OCIRuntime) PID(ctx context.Context, id string) (int, error) {
	out, err := exec.CommandContext(ctx, r.Runc, "--root", filepath.Join(r.Root, "state"), "state", id).Output()
	if err != nil {
		return 0, fmt.Errorf("runc state %s: %w", id, err)
	}
	var state struct {
		Pid    int    `json:"pid"`
		Status string `json:"status"`
	}
	if err := json.Unmarshal(out, &state); err != nil {
		return 0, fmt.Errorf("runc state %s: %w", id, err)
	}
	if state.Pid <= 0 || state.Status != "running" {
		return 0, fmt.Errorf("container %s is %s (pid %d), not running", id, state.Status, state.Pid)
	}
	return state.Pid, nil
}

// CgroupRoot is where the host's cgroup hierarchies are mounted.
const CgroupRoot = "/sys/fs/cgroup"

// RemoveCgroup removes a cgroup that held containers (a pod's, once its
// containers are deleted: runc deletes a container's own cgroup, not its
// parents), in every hierarchy: each cgroup v1 controller's and the v2
// one, whether unified at the root or beside v1 (hybrid). A cgroup that
// still holds a container or a child stays (rmdir refuses it); one absent
// is no error.
func (r *OCIRuntime) RemoveCgroup(cgroup string) error {
	if !filepath.IsAbs(cgroup) || filepath.Clean(cgroup) == "/" {
		return fmt.Errorf("remove cgroup %q: want a cgroup below the root", cgroup)
	}
	dirs, _ := filepath.Glob(filepath.Join(CgroupRoot, "*", cgroup))
	dirs = append(dirs, filepath.Join(CgroupRoot, cgroup))
	var errs []error
	for _, d := range dirs {
		if err := os.Remove(d); err != nil && !errors.Is(err, os.ErrNotExist) && !isNotEmpty(err) && !errors.Is(err, syscall.EBUSY) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// spec completes the CDI-edited spec the way containerd's CRI plugin does
// for a container: its own PID, mount, IPC, UTS and network namespaces,
// the usual /proc, /dev, /sys mounts, a device cgroup that denies every
// device but the ones the spec allows (runc adds the standard null, zero,
// random, tty ones), the cgroup the spec names (the kubelet's) or one of
// its own, a read-only root holding only the probe (and the
// CUDA check where given).
func (r *OCIRuntime) spec(id, bundle string, edited *oci.Spec) (*oci.Spec, error) {
	// The kubelet's (nodeagent's containerCgroupPath) where it gives one.
	cgroupsPath := edited.Linux.CgroupsPath
	if cgroupsPath == "" {
		cgroupsPath = "/devcluster/" + id
	}
	s := &oci.Spec{
		Version:  oci.Version,
		Hostname: id,
		Root:     &oci.Root{Path: filepath.Join(bundle, "rootfs"), Readonly: true},
		Process: &oci.Process{
			Args: probeArgs(edited.Process.Args),
			Env:  append([]string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}, edited.Process.Env...),
			Cwd:  "/",
			Capabilities: &oci.LinuxCapabilities{
				Bounding:  DefaultCapabilities,
				Effective: DefaultCapabilities,
				Permitted: DefaultCapabilities,
			},
			NoNewPrivileges: true,
		},
		Mounts: []oci.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc"},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
			{Destination: "/dev/pts", Type: "devpts", Source: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"}},
			{Destination: "/dev/shm", Type: "tmpfs", Source: "shm", Options: []string{"nosuid", "noexec", "nodev", "mode=1777", "size=65536k"}},
			{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "ro"}},
			{Destination: "/gpudra-probe", Type: "bind", Source: r.Probe, Options: []string{"rbind", "ro"}},
			{Destination: reportDir, Type: "bind", Source: filepath.Join(bundle, "report"), Options: []string{"rbind", "rw"}},
		},
		Linux: &oci.Linux{
			Namespaces: []oci.LinuxNamespace{{Type: oci.PIDNamespace}, {Type: oci.MountNamespace}, {Type: oci.IPCNamespace},
				{Type: oci.UTSNamespace}, {Type: oci.NetworkNamespace}},
			CgroupsPath: cgroupsPath,
			Devices:     edited.Linux.Devices,
			Resources: &oci.LinuxResources{Devices: append([]oci.LinuxDeviceCgroup{{Allow: false, Access: "rwm"}},
				edited.Linux.Resources.Devices...)},
			MaskedPaths:   []string{"/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"},
			ReadonlyPaths: []string{"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"},
		},
	}
	if r.CUDACheck != "" {
		check, err := filepath.Abs(r.CUDACheck)
		if err != nil {
			return nil, err
		}
		s.Mounts = append(s.Mounts, oci.Mount{Destination: CUDACheckPath, Type: "bind", Source: check, Options: []string{"rbind", "ro"}})
	}
	if r.HostImage {
		image, err := hostImageMounts(bundle)
		if err != nil {
			return nil, err
		}
		s.Mounts = append(s.Mounts, image...)
	}
	// The CDI edits' mounts (driver files, sharing directories) come last,
	// over the defaults, as containerd applies them; a /dev/shm from an
	// MPS claim replaces the default one.
	for _, m := range edited.Mounts {
		s.Mounts = DeleteMount(s.Mounts, m.Destination)
		s.Mounts = append(s.Mounts, m)
	}
	return s, nil
}

// ProbeCommand is the probe's name: a container whose command is it runs
// the probe with the container's own arguments (nodeagent.ProbeArgs).
const ProbeCommand = "gpudra-probe"

// exitCodeFile is where the probe writes its exit code, in the report
// directory: runc run --detach keeps no exit code of its own.
const exitCodeFile = "exit-code"

// probeArgs runs the probe with its arguments (the spec's process args:
// its flags, then -- and a command to run first, where the pod asks for
// one: nodeagent.ProbeCommandAnnotation, or a container whose command is
// the probe).
func probeArgs(args []string) []string {
	return append([]string{"/gpudra-probe", "--report", reportDir + "/report.json",
		"--exit-code-file", reportDir + "/" + exitCodeFile}, args...)
}

// Exited says whether the container's probe has exited, and with what
// code: what it wrote before exiting. A probe killed (not exiting by
// itself) writes none and is not seen to exit.
func (r *OCIRuntime) Exited(id string) (int32, bool) {
	data, err := os.ReadFile(filepath.Join(r.Root, "bundles", id, "report", exitCodeFile))
	if err != nil {
		return 0, false
	}
	code, err := strconv.ParseInt(strings.TrimSpace(string(data)), 10, 32)
	if err != nil {
		// Written by rename, so whole: a code that does not parse is
		// still an exit, and not a success.
		return 1, true
	}
	return int32(code), true
}

// hostImageMounts make the host's /usr the container's image, with the
// merged-/usr links and a /tmp. As containerd's snapshotter does with an
// image's layers, the image is an overlay: the host's /usr is its
// read-only lower layer, and a writable upper layer in the bundle takes
// what runc creates there (the mount points of the driver's files that a
// CDI spec mounts under /usr), so the host's /usr is never written.
func hostImageMounts(bundle string) ([]oci.Mount, error) {
	for _, l := range []string{"bin", "sbin", "lib", "lib64"} {
		_ = os.Symlink("usr/"+l, filepath.Join(bundle, "rootfs", l))
	}
	upper, work := filepath.Join(bundle, "image", "upper"), filepath.Join(bundle, "image", "work")
	for _, d := range []string{upper, work} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}
	return []oci.Mount{
		{Destination: "/usr", Type: "overlay", Source: "overlay", Options: []string{"lowerdir=/usr", "upperdir=" + upper, "workdir=" + work}},
		{Destination: "/tmp", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "nodev", "mode=1777"}},
	}, nil
}

// DeleteMount removes the mounts at destination.
func DeleteMount(mounts []oci.Mount, destination string) []oci.Mount {
	return slices.DeleteFunc(mounts, func(d oci.Mount) bool { return d.Destination == destination })
}

func WriteJSON(path string, v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return os.WriteFile(path, data, 0o644)
}

// DefaultCapabilities are containerd's default set for a container.
var DefaultCapabilities = []string{"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
	"CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE"}
