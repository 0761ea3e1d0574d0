package plugin

import (
	"context"
	"errors"

	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// driverNotLoaded is the unhealthy taint's value on every GPU while the
// NVIDIA driver is not loaded (an upgrade or reload under the plugin).
const driverNotLoaded = "driver-not-loaded"

// noteDriverLoaded records whether an inventory read (its error) found the
// driver loaded, and reports whether that changed. A driver upgrade or
// reload is seen by the inventory poll: while the driver is gone every GPU
// is tainted (NoSchedule keeps new claims off; prepares fail with the
// backend's error) and prepared claims stay in the checkpoint; when it is
// back the taints go and the slices carry the new driverVersion (the
// inventory's fingerprint holds the versions).
func (d *Driver) noteDriverLoaded(ctx context.Context, readErr error) bool {
	gone := errors.Is(readErr, nvdevice.ErrDriverNotLoaded)
	d.mu.Lock()
	changed := d.driverGone != gone
	d.driverGone = gone
	d.mu.Unlock()
	if changed {
		logger := klog.FromContext(ctx)
		if gone {
			logger.Info("The NVIDIA driver is not loaded: every GPU is tainted until it is back; prepared claims are kept", "taint", UnhealthyTaintKey+"="+driverNotLoaded)
		} else {
			logger.Info("The NVIDIA driver is loaded again: republishing")
		}
	}
	return changed
}

// lastInventoryWithoutDriver is the inventory of the last build when err
// says the driver is not loaded (nil otherwise, or before any build): the
// devices stay published as they were, tainted, rather than withdrawn,
// so that a claim allocated before the outage keeps its device.
func (d *Driver) lastInventoryWithoutDriver(err error) *nvdevice.Inventory {
	if !errors.Is(err, nvdevice.ErrDriverNotLoaded) {
		return nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.driverGone = true
	return d.builtFrom
}
