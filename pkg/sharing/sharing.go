// Package sharing sets up how a claim's GPUs are shared: one Strategy per
// mode (exclusive, time-slicing, MPS), chosen by the claim's GpuConfig, plus
// the per-claim IPC directory that pods sharing one claim can use. The
// kubelet plugin calls the Manager at prepare and unprepare; nothing in the
// prepare path branches on the mode.
//
// What each mode enforces is documented on gpuapi.SharingStrategy and in
// docs/sharing.md; the strategies never claim more than that.
package sharing

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"time"

	"k8s.io/klog/v2"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
	"github.com/gpudra/gpudra/pkg/prepared"
)

// Mount is a host directory given to every container of a claim.
type Mount struct {
	HostPath      string
	ContainerPath string
}

// Edits are what sharing adds to every container of a claim.
type Edits struct {
	Env    map[string]string
	Mounts []Mount
}

func (e *Edits) merge(o Edits) {
	if e.Env == nil {
		e.Env = map[string]string{}
	}
	maps.Copy(e.Env, o.Env)
	e.Mounts = append(e.Mounts, o.Mounts...)
}

// Strategy is one sharing mode.
type Strategy interface {
	// Prepare sets the claim's devices up and returns the container edits.
	// It must be repeatable: a prepare interrupted by a restart runs again.
	Prepare(ctx context.Context, c prepared.Claim) (Edits, error)
	// Unprepare undoes Prepare. others are the claims still prepared on
	// the node, for settings that belong to a GPU rather than a claim.
	Unprepare(ctx context.Context, c prepared.Claim, others []prepared.Claim) error
}

// Manager picks the strategy for each claim.
type Manager struct {
	strategies map[gpuapi.SharingStrategy]Strategy
	ipc        *ipcDirs
	mps        *MPS
}

// Options configure the Manager.
type Options struct {
	// Root holds per-claim state (MPS pipe and log directories, IPC
	// directories): the plugin's data directory.
	Root string
	// Policy sets GPU time slices.
	Policy TimeSlicer
	// MPSControl runs nvidia-cuda-mps-control (as a control client, and as
	// the daemon for ProcessServers).
	MPSControl MPSControl
	// MPSServers run the MPS servers; nil: ProcessServers under Root.
	MPSServers MPSServers
	// MPSReadyTimeout bounds the wait for a new MPS server to answer; 0:
	// 40 s (the kubelet's prepare call gives up after 45).
	MPSReadyTimeout time.Duration
	// OnDaemonRestart is told when the MPS server of prepared claims was
	// gone and was started again (for logs, metrics and events).
	OnDaemonRestart func(s MPSServer, err error)
}

// NewManager builds the strategies.
func NewManager(opts Options) (*Manager, error) {
	if opts.Root == "" {
		return nil, errors.New("sharing: Root is required")
	}
	mps := newMPS(MPSRoot(opts.Root), opts.MPSControl, opts.MPSServers, opts.MPSReadyTimeout, opts.OnDaemonRestart)
	return &Manager{
		strategies: map[gpuapi.SharingStrategy]Strategy{
			gpuapi.Exclusive:   exclusive{},
			gpuapi.TimeSlicing: &timeSlicing{policy: opts.Policy},
			gpuapi.MPS:         mps,
		},
		ipc: &ipcDirs{root: filepath.Join(opts.Root, "ipc")},
		mps: mps,
	}, nil
}

// MPSRoot is where the MPS servers' directories are, under the sharing
// root.
func MPSRoot(root string) string { return filepath.Join(root, "mps") }

// MPS is the MPS strategy.
func (m *Manager) MPS() *MPS { return m.mps }

// Supervise starts again what prepared claims need and is gone (an MPS
// server); the plugin calls it periodically under the node lock.
func (m *Manager) Supervise(ctx context.Context, claims []prepared.Claim) error {
	return m.mps.Supervise(ctx, claims)
}

func (m *Manager) strategy(c prepared.Claim) (Strategy, error) {
	name := c.Strategy()
	s, ok := m.strategies[name]
	if !ok {
		return nil, fmt.Errorf("claim %s/%s: sharing.strategy %q is not supported", c.Namespace, c.Name, name)
	}
	return s, nil
}

// Prepare sets up the claim's sharing and returns the container edits.
func (m *Manager) Prepare(ctx context.Context, c prepared.Claim) (Edits, error) {
	s, err := m.strategy(c)
	if err != nil {
		return Edits{}, err
	}
	edits, err := s.Prepare(ctx, c)
	if err != nil {
		return Edits{}, fmt.Errorf("claim %s/%s: %s sharing: %w", c.Namespace, c.Name, c.Strategy(), err)
	}
	if c.SharingConfig().IPC {
		ipc, err := m.ipc.prepare(c)
		if err != nil {
			return Edits{}, fmt.Errorf("claim %s/%s: IPC directory: %w", c.Namespace, c.Name, err)
		}
		edits.merge(ipc)
	}
	return edits, nil
}

// Unprepare undoes Prepare; others are the claims that stay prepared.
func (m *Manager) Unprepare(ctx context.Context, c prepared.Claim, others []prepared.Claim) error {
	s, err := m.strategy(c)
	if err != nil {
		return err
	}
	if err := s.Unprepare(ctx, c, others); err != nil {
		return fmt.Errorf("claim %s/%s: %s sharing: %w", c.Namespace, c.Name, c.Strategy(), err)
	}
	if err := m.ipc.remove(c.UID); err != nil {
		return fmt.Errorf("claim %s/%s: IPC directory: %w", c.Namespace, c.Name, err)
	}
	return nil
}

// Resume is called at start with the claims the checkpoint says are
// prepared: MPS servers still running are kept (never started twice),
// missing ones are started again, and servers and directories no prepared
// claim uses (a kill between setup and checkpoint) are removed.
func (m *Manager) Resume(ctx context.Context, claims []prepared.Claim) error {
	known := map[string]bool{}
	for _, c := range claims {
		known[c.UID] = true
	}
	var errs []error
	if err := m.mps.resume(ctx, claims); err != nil {
		errs = append(errs, err)
	}
	if err := m.ipc.removeUnknown(ctx, known); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// exclusive is the default: nothing to set up.
type exclusive struct{}

func (exclusive) Prepare(context.Context, prepared.Claim) (Edits, error) { return Edits{}, nil }
func (exclusive) Unprepare(context.Context, prepared.Claim, []prepared.Claim) error {
	return nil
}

// ipcDirs are the per-claim IPC directories.
type ipcDirs struct{ root string }

func (d *ipcDirs) prepare(c prepared.Claim) (Edits, error) {
	dir := filepath.Join(d.root, c.UID)
	// World-writable with the sticky bit: the consumers may run as any
	// user, and they are all consumers of this one claim.
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return Edits{}, err
	}
	if err := os.Chmod(dir, os.ModeSticky|0o777); err != nil {
		return Edits{}, err
	}
	return Edits{
		Env:    map[string]string{"GPUDRA_IPC_DIR": gpuapi.IPCDirectory},
		Mounts: []Mount{{HostPath: dir, ContainerPath: gpuapi.IPCDirectory}},
	}, nil
}

func (d *ipcDirs) remove(uid string) error {
	return os.RemoveAll(filepath.Join(d.root, uid))
}

func (d *ipcDirs) removeUnknown(ctx context.Context, known map[string]bool) error {
	entries, err := os.ReadDir(d.root)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range entries {
		if !known[e.Name()] {
			klog.FromContext(ctx).Info("Removing the IPC directory of a claim that is not prepared", "uid", e.Name())
			errs = append(errs, d.remove(e.Name()))
		}
	}
	return errors.Join(errs...)
}
