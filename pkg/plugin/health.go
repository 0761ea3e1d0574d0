package plugin

import (
	"context"
	"fmt"
	"maps"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// UnhealthyTaintKey marks devices of an unhealthy GPU in the slices.
const UnhealthyTaintKey = "gpu.gpudra.dev/unhealthy"

// healthResend keeps the kubelet's view fresh (it expires after 30 s).
const healthResend = 10 * time.Second

// observe updates the health map from an event; it reports whether the
// published devices (and the health file) must change. A GPU keeps the
// event that needs the most to recover from (nvdevice.Recovery): its taint
// names it, and a restarted plugin hands it back to the backend.
func (d *Driver) observe(ev nvdevice.HealthEvent) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.health == nil {
		d.health = map[string]nvdevice.HealthEvent{}
	}
	prev, was := d.health[ev.GPUUUID]
	switch {
	case d.xidPolicy.Critical(ev):
		if was && ev.Recovery() <= prev.Recovery() {
			return false
		}
		d.health[ev.GPUUUID] = ev
		return true
	case ev.Kind == nvdevice.HealthRecovered:
		delete(d.health, ev.GPUUUID)
		return was
	}
	return false // XIDs the policy ignores do not make a device unhealthy
}

// HealthObserver is told what the plugin's health watch sees: every XID
// event, and the unhealthy GPUs each time they change (and at the watch's
// start, with those restored from the health file).
type HealthObserver interface {
	XID(gpuUUID string, xid uint64)
	SetUnhealthy(gpuUUIDs []string)
}

// observeHealth tells the health observer, if any, the unhealthy GPUs.
func (d *Driver) observeHealth() {
	if d.healthObs != nil {
		d.healthObs.SetUnhealthy(sortedUUIDs(d.unhealthy()))
	}
}

// restoreHealth has the driver keep its unhealthy GPUs in the file at path
// and takes back those an earlier run of the plugin left there in this
// boot, so that they are tainted from the first publication on. A missing,
// stale or corrupt file gives none; it never fails.
func (d *Driver) restoreHealth(ctx context.Context, path, bootID string) {
	logger := klog.FromContext(ctx)
	s := &healthStore{path: path, bootID: bootID, policy: d.xidPolicy}
	d.healthStore = s
	restored := s.load(logger)
	if len(restored) == 0 {
		return
	}
	d.mu.Lock()
	if d.health == nil {
		d.health = map[string]nvdevice.HealthEvent{}
	}
	for uuid, ev := range restored {
		if _, ok := d.health[uuid]; !ok {
			d.health[uuid] = ev
		}
	}
	d.mu.Unlock()
	logger.Info("GPUs still unhealthy from before the restart", "gpus", sortedUUIDs(restored), "path", path)
}

// unhealthy is a copy of the health map.
func (d *Driver) unhealthy() map[string]nvdevice.HealthEvent {
	d.mu.Lock()
	defer d.mu.Unlock()
	return maps.Clone(d.health)
}

// persistHealth writes the health map to the health file, if the driver
// has one. Only the health watch calls it, so writes never race.
func (d *Driver) persistHealth(ctx context.Context) {
	if d.healthStore == nil {
		return
	}
	if err := d.healthStore.save(d.unhealthy()); err != nil {
		klog.FromContext(ctx).Error(err, "Saving the unhealthy GPUs failed; a restart may forget them")
	}
}

// healthChanged is closed (and replaced) whenever the health of a GPU
// changes, to wake the kubelet's health streams.
func (d *Driver) healthChanged() <-chan struct{} {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.changed == nil {
		d.changed = make(chan struct{})
	}
	return d.changed
}

func (d *Driver) notifyHealthChanged() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.changed != nil {
		close(d.changed)
	}
	d.changed = make(chan struct{})
}

// watchHealth follows the GPUs' health for the plugin's lifetime: a GPU
// that turns unhealthy gets its devices tainted in the published slices
// (whether or not the kubelet asks for health reports), and untainted when
// the backend reports it recovered. The unhealthy GPUs are kept in the
// health file; those restored from it are handed to the backend, which
// checks them for recovery as if it had seen their faults itself.
func (d *Driver) watchHealth(ctx context.Context) error {
	logger := klog.FromContext(ctx)
	events, err := d.backend.WatchHealth(ctx)
	if err != nil {
		return fmt.Errorf("watch GPU health: %w", err)
	}
	if restored := d.unhealthy(); len(restored) > 0 {
		if tracker, ok := d.backend.(nvdevice.UnhealthyTracker); ok {
			for _, uuid := range sortedUUIDs(restored) {
				if err := tracker.TrackUnhealthy(restored[uuid]); err != nil {
					logger.Error(err, "Could not have the backend check an unhealthy GPU for recovery; it stays tainted", "gpu", uuid)
				}
			}
		} else {
			logger.Info("The GPU backend does not check unhealthy GPUs for recovery: they stay tainted until the node reboots", "gpus", sortedUUIDs(restored))
		}
	}
	d.observeHealth()
	go func() {
		for ev := range events {
			critical := d.xidPolicy.Critical(ev)
			logger.Info("GPU health event", "kind", ev.Kind, "gpu", ev.GPUUUID, "xid", ev.XID, "critical", critical, "message", ev.Message)
			if ev.Kind == nvdevice.HealthXID && d.healthObs != nil {
				d.healthObs.XID(ev.GPUUUID, ev.XID)
			}
			if critical && !nvdevice.DefaultXIDPolicy.Critical(ev) {
				d.trackForRecovery(ctx, ev)
			}
			if d.observe(ev) {
				d.observeHealth()
				d.persistHealth(ctx)
				d.republish(ctx)
				d.notifyHealthChanged()
				d.recordHealthEvent(ev)
			}
		}
	}()
	return nil
}

// trackForRecovery hands the backend an event the driver's policy counts
// and the backend's default ignores: the backend decides recovery by the
// default policy, and would never report a GPU it does not think
// unhealthy as recovered.
func (d *Driver) trackForRecovery(ctx context.Context, ev nvdevice.HealthEvent) {
	logger := klog.FromContext(ctx)
	tracker, ok := d.backend.(nvdevice.UnhealthyTracker)
	if !ok {
		logger.Info("The GPU backend does not check unhealthy GPUs for recovery: the GPU stays tainted until the node reboots", "gpu", ev.GPUUUID, "xid", ev.XID)
		return
	}
	if err := tracker.TrackUnhealthy(ev); err != nil {
		logger.Error(err, "Could not have the backend check an unhealthy GPU for recovery; it stays tainted", "gpu", ev.GPUUUID, "xid", ev.XID)
	}
}

// recordHealthEvent records an Event on the Node for a GPU whose health
// changed (after observe said it did).
func (d *Driver) recordHealthEvent(ev nvdevice.HealthEvent) {
	if d.events == nil {
		return
	}
	d.mu.Lock()
	device := d.gpuNames[ev.GPUUUID]
	cause, unhealthy := d.health[ev.GPUUUID]
	d.mu.Unlock()
	if device == "" {
		device = ev.GPUUUID
	}
	if !unhealthy {
		d.events.gpuHealth(ev, device, "")
		return
	}
	d.events.gpuHealth(cause, device, fmt.Sprintf("%s=%s:%s", UnhealthyTaintKey, healthValue(cause), d.effect()))
}

// taints are the device taints of unhealthy GPUs: the full GPU and every MIG
// device on it.
func (d *Driver) taints(inv *nvdevice.Inventory) map[string][]resourceapi.DeviceTaint {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := map[string][]resourceapi.DeviceTaint{}
	if d.gpuNames == nil {
		d.gpuNames = map[string]string{}
	}
	for _, g := range inv.GPUs {
		// Remembered for the Events of a GPU that is gone by then.
		d.gpuNames[g.UUID] = slicebuilder.GPUDeviceName(&g)
		ev, bad := d.health[g.UUID]
		value := healthValue(ev)
		if d.driverGone && !bad {
			bad, value = true, driverNotLoaded
		}
		if !bad {
			continue
		}
		taint := []resourceapi.DeviceTaint{{Key: UnhealthyTaintKey, Value: value, Effect: d.effect()}}
		out[slicebuilder.GPUDeviceName(&g)] = taint
		for _, p := range g.MIG.Profiles {
			for _, pl := range p.Placements {
				out[slicebuilder.MigDeviceName(&g, p.Name, pl.Start)] = taint
			}
		}
	}
	return out
}

// effect is the effect of the taints on an unhealthy GPU's devices.
func (d *Driver) effect() resourceapi.DeviceTaintEffect {
	if d.taintEffect == "" {
		return resourceapi.DeviceTaintEffectNoSchedule
	}
	return d.taintEffect
}

func healthValue(ev nvdevice.HealthEvent) string {
	if ev.Kind == nvdevice.HealthXID {
		return fmt.Sprintf("xid-%d", ev.XID)
	}
	return string(ev.Kind)
}

// report is the health of every device the node publishes: the devices of
// the last build, with the GPUs' health now. It reads neither the node lock
// nor NVML (a prepare blocked in a MIG creation holds both, and the
// kubelet's stream must not go quiet meanwhile); every change of the
// devices rebuilds them (a republish). Only before any build does it build.
func (d *Driver) report(ctx context.Context) (kubeletplugin.DeviceHealthReport, error) {
	d.mu.Lock()
	res, inv := d.built, d.builtFrom
	d.mu.Unlock()
	if res == nil {
		built, builtFrom, err := d.Resources(ctx)
		if err != nil {
			return kubeletplugin.DeviceHealthReport{}, err
		}
		res, inv = &built, builtFrom
	}
	taints := d.taints(inv)
	now := time.Now()
	var rep kubeletplugin.DeviceHealthReport
	for _, pool := range res.Pools {
		for _, s := range pool.Slices {
			for _, dev := range s.Devices {
				h := kubeletplugin.DeviceHealth{PoolName: d.pool, DeviceName: dev.Name, Health: kubeletplugin.HealthStatusHealthy, LastUpdated: now}
				if t := taints[dev.Name]; len(t) > 0 {
					h.Health, h.Message = kubeletplugin.HealthStatusUnhealthy, t[0].Value
				}
				rep.Devices = append(rep.Devices, h)
			}
		}
	}
	return rep, nil
}

// WatchHealthStatus sends the kubelet a full report at once, again on every
// health change, and every 10 s.
func (d *Driver) WatchHealthStatus(ctx context.Context, reports chan<- kubeletplugin.DeviceHealthReport) error {
	logger := klog.FromContext(ctx)
	send := func() error {
		rep, err := d.report(ctx)
		if err != nil {
			logger.Error(err, "Building the health report failed")
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case reports <- rep:
			return nil
		}
	}
	ticker := time.NewTicker(healthResend)
	defer ticker.Stop()
	for {
		changed := d.healthChanged()
		if send() != nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-changed:
		case <-ticker.C:
		}
	}
}
