package nvdevice

import (
	"context"
	"errors"
)

// Inventorier reads what a node has.
type Inventorier interface {
	// Inventory returns a consistent snapshot of the node's GPUs. The
	// returned value is owned by the caller.
	Inventory(ctx context.Context) (*Inventory, error)
}

// InventorySnapshotter is a backend that keeps the node's inventory as a
// snapshot that it replaces when the node changes and never modifies, and
// can hand that out without a copy for each caller.
//
// A type that embeds such a backend to change what Inventory returns must
// hide InventorySnapshot too (ReadOnlyInventory would call the embedded
// one).
type InventorySnapshotter interface {
	// InventorySnapshot is Inventory without the caller's own copy: the
	// same value for every caller until the node changes. Nobody may
	// modify it. It fails when Inventory would.
	InventorySnapshot(ctx context.Context) (*Inventory, error)
}

// ReadOnlyInventory is b's snapshot where b keeps one
// (InventorySnapshotter), else what b.Inventory returns. The caller reads
// it and never modifies it: another caller may hold the same value. The
// same pointer from two calls means the node did not change in between.
func ReadOnlyInventory(ctx context.Context, b Inventorier) (*Inventory, error) {
	if s, ok := b.(InventorySnapshotter); ok {
		return s.InventorySnapshot(ctx)
	}
	return b.Inventory(ctx)
}

// MigManager creates and destroys MIG devices (a GPU instance with one
// compute instance spanning it).
type MigManager interface {
	// CreateMigDevice creates a GPU instance of the given profile at the given
	// placement on the parent GPU, and a compute instance that spans it.
	CreateMigDevice(ctx context.Context, req MigCreateRequest) (*MigDevice, error)
	// DeleteMigDevice destroys the compute instance and then the GPU instance
	// of a MIG device. Deleting a MIG device that no longer exists returns an
	// error wrapping ErrNotFound. A GPU instance of ref.GPUInstanceID left
	// without compute instances (by a failed GPU-instance destroy, or a kill)
	// is destroyed, so that a retry after a failure finishes the job.
	DeleteMigDevice(ctx context.Context, ref MigDeviceRef) error
	// DeleteMigPlacement destroys every compute instance of the GPU instance
	// of ref.Profile at ref.Start, then the GPU instance. No GPU instance
	// there: an error wrapping ErrNotFound. A GPU instance left without
	// compute instances (by a kill, or by a failed GI destroy) is destroyed
	// too. Every step may be repeated after a failure.
	DeleteMigPlacement(ctx context.Context, ref MigPlacementRef) error
}

// MigPlacementRef names the GPU instance of a profile at a placement: what
// the plugin records before it creates anything, so that a kill between the
// GPU instance and the compute instance is still found.
type MigPlacementRef struct {
	ParentUUID string
	Profile    string // GPU-instance profile name, "3g.40gb"
	Start      int    // placement start, memory slices
	// UUID, when set, is the MIG device the caller created there: a GI whose
	// compute instance has another UUID is not the caller's and is left
	// alone (ErrNotFound).
	UUID string
}

// HealthWatcher streams health events.
type HealthWatcher interface {
	// WatchHealth delivers health events until ctx is done, then closes the
	// channel. Several watchers may be active at the same time.
	WatchHealth(ctx context.Context) (<-chan HealthEvent, error)
}

// Interface is everything a backend offers.
type Interface interface {
	Inventorier
	MigManager
	HealthWatcher
	DriverFiler
	// Host returns what the plugin needs about the node beyond its GPUs:
	// device majors, MIG capability minors and the compute policy. The
	// plugin calls it once at start.
	Host(ctx context.Context) (Host, error)
	// Close releases the backend (NVML shutdown). It is safe to call twice.
	Close() error
}

// Errors a backend wraps so that callers can react without knowing the
// backend. They mirror the NVML return codes the hardware gives.
var (
	// ErrLibraryNotFound: the NVIDIA driver library could not be loaded.
	ErrLibraryNotFound = errors.New("NVIDIA driver library not found")
	// ErrNotFound: no such GPU, MIG device or profile.
	ErrNotFound = errors.New("not found")
	// ErrMigDisabled: the operation needs MIG mode enabled on the GPU.
	ErrMigDisabled = errors.New("MIG mode is not enabled")
	// ErrInvalidPlacement: the placement is not one the profile allows
	// (NVML_ERROR_INVALID_ARGUMENT).
	ErrInvalidPlacement = errors.New("invalid placement for profile")
	// ErrInsufficientResources: the placement overlaps an existing GPU
	// instance, or the GPU has no engines or instances left for the profile
	// (NVML_ERROR_INSUFFICIENT_RESOURCES).
	ErrInsufficientResources = errors.New("insufficient resources")
	// ErrGPULost: the GPU fell off the bus (NVML_ERROR_GPU_IS_LOST).
	ErrGPULost = errors.New("GPU is lost")
	// ErrDriverNotLoaded: the NVIDIA kernel driver is not loaded, as during
	// a driver upgrade or reload (NVML_ERROR_DRIVER_NOT_LOADED).
	ErrDriverNotLoaded = errors.New("NVIDIA driver is not loaded")
	// ErrInUse: a MIG device still has processes or compute instances
	// (NVML_ERROR_IN_USE).
	ErrInUse = errors.New("in use")
)
