package plugin

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// inventoryPoll is how often the plugin looks for changes made outside it
// (someone ran nvidia-smi mig, a GPU vanished without an event).
const inventoryPoll = 15 * time.Second

// fingerprint captures what in an inventory changes the published devices:
// the driver's versions (an upgrade under the running plugin), the GPUs,
// their MIG mode and the MIG devices someone else made. The driver's own
// MIG devices (managed) change nothing published.
func fingerprint(inv *nvdevice.Inventory, managed map[string]bool) string {
	parts := []string{"driver=" + inv.DriverVersion + "/" + inv.CUDADriverVersion}
	for _, g := range inv.GPUs {
		parts = append(parts, fmt.Sprintf("%s/mig=%t", g.UUID, g.MIG.Enabled))
		for _, d := range g.MIG.Devices {
			if !managed[d.UUID] {
				parts = append(parts, fmt.Sprintf("%s/%s@%d", g.UUID, d.UUID, d.Placement.Start))
			}
		}
	}
	sort.Strings(parts)
	return strings.Join(parts, ",")
}

// checkInventory republishes when the node's devices changed since last seen.
func (d *Driver) checkInventory(ctx context.Context, last *string) {
	inv, err := d.backend.Inventory(ctx)
	if d.noteDriverLoaded(ctx, err) {
		d.republish(ctx)
		d.notifyHealthChanged()
	}
	if err != nil {
		klog.FromContext(ctx).Error(err, "Reading GPUs failed")
		return
	}
	managed, err := d.state.ManagedMigDevices(ctx)
	if err != nil {
		klog.FromContext(ctx).Error(err, "Reading the driver's MIG devices failed")
		return
	}
	if fp := fingerprint(inv, managed); fp != *last {
		if *last != "" {
			klog.FromContext(ctx).Info("GPUs changed outside the driver; republishing")
			d.republish(ctx)
		}
		*last = fp
	}
}

// watchInventory polls, at once and then every inventoryPoll, until ctx is
// done.
func (d *Driver) watchInventory(ctx context.Context) {
	var last string
	wait.UntilWithContext(ctx, func(ctx context.Context) { d.checkInventory(ctx, &last) }, inventoryPoll)
}
