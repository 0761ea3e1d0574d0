package noderuntime

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	v1 "k8s.io/api/core/v1"
)

// MPSServerCommand is the command of the gpudra image's MPS server.
const MPSServerCommand = "gpudra-mps-server"

// ProcessContainer is a process pod's container (an MPS server) as the
// OCI runtime runs it: the pod's own command, environment, hostPath
// volumes and privileges, nothing translated (the container sees its
// volumes where the pod mounts them).
type ProcessContainer struct {
	Name string
	// Args are the container's command and arguments; the command is
	// looked up on the image's PATH.
	Args []string
	Env  []string
	// Mounts are the pod's hostPath volumes at their mount paths.
	Mounts     []oci.Mount
	Privileged bool
	// Devices are created in a privileged container's /dev: containerd
	// gives a privileged container every device node of the host; here
	// the node's NVIDIA ones (NvidiaDeviceNodes), which a real MPS control
	// daemon opens.
	Devices []oci.LinuxDevice
}

// PodProcessContainer is the pod's one container for the runtime; marker is
// added to its environment so that devcluster (and tests) can find every
// process it starts on the host's /proc.
func PodProcessContainer(pod *v1.Pod) ProcessContainer {
	c := pod.Spec.Containers[0]
	pc := ProcessContainer{Name: c.Name, Args: append(append([]string{}, c.Command...), c.Args...)}
	pc.Args[0] = path.Base(pc.Args[0])
	for _, e := range c.Env {
		if e.ValueFrom == nil {
			pc.Env = append(pc.Env, e.Name+"="+e.Value)
		}
	}
	pc.Env = append(pc.Env, ContainerMarker(string(pod.UID)))
	hostPaths := map[string]string{}
	for _, vol := range pod.Spec.Volumes {
		if vol.HostPath != nil {
			hostPaths[vol.Name] = vol.HostPath.Path
		}
	}
	for _, m := range c.VolumeMounts {
		h, ok := hostPaths[m.Name]
		if !ok {
			continue
		}
		opts := []string{"rbind", "rprivate", "rw"}
		if m.ReadOnly {
			opts[2] = "ro"
		}
		pc.Mounts = append(pc.Mounts, oci.Mount{Destination: m.MountPath, Type: "bind", Source: h, Options: opts})
	}
	if sc := c.SecurityContext; sc != nil && sc.Privileged != nil {
		pc.Privileged = *sc.Privileged
	}
	return pc
}

// imageBinDir is where a process container finds the project's binaries
// (gpudra-mps-server); it comes first on the image's PATH.
const imageBinDir = "/gpudra/bin"

// Run runs a process pod's container in the foreground until it exits (an
// error: the kubelet restarts it) or ctx ends: then the container gets
// SIGTERM, as the kubelet sends on deletion, and SIGKILL after
// stopTimeout. The container is deleted either way, so that the next Run
// of the same id starts afresh.
func (r *OCIRuntime) Run(ctx context.Context, id string, c ProcessContainer, stopTimeout time.Duration) error {
	if r.MPSServer == "" {
		return errors.New("real process containers need the static gpudra-mps-server (OCIRuntime.MPSServer)")
	}
	bundle := filepath.Join(r.Root, "bundles", id)
	state := filepath.Join(r.Root, "state")
	// A container of an earlier run that the kubelet lost (a crash) goes
	// first.
	if err := r.Stop(context.WithoutCancel(ctx), id); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(bundle, "rootfs"), 0o755); err != nil {
		return err
	}
	spec, err := r.processSpec(id, bundle, c)
	if err != nil {
		return err
	}
	if err := WriteJSON(filepath.Join(bundle, "config.json"), spec); err != nil {
		return err
	}
	log, err := os.OpenFile(filepath.Join(bundle, "output"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer log.Close()
	// Not CommandContext: killing runc run would leave its container
	// behind; the container is signalled through runc kill instead.
	cmd := exec.Command(r.Runc, "--root", state, "run", "--bundle", bundle, id)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("runc run %s: %w", id, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		if err := r.Stop(context.WithoutCancel(ctx), id); err != nil {
			fmt.Fprintf(log, "devcluster: %v\n", err)
		}
	}()
	select {
	case err := <-exited:
		out, _ := os.ReadFile(log.Name())
		return fmt.Errorf("container %s exited (%v): %s", id, err, LastLines(string(out), 5))
	case <-ctx.Done():
	}
	// To the container's init only: its PID namespace goes with it.
	kill := func(sig string) {
		// An error here is a container already gone.
		_ = exec.Command(r.Runc, "--root", state, "kill", id, sig).Run() //nolint:gosec // runc
	}
	kill("TERM")
	select {
	case <-exited:
		return nil
	case <-time.After(stopTimeout):
	}
	kill("KILL")
	<-exited
	return nil
}

// processSpec is a process container's OCI spec: its own PID, mount, IPC
// and UTS namespaces, the pod's hostPath volumes, and as its image the
// host's /usr (read-only) with gpudra-mps-server on the PATH. The host's
// userland stands in for the gpudra image (Debian, with bash and
// util-linux) because the MPS control stand-in the server runs is a bash
// script; a real nvidia-cuda-mps-control is run through the driver root's
// own loader and needs nothing of the image. Privileged as the pod says:
// every capability and every device.
func (r *OCIRuntime) processSpec(id, bundle string, c ProcessContainer) (*oci.Spec, error) {
	noImage := *r
	noImage.HostImage = false
	s, err := noImage.spec(id, bundle, &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{Resources: &oci.LinuxResources{}}})
	if err != nil {
		return nil, err
	}
	s.Process.Args = c.Args
	// No probe and no report: the pod's own command runs.
	s.Mounts = DeleteMount(DeleteMount(s.Mounts, reportDir), "/gpudra-probe")
	s.Process.Env = append([]string{"PATH=" + imageBinDir + ":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}, c.Env...)
	image, err := hostImageMounts(bundle)
	if err != nil {
		return nil, err
	}
	s.Mounts = append(s.Mounts, image...)
	s.Mounts = append(s.Mounts,
		oci.Mount{Destination: path.Join(imageBinDir, MPSServerCommand), Type: "bind", Source: r.MPSServer, Options: []string{"rbind", "ro"}})
	for _, m := range c.Mounts {
		s.Mounts = DeleteMount(s.Mounts, m.Destination)
		s.Mounts = append(s.Mounts, m)
	}
	if c.Privileged {
		caps := PrivilegedCapabilities()
		s.Process.Capabilities = &oci.LinuxCapabilities{Bounding: caps, Effective: caps, Permitted: caps}
		s.Process.NoNewPrivileges = false
		s.Linux.Resources.Devices = []oci.LinuxDeviceCgroup{{Allow: true, Access: "rwm"}}
		s.Linux.Devices = append(s.Linux.Devices, c.Devices...)
		s.Linux.MaskedPaths, s.Linux.ReadonlyPaths = nil, nil
	}
	return s, nil
}

// LastLines is the last n lines of s.
func LastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// PrivilegedCapabilities are a privileged container's: every capability
// this process may hand on (its bounding set), as containerd gives; one
// outside it fails the container's start.
func PrivilegedCapabilities() []string {
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return DefaultCapabilities
	}
	var bounding uint64
	for _, line := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, "CapBnd:"); ok {
			if bounding, err = strconv.ParseUint(strings.TrimSpace(v), 16, 64); err != nil {
				return DefaultCapabilities
			}
		}
	}
	var caps []string
	for bit, name := range capabilitiesByBit {
		if bounding&(1<<bit) != 0 {
			caps = append(caps, name)
		}
	}
	return caps
}

// capabilitiesByBit are Linux's capabilities, by their bit.
var capabilitiesByBit = []string{"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
	"CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE", "CAP_NET_BIND_SERVICE", "CAP_NET_BROADCAST",
	"CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_CHROOT",
	"CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE", "CAP_SYS_RESOURCE", "CAP_SYS_TIME",
	"CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE", "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP",
	"CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN", "CAP_SYSLOG", "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ",
	"CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE"}

// NvidiaDeviceNodes are the NVIDIA character devices under root's /dev
// (nvidiactl, nvidia-uvm, nvidia<N>, nvidia-caps/...), as a privileged
// container gets them, with the paths they have there.
func NvidiaDeviceNodes(root string) []oci.LinuxDevice {
	var out []oci.LinuxDevice
	for _, pattern := range []string{"dev/nvidia*", "dev/nvidia-caps/*"} {
		matches, _ := filepath.Glob(filepath.Join(root, pattern))
		for _, m := range matches {
			rel, err := filepath.Rel(root, m)
			if err != nil {
				continue
			}
			d, err := HostDevicesUnder(root)("/" + rel)
			if err != nil || d.Type != "c" {
				continue // a directory (nvidia-caps) or a vanished node
			}
			mode := os.FileMode(0o666)
			d.FileMode = &mode
			out = append(out, d)
		}
	}
	return out
}
