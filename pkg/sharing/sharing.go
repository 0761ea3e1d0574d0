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
	"slices"

	"k8s.io/klog/v2"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
)

// Device is one prepared device of a claim.
type Device struct {
	// Name is the DRA device name.
	Name string
	// UUID is what the container sees (GPU or MIG UUID).
	UUID string
	// GPUUUID is the physical GPU (the UUID itself for a full GPU).
	GPUUUID string
	// Mig says the device is a MIG device.
	Mig bool
	// MemoryBytes and Multiprocessors are the device's (or the share's).
	MemoryBytes     int64
	Multiprocessors int64
	// Share is set when the device is one consumable-capacity share of a
	// GPU that other claims share too.
	Share *Share
}

// Share is what a claim consumes of a shared GPU.
type Share struct {
	ID              string
	MemoryBytes     int64
	Multiprocessors int64
	// GPUMultiprocessors is the whole GPU's count, to turn the share into
	// a percentage.
	GPUMultiprocessors int64
}

// Claim is a claim as the strategies see it.
type Claim struct {
	UID       string
	Namespace string
	Name      string
	Devices   []Device
	Sharing   gpuapi.Sharing
}

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
	Prepare(ctx context.Context, c Claim) (Edits, error)
	// Unprepare undoes Prepare. others are the claims still prepared on
	// the node, for settings that belong to a GPU rather than a claim.
	Unprepare(ctx context.Context, c Claim, others []Claim) error
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
	// MPSControl runs nvidia-cuda-mps-control.
	MPSControl MPSControl
	// OnDaemonRestart is told when an MPS daemon that had died was started
	// again (for logs, metrics and events).
	OnDaemonRestart func(c Claim, err error)
}

// NewManager builds the strategies.
func NewManager(opts Options) (*Manager, error) {
	if opts.Root == "" {
		return nil, errors.New("sharing: Root is required")
	}
	mps := newMPS(filepath.Join(opts.Root, "mps"), opts.MPSControl, opts.OnDaemonRestart)
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

// MPS is the MPS strategy, for its supervision loop.
func (m *Manager) MPS() *MPS { return m.mps }

func (m *Manager) strategy(c Claim) (Strategy, error) {
	name := c.Sharing.Strategy
	if name == "" {
		name = gpuapi.Exclusive
	}
	s, ok := m.strategies[name]
	if !ok {
		return nil, fmt.Errorf("claim %s/%s: sharing.strategy %q is not supported", c.Namespace, c.Name, name)
	}
	return s, nil
}

// Prepare sets up the claim's sharing and returns the container edits.
func (m *Manager) Prepare(ctx context.Context, c Claim) (Edits, error) {
	s, err := m.strategy(c)
	if err != nil {
		return Edits{}, err
	}
	edits, err := s.Prepare(ctx, c)
	if err != nil {
		return Edits{}, fmt.Errorf("claim %s/%s: %s sharing: %w", c.Namespace, c.Name, c.Sharing.Strategy, err)
	}
	if c.Sharing.IPC {
		ipc, err := m.ipc.prepare(c)
		if err != nil {
			return Edits{}, fmt.Errorf("claim %s/%s: IPC directory: %w", c.Namespace, c.Name, err)
		}
		edits.merge(ipc)
	}
	return edits, nil
}

// Unprepare undoes Prepare; others are the claims that stay prepared.
func (m *Manager) Unprepare(ctx context.Context, c Claim, others []Claim) error {
	s, err := m.strategy(c)
	if err != nil {
		return err
	}
	if err := s.Unprepare(ctx, c, others); err != nil {
		return fmt.Errorf("claim %s/%s: %s sharing: %w", c.Namespace, c.Name, c.Sharing.Strategy, err)
	}
	if err := m.ipc.remove(c.UID); err != nil {
		return fmt.Errorf("claim %s/%s: IPC directory: %w", c.Namespace, c.Name, err)
	}
	return nil
}

// Resume is called at start with the claims the checkpoint says are
// prepared: MPS daemons still running are adopted (never started twice),
// dead ones are started again, and directories of claims nobody knows
// (a kill between setup and checkpoint) are removed with their daemons.
func (m *Manager) Resume(ctx context.Context, prepared []Claim) error {
	known := map[string]bool{}
	for _, c := range prepared {
		known[c.UID] = true
	}
	var errs []error
	if err := m.mps.resume(ctx, prepared, known); err != nil {
		errs = append(errs, err)
	}
	if err := m.ipc.removeUnknown(ctx, known); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// exclusive is the default: nothing to set up.
type exclusive struct{}

func (exclusive) Prepare(context.Context, Claim) (Edits, error)   { return Edits{}, nil }
func (exclusive) Unprepare(context.Context, Claim, []Claim) error { return nil }

// ipcDirs are the per-claim IPC directories.
type ipcDirs struct{ root string }

func (d *ipcDirs) prepare(c Claim) (Edits, error) {
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

// gpusOf lists the physical GPUs of a claim's devices, once each.
func gpusOf(c Claim) []string {
	var out []string
	for _, d := range c.Devices {
		if !slices.Contains(out, d.GPUUUID) {
			out = append(out, d.GPUUUID)
		}
	}
	return out
}
