//go:build cgo && linux

package nvml

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/NVIDIA/go-nvlib/pkg/nvlib/device"
	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// Backend is the real GPU model. NVML is initialised once in New and shut
// down in Close; every call into NVML happens between the two: the methods
// run under the lifecycle lock, and Close waits for the health event loop to
// stop and for a telemetry pass under way to end before it shuts NVML down
// (go-nvml dlcloses the library at shutdown, so a late call would crash the
// process).
//
// A telemetry pass holds the lifecycle lock only while it reads one GPU's
// inventory entry, never across its readings (telemetry.go): a prepare
// waits for at most one GPU's entry, not for a pass, and a reading that
// hangs holds up no prepare. NVML is thread-safe; the lock keeps the
// backend's own changes (MIG create and delete) from interleaving.
type Backend struct {
	lib    nvml.Interface
	devlib device.Interface // go-nvlib, for MIG profile names
	sysfs  string           // root of /sys, for NUMA node and PCIe root look-ups
	health *nvdevice.HealthBroadcaster

	// passMu is held for a whole telemetry pass, and by Close before mu:
	// one pass at a time, and NVML stays up until the pass ends. It
	// guards pass.
	passMu sync.Mutex

	mu     sync.Mutex
	closed bool
	// migChanges counts the MIG changes begun through the backend: a
	// telemetry fast pass reads the devices again when it moved, and so
	// does the inventory snapshot.
	migChanges uint64
	// snap is the inventory snapshot prepares read (snapshot.go): made at
	// snapAt, when migChanges was snapChanges; never modified.
	snap        *nvdevice.Inventory
	snapAt      time.Time
	snapChanges uint64
	snapEvents  uint64
	// snapTTL is InventorySnapshotTTL where zero (benchmarks set the
	// one before).
	snapTTL time.Duration
	// healthEvents counts the health events published (a GPU lost, an
	// XID, a recovery): the inventory snapshot is read again after one.
	// Atomic: the event loop runs outside mu.
	healthEvents atomic.Uint64
	// symMu guards symbols: a pass reads them outside mu.
	symMu    sync.Mutex
	symbols  map[string]bool
	stopLoop context.CancelFunc // stops the health event loop
	loopDone chan struct{}      // closed when the event loop has returned
	// tracker decides when an unhealthy GPU has recovered; the event loop
	// runs its checks.
	tracker *recoveryTracker
	// eventWait bounds one wait on the event set (defaultEventWait if zero).
	eventWait time.Duration
	// opts are what New was given: Host reads its ProcRoot and
	// ComputePolicy.
	opts Options
	// pass is what one telemetry pass keeps for the next (gpm.go), under
	// passMu; now is the clock process utilization is read since.
	pass passState
	now  func() time.Time
}

var _ nvdevice.Interface = (*Backend)(nil)

// New finds libnvidia-ml.so.1 under the driver root, loads and initialises
// NVML. Without the library it returns an error wrapping
// nvdevice.ErrLibraryNotFound and never loads anything.
func New(ctx context.Context, opts Options) (nvdevice.Interface, error) {
	path, err := FindLibrary(opts)
	if err != nil {
		return nil, err
	}
	lib := nvml.New(nvml.WithLibraryPath(path))
	switch ret := lib.Init(); ret {
	case nvml.SUCCESS:
	case nvml.ERROR_LIBRARY_NOT_FOUND:
		return nil, fmt.Errorf("%w: %s exists but could not be loaded", nvdevice.ErrLibraryNotFound, path)
	default:
		return nil, fmt.Errorf("initialise NVML from %s: %w", path, &nvmlError{op: "nvmlInit", ret: ret})
	}
	klog.FromContext(ctx).V(2).Info("NVML initialised", "library", path)
	b := newBackend(lib, "/sys", device.New(lib))
	b.opts = opts
	return b, nil
}

func newBackend(lib nvml.Interface, sysfs string, devlib device.Interface) *Backend {
	return &Backend{
		lib: lib, devlib: devlib, sysfs: sysfs,
		health:  nvdevice.NewHealthBroadcaster(),
		symbols: map[string]bool{},
		pass:    newPassState(),
		now:     time.Now,
	}
}

// Host reads the node's device majors from the proc root now, and its MIG
// capability minors from there at every call; the compute policy is the
// one New was given. It does not call NVML.
func (b *Backend) Host(context.Context) (nvdevice.Host, error) {
	return hostOf(b.opts)
}

// Close stops the health event loop, ends every watcher and shuts NVML down,
// once the telemetry pass under way (if any) has ended. It is safe to call
// twice.
func (b *Backend) Close() error {
	b.passMu.Lock()
	defer b.passMu.Unlock()
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil
	}
	b.closed = true
	if b.stopLoop != nil {
		b.stopLoop()
		<-b.loopDone // at most one event wait
	}
	b.health.Close()
	b.freePassState() // NVML's GPM buffers, while NVML is still there
	return check(b.lib.Shutdown(), "nvmlShutdown")
}

var errClosed = errors.New("NVML backend is closed")

// locked runs f with NVML known to be initialised.
func (b *Backend) locked(f func() error) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return errClosed
	}
	return f()
}

// hasSymbol says whether the loaded libnvidia-ml has a function. Calls that
// newer drivers added are guarded with it: calling a missing symbol kills the
// process. The caller holds b.mu or b.passMu (NVML is up).
func (b *Backend) hasSymbol(name string) bool {
	b.symMu.Lock()
	defer b.symMu.Unlock()
	has, ok := b.symbols[name]
	if !ok {
		has = b.lib.Extensions().LookupSymbol(name) == nil
		b.symbols[name] = has
	}
	return has
}
