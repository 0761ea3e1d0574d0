package sharing

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
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

// MPS runs one MPS control daemon per claim (one per sharing group: every
// pod of the claim is a client of it), with its own pipe and log
// directories, and keeps it running.
type MPS struct {
	root      string
	control   MPSControl
	onRestart func(prepared.Claim, error)
	// procRoot is where process identities are read (/proc).
	procRoot string

	mu      sync.Mutex
	daemons map[string]*mpsDaemon // claim UID
}

type mpsDaemon struct {
	claim prepared.Claim
	pid   int
	// id is the daemon's process identity: nothing is adopted or stopped
	// whose pid names another process now.
	id       procIdentity
	env      []string
	commands []string
}

func newMPS(root string, control MPSControl, onRestart func(prepared.Claim, error)) *MPS {
	if onRestart == nil {
		onRestart = func(prepared.Claim, error) {}
	}
	return &MPS{root: root, control: control, onRestart: onRestart, daemons: map[string]*mpsDaemon{}, procRoot: "/proc"}
}

// MPSLimits are the daemon defaults for a claim: a pinned memory limit per
// device (in CUDA_VISIBLE_DEVICES order) and an active thread percentage.
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

// commands are what the control daemon is told after it starts.
func (l MPSLimits) commands() []string {
	var out []string
	if l.ThreadPercentage > 0 {
		out = append(out, fmt.Sprintf("set_default_active_thread_percentage %d", l.ThreadPercentage))
	}
	for i, mib := range l.PinnedMiB {
		if mib > 0 {
			out = append(out, fmt.Sprintf("set_default_device_pinned_mem_limit %d %dM", i, mib))
		}
	}
	return out
}

// env is what every client gets: the pipe directory, and the limits again
// (a client may lower them, and tools read them there).
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

func (m *MPS) dirs(uid string) (dir, pipe, log string) {
	dir = filepath.Join(m.root, uid)
	return dir, filepath.Join(dir, "pipe"), filepath.Join(dir, "log")
}

func (m *MPS) daemonEnv(c prepared.Claim) []string {
	_, pipe, log := m.dirs(c.UID)
	uuids := make([]string, 0, len(c.Devices))
	for _, d := range c.Devices {
		uuids = append(uuids, d.UUID)
	}
	return []string{"CUDA_MPS_PIPE_DIRECTORY=" + pipe, "CUDA_MPS_LOG_DIRECTORY=" + log,
		"CUDA_VISIBLE_DEVICES=" + strings.Join(uuids, ",")}
}

// Prepare starts the claim's daemon (or adopts the one already running for
// it) and sets its defaults.
func (m *MPS) Prepare(ctx context.Context, c prepared.Claim) (Edits, error) {
	if m.control == nil {
		return Edits{}, errors.New("this node has no MPS control binary configured (--mps-control-binary)")
	}
	limits, err := MPSLimitsFor(c)
	if err != nil {
		return Edits{}, err
	}
	dir, pipe, log := m.dirs(c.UID)
	for _, d := range []string{pipe, log} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return Edits{}, err
		}
	}
	d := &mpsDaemon{claim: c, env: m.daemonEnv(c), commands: limits.commands()}
	if id, ok := m.running(ctx, dir); ok {
		d.pid, d.id = id.PID, id
		klog.FromContext(ctx).V(2).Info("MPS daemon already running for the claim", "claim", klog.KRef(c.Namespace, c.Name), "pid", id.PID)
	} else if err := m.start(ctx, d); err != nil {
		return Edits{}, err
	}
	if err := m.configure(ctx, d); err != nil {
		m.stop(ctx, c.UID, d.id)
		return Edits{}, err
	}
	m.mu.Lock()
	m.daemons[c.UID] = d
	m.mu.Unlock()
	return Edits{Env: limits.env(), Mounts: []Mount{{HostPath: pipe, ContainerPath: MPSPipeDirectory}}}, nil
}

// Unprepare stops the claim's daemon and removes its directories.
func (m *MPS) Unprepare(ctx context.Context, c prepared.Claim, _ []prepared.Claim) error {
	m.mu.Lock()
	d := m.daemons[c.UID]
	delete(m.daemons, c.UID)
	m.mu.Unlock()
	dir, _, _ := m.dirs(c.UID)
	var id procIdentity
	if d != nil {
		id = d.id
	} else if running, ok := m.running(ctx, dir); ok {
		id = running
	}
	m.stop(ctx, c.UID, id)
	return os.RemoveAll(dir)
}

func (m *MPS) start(ctx context.Context, d *mpsDaemon) error {
	dir, _, _ := m.dirs(d.claim.UID)
	pid, err := m.control.Start(d.env)
	if err != nil {
		return fmt.Errorf("start the MPS control daemon: %w", err)
	}
	id, err := readProcIdentity(m.procRoot, pid)
	if err == nil {
		err = writeIdentity(dir, id)
	}
	if err != nil {
		_ = m.control.Kill(pid) // just started by this process: still ours
		return fmt.Errorf("record the MPS daemon's identity: %w", err)
	}
	d.pid, d.id = pid, id
	klog.FromContext(ctx).Info("MPS control daemon started", "claim", klog.KRef(d.claim.Namespace, d.claim.Name), "pid", pid)
	return nil
}

// configure sends the defaults, retrying while the daemon comes up.
func (m *MPS) configure(ctx context.Context, d *mpsDaemon) error {
	for _, cmd := range d.commands {
		var err error
		for attempt := 0; attempt < 50; attempt++ {
			if err = m.control.Command(ctx, d.env, cmd); err == nil {
				break
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(100 * time.Millisecond):
			}
		}
		if err != nil {
			return fmt.Errorf("MPS control %q: %w", cmd, err)
		}
	}
	return nil
}

// stop asks the daemon to quit, then kills it if it does not. A pid that
// names another process now is left alone.
func (m *MPS) stop(ctx context.Context, uid string, id procIdentity) {
	pid := id.PID
	if pid <= 0 || !m.control.Alive(pid) {
		return
	}
	if err := id.check(m.procRoot); err != nil {
		klog.FromContext(ctx).Info("Not stopping a process that is not the claim's MPS daemon", "uid", uid, "reason", err.Error())
		return
	}
	_, pipe, log := m.dirs(uid)
	env := []string{"CUDA_MPS_PIPE_DIRECTORY=" + pipe, "CUDA_MPS_LOG_DIRECTORY=" + log}
	qctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	_ = m.control.Command(qctx, env, "quit")
	cancel()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) && m.control.Alive(pid) {
		time.Sleep(20 * time.Millisecond)
	}
	if m.control.Alive(pid) && id.check(m.procRoot) == nil {
		klog.FromContext(ctx).Info("MPS daemon did not quit; killing it", "pid", pid)
		_ = m.control.Kill(pid)
	}
}

// running reads the daemon's recorded identity and checks that the
// process is still that daemon. A pid file that names another process now
// (recycled, or another PID namespace's) is not trusted.
func (m *MPS) running(ctx context.Context, dir string) (procIdentity, bool) {
	if m.control == nil {
		return procIdentity{}, false
	}
	id, err := verifyIdentity(m.procRoot, dir)
	if err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			klog.FromContext(ctx).Info("Recorded MPS daemon is not running", "dir", dir, "reason", err.Error())
		}
		return procIdentity{}, false
	}
	if !m.control.Alive(id.PID) {
		return procIdentity{}, false
	}
	return id, true
}

// Daemons returns claim UID -> pid of the daemons being supervised.
func (m *MPS) Daemons() map[string]int {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := map[string]int{}
	for uid, d := range m.daemons {
		out[uid] = d.pid
	}
	return out
}

// resume adopts the daemons of prepared MPS claims, starts the ones that
// died, and stops those of claims that are not prepared.
func (m *MPS) resume(ctx context.Context, claims []prepared.Claim, known map[string]bool) error {
	var errs []error
	for _, c := range claims {
		if c.Strategy() != gpuapi.MPS {
			continue
		}
		dir, _, _ := m.dirs(c.UID)
		limits, err := MPSLimitsFor(c)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		d := &mpsDaemon{claim: c, env: m.daemonEnv(c), commands: limits.commands()}
		if id, ok := m.running(ctx, dir); ok {
			d.pid, d.id = id.PID, id
			klog.FromContext(ctx).Info("Adopted the running MPS daemon of a prepared claim", "claim", klog.KRef(c.Namespace, c.Name), "pid", id.PID)
		} else {
			err := m.restart(ctx, d)
			m.onRestart(c, err)
			if err != nil {
				errs = append(errs, err)
			}
		}
		m.mu.Lock()
		m.daemons[c.UID] = d
		m.mu.Unlock()
	}
	entries, err := os.ReadDir(m.root)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	}
	for _, e := range entries {
		if known[e.Name()] {
			continue
		}
		dir := filepath.Join(m.root, e.Name())
		id, _ := m.running(ctx, dir)
		klog.FromContext(ctx).Info("Stopping the MPS daemon of a claim that is not prepared", "uid", e.Name(), "pid", id.PID)
		m.stop(ctx, e.Name(), id)
		errs = append(errs, os.RemoveAll(dir))
	}
	return errors.Join(errs...)
}

func (m *MPS) restart(ctx context.Context, d *mpsDaemon) error {
	_, pipe, log := m.dirs(d.claim.UID)
	for _, dir := range []string{pipe, log} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
	}
	if err := m.start(ctx, d); err != nil {
		return err
	}
	return m.configure(ctx, d)
}

// Run restarts daemons that die, until ctx ends; each restart is reported
// through OnDaemonRestart.
func (m *MPS) Run(ctx context.Context, every time.Duration) {
	wait.UntilWithContext(ctx, m.restartDead, every)
}

// restartDead starts again every supervised daemon that is not running.
func (m *MPS) restartDead(ctx context.Context) {
	m.mu.Lock()
	var dead []*mpsDaemon
	for _, d := range m.daemons {
		if !m.control.Alive(d.pid) {
			dead = append(dead, d)
		}
	}
	m.mu.Unlock()
	for _, d := range dead {
		klog.FromContext(ctx).Info("MPS daemon died; starting it again", "claim", klog.KRef(d.claim.Namespace, d.claim.Name), "pid", d.pid)
		// A new record, published only once the daemon is configured:
		// readers never see a half-started daemon.
		fresh := &mpsDaemon{claim: d.claim, env: d.env, commands: d.commands}
		err := m.restart(ctx, fresh)
		if ctx.Err() != nil {
			return
		}
		m.onRestart(d.claim, err)
		m.mu.Lock()
		if m.daemons[d.claim.UID] == d { // not unprepared meanwhile
			m.daemons[d.claim.UID] = fresh
		} else if fresh.pid > 0 {
			m.mu.Unlock()
			m.stop(ctx, d.claim.UID, fresh.id)
			continue
		}
		m.mu.Unlock()
	}
}
