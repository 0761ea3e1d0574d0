//go:build cgo

package nvml

import (
	"context"
	"fmt"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// Backend is the real GPU model. NVML is initialised once in New and shut
// down in Close; every method is guarded by the lifecycle lock so no call
// reaches NVML outside that window.
type Backend struct {
	lib    nvml.Interface
	sysfs  string // root of /sys, for NUMA and PCIe root look-ups
	health *nvdevice.HealthBroadcaster

	mu     sync.Mutex
	closed bool
	stop   context.CancelFunc // stops the event loop
}

var _ nvdevice.Interface = (*Backend)(nil)

// New loads NVML from the driver root and initialises it.
func New(ctx context.Context, opts Options) (nvdevice.Interface, error) {
	path, err := FindLibrary(opts)
	if err != nil {
		return nil, err
	}
	lib := nvml.New(nvml.WithLibraryPath(path))
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return nil, fmt.Errorf("initialise NVML from %s: %w", path, &nvmlError{op: "nvmlInit", ret: ret})
	}
	klog.FromContext(ctx).V(2).Info("NVML initialised", "library", path)
	return newBackend(lib, "/sys"), nil
}

func newBackend(lib nvml.Interface, sysfs string) *Backend {
	return &Backend{lib: lib, sysfs: sysfs, health: nvdevice.NewHealthBroadcaster()}
}

// Close shuts NVML down. It is safe to call twice.
func (b *Backend) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil
	}
	b.closed = true
	if b.stop != nil {
		b.stop()
	}
	b.health.Close()
	return check(b.lib.Shutdown(), "nvmlShutdown")
}

// locked runs f with NVML known to be initialised.
func (b *Backend) locked(f func() error) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return fmt.Errorf("NVML backend is closed")
	}
	return f()
}
