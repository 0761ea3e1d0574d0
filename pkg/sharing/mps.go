package sharing

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
	"github.com/gpudra/gpudra/pkg/prepared"
)

// MPSPipeDirectory is where a claim's MPS pipe directory appears in its
// containers.
const MPSPipeDirectory = "/var/run/gpudra/mps"

// MPS serves MPS claims from one MPS server per GPU (per device set: see
// MPSServer): the first claim on a GPU starts its server, the last one
// stops it. Each claim's limits go into its clients' environment, since one
// daemon serves every claim on the GPU.
type MPS struct {
	root      string
	control   MPSControl
	servers   MPSServers
	ready     time.Duration
	onRestart func(MPSServer, error)
}

func newMPS(root string, control MPSControl, servers MPSServers, ready time.Duration, onRestart func(MPSServer, error)) *MPS {
	if onRestart == nil {
		onRestart = func(MPSServer, error) {}
	}
	if servers == nil {
		servers = &ProcessServers{Root: root, Control: control}
	}
	if ready == 0 {
		ready = 40 * time.Second
	}
	return &MPS{root: root, control: control, servers: servers, ready: ready, onRestart: onRestart}
}

// MPSLimits are a claim's limits, set in its clients' environment: a
// pinned memory limit per device (in CUDA_VISIBLE_DEVICES order) and an
// active thread percentage.
// The plugin reports the same numbers in the claim's device status.
type MPSLimits struct {
	ThreadPercentage int64   // 0: not set
	PinnedMiB        []int64 // per device; 0: not set
}

// MPSLimitsFor derives the limits from the config and, for a share of a
// GPU, from what the share consumes: a share is capped at its size.
func MPSLimitsFor(c prepared.Claim) (MPSLimits, error) {
	var l MPSLimits
	var cfg gpuapi.MPSConfig
	if sc := c.SharingConfig(); sc.MPS != nil {
		cfg = *sc.MPS
	}
	if cfg.ActiveThreadPercentage != nil {
		l.ThreadPercentage = int64(*cfg.ActiveThreadPercentage)
	}
	for _, d := range c.Devices {
		var pinned int64
		if cfg.PinnedMemoryLimit != nil {
			pinned = cfg.PinnedMemoryLimit.Value()
			if pinned > d.MemoryBytes {
				what := "the memory of device " + d.Device
				if d.Share != nil {
					what = "the share of device " + d.Device + " this claim was allocated"
				}
				return l, fmt.Errorf("sharing.mps.pinnedMemoryLimit: %s exceeds %s (%s)", cfg.PinnedMemoryLimit.String(), what, resource.NewQuantity(d.MemoryBytes, resource.BinarySI).String())
			}
		}
		if s := d.Share; s != nil {
			if pinned == 0 {
				pinned = s.MemoryBytes
			}
			if cfg.ActiveThreadPercentage == nil && s.GPUMultiprocessors > 0 && s.Multiprocessors > 0 {
				pct := (s.Multiprocessors*100 + s.GPUMultiprocessors - 1) / s.GPUMultiprocessors
				l.ThreadPercentage = max(l.ThreadPercentage, min(pct, 100))
			}
		}
		l.PinnedMiB = append(l.PinnedMiB, (pinned+(1<<20)-1)>>20)
	}
	return l, nil
}

// env is what every client gets: the pipe directory and the claim's
// limits. They bind a client that keeps them; one that changes its
// environment is not bound (the status says so).
func (l MPSLimits) env() map[string]string {
	env := map[string]string{"CUDA_MPS_PIPE_DIRECTORY": MPSPipeDirectory}
	if l.ThreadPercentage > 0 {
		env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = strconv.FormatInt(l.ThreadPercentage, 10)
	}
	var limits []string
	for i, mib := range l.PinnedMiB {
		if mib > 0 {
			limits = append(limits, fmt.Sprintf("%d=%dM", i, mib))
		}
	}
	if len(limits) > 0 {
		env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = strings.Join(limits, ",")
	}
	return env
}

// serverOf is the server of a claim's devices.
func (m *MPS) serverOf(c prepared.Claim) MPSServer {
	uuids := make([]string, 0, len(c.Devices))
	for _, d := range c.Devices {
		uuids = append(uuids, d.UUID)
	}
	return MPSServerFor(m.root, uuids)
}

// Servers lists the MPS servers that exist on the node.
func (m *MPS) Servers(ctx context.Context) ([]MPSServer, error) { return m.servers.List(ctx) }

// Prepare starts the server of the claim's devices unless it runs, waits
// until it answers, and returns the clients' edits.
func (m *MPS) Prepare(ctx context.Context, c prepared.Claim) (Edits, error) {
	if m.control == nil {
		return Edits{}, errors.New("this node has no MPS control binary configured (--mps-control-binary)")
	}
	limits, err := MPSLimitsFor(c)
	if err != nil {
		return Edits{}, err
	}
	s := m.serverOf(c)
	if err := m.checkOverlap(ctx, s); err != nil {
		return Edits{}, err
	}
	started, err := m.servers.Ensure(ctx, s)
	if err != nil {
		return Edits{}, fmt.Errorf("MPS server for %s (%s): %w", strings.Join(s.Devices, ","), m.servers.Describe(s), err)
	}
	if !started {
		klog.FromContext(ctx).V(2).Info("MPS server already running for the claim's devices", "claim", klog.KRef(c.Namespace, c.Name), "server", s.Key)
	}
	if err := m.waitReady(ctx, s); err != nil {
		return Edits{}, err
	}
	return m.ClientEdits(s, limits), nil
}

// ClientEdits are what every client of server s gets: its pipe directory
// (and its /dev/shm when the server has its own) and the limits in the
// environment.
func (m *MPS) ClientEdits(s MPSServer, limits MPSLimits) Edits {
	edits := Edits{Env: limits.env(), Mounts: []Mount{{HostPath: s.PipeDir(), ContainerPath: MPSPipeDirectory}}}
	if m.servers.SharedShm() {
		edits.Mounts = append(edits.Mounts, Mount{HostPath: s.ShmDir(), ContainerPath: "/dev/shm"})
	}
	return edits
}

// ServerFor is the server of a fixed set of devices under this node's MPS
// root: the same server (and pod) a claim on those devices gets.
func (m *MPS) ServerFor(uuids []string) MPSServer { return MPSServerFor(m.root, uuids) }

// EnsureServer is the device plugin mode's use of MPS, which serves a
// fixed device set for the agent's lifetime rather than per claim: it
// starts the server unless it runs, waits until it answers, and, when it
// was started or configure is set, sends it commands (the daemon-wide
// defaults: set_default_active_thread_percentage, ...), which a daemon
// forgets when it restarts. started says whether it had to start it.
func (m *MPS) EnsureServer(ctx context.Context, s MPSServer, commands []string, configure bool) (started bool, err error) {
	if m.control == nil {
		return false, errors.New("this node has no MPS control binary configured (--mps-control-binary)")
	}
	if err := m.checkOverlap(ctx, s); err != nil {
		return false, err
	}
	started, err = m.servers.Ensure(ctx, s)
	if err != nil {
		return false, fmt.Errorf("MPS server for %s (%s): %w", strings.Join(s.Devices, ","), m.servers.Describe(s), err)
	}
	if !started && !configure {
		return false, nil
	}
	if err := m.waitReady(ctx, s); err != nil {
		return started, err
	}
	env, err := s.ClientEnv()
	if err != nil {
		return started, err
	}
	for _, c := range commands {
		if err := m.control.Command(ctx, env, c); err != nil {
			return started, fmt.Errorf("MPS server for %s (%s): %q: %w", strings.Join(s.Devices, ","), m.servers.Describe(s), c, err)
		}
	}
	return started, nil
}

// StopServer stops a server and removes its directory.
func (m *MPS) StopServer(ctx context.Context, s MPSServer) error { return m.remove(ctx, s) }

// checkOverlap refuses a server whose devices overlap another server's
// without being the same set: two control daemons would serve one GPU.
func (m *MPS) checkOverlap(ctx context.Context, s MPSServer) error {
	existing, err := m.servers.List(ctx)
	if err != nil {
		return fmt.Errorf("list the node's MPS servers: %w", err)
	}
	for _, o := range existing {
		if o.Key == s.Key {
			continue
		}
		for _, d := range o.Devices {
			if slices.Contains(s.Devices, d) {
				return fmt.Errorf("device %s is already served by the MPS server of other claims (devices %s): one MPS control daemon serves a GPU, so an MPS claim's devices must be the same as, or disjoint from, every other MPS claim's on the node",
					d, strings.Join(o.Devices, ","))
			}
		}
	}
	return nil
}

// waitReady waits until the server's daemon answers a control command.
func (m *MPS) waitReady(ctx context.Context, s MPSServer) error {
	env, err := s.ClientEnv()
	if err != nil {
		return err
	}
	var last error
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, m.ready, true, func(ctx context.Context) (bool, error) {
		err := m.control.Command(ctx, env, "get_server_list")
		// A command cut short by the deadline says nothing about the
		// daemon: the error of the one before says why it does not answer.
		if err != nil && (ctx.Err() == nil || last == nil) {
			last = err
		}
		return err == nil, nil
	})
	if err != nil {
		if last == nil {
			last = err
		}
		return fmt.Errorf("MPS server for %s (%s) does not answer after %s: %w", strings.Join(s.Devices, ","), m.servers.Describe(s), m.ready, last)
	}
	return nil
}

// Unprepare stops the claim's server unless another prepared MPS claim
// uses it.
func (m *MPS) Unprepare(ctx context.Context, c prepared.Claim, others []prepared.Claim) error {
	s := m.serverOf(c)
	for _, o := range others {
		if o.UID != c.UID && o.Strategy() == gpuapi.MPS && m.serverOf(o).Key == s.Key {
			klog.FromContext(ctx).V(2).Info("MPS server stays: other claims use it", "server", s.Key, "claim", klog.KRef(o.Namespace, o.Name))
			return nil
		}
	}
	return m.remove(ctx, s)
}

func (m *MPS) remove(ctx context.Context, s MPSServer) error {
	if err := m.servers.Stop(ctx, s); err != nil {
		return fmt.Errorf("stop the MPS server for %s (%s): %w", strings.Join(s.Devices, ","), m.servers.Describe(s), err)
	}
	return os.RemoveAll(s.Dir)
}

// wanted are the servers the prepared MPS claims use.
func (m *MPS) wanted(claims []prepared.Claim) map[string]MPSServer {
	out := map[string]MPSServer{}
	for _, c := range claims {
		if c.Strategy() == gpuapi.MPS {
			s := m.serverOf(c)
			out[s.Key] = s
		}
	}
	return out
}

// resume stops the servers no prepared claim uses (a kill between setup
// and checkpoint, or an earlier release's per-claim daemons), removes
// their directories, and starts the servers of prepared claims that are
// missing.
func (m *MPS) resume(ctx context.Context, claims []prepared.Claim) error {
	wanted := m.wanted(claims)
	var errs []error
	existing, err := m.servers.List(ctx)
	if err != nil {
		errs = append(errs, fmt.Errorf("list the node's MPS servers: %w", err))
	}
	for _, s := range existing {
		if _, ok := wanted[s.Key]; !ok {
			klog.FromContext(ctx).Info("Stopping an MPS server no prepared claim uses", "server", s.Key, "devices", s.Devices)
			errs = append(errs, m.remove(ctx, s))
		}
	}
	// Directories left without a server (a pod deleted while the plugin
	// was down), and an earlier release's per-claim directories.
	entries, err := os.ReadDir(m.root)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	}
	old := &ProcessServers{Root: m.root, Control: m.control}
	for _, e := range entries {
		if _, ok := wanted[e.Name()]; ok {
			continue
		}
		dir := filepath.Join(m.root, e.Name())
		errs = append(errs, old.Stop(ctx, MPSServer{Key: e.Name(), Dir: dir}), os.RemoveAll(dir))
	}
	if err := m.Supervise(ctx, claims); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// Supervise starts again the server of every prepared MPS claim that is
// gone (a daemon that died, a pod someone deleted); each is reported
// through OnDaemonRestart. The plugin calls it periodically under the node
// lock, with the claims the checkpoint holds, so that a server another
// plugin instance just stopped is never started again.
func (m *MPS) Supervise(ctx context.Context, claims []prepared.Claim) error {
	if m.control == nil {
		return nil
	}
	var errs []error
	for _, s := range m.wanted(claims) {
		started, err := m.servers.Ensure(ctx, s)
		if err != nil {
			err = fmt.Errorf("MPS server for %s (%s): %w", strings.Join(s.Devices, ","), m.servers.Describe(s), err)
			errs = append(errs, err)
		}
		if started || err != nil {
			m.onRestart(s, err)
		}
	}
	return errors.Join(errs...)
}
