//go:build cgo && linux

package nvml

import (
	"context"
	"fmt"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

const (
	// defaultEventWait bounds each wait on the event set, so the loop (and
	// Close, which waits for it) notices cancellation within that time.
	defaultEventWait = 2 * time.Second
	// errorBackoff spaces out waits that keep failing (a lost GPU makes every
	// wait fail at once).
	errorBackoff = time.Second
	// wholeGPU in an event's instance ids means the event is not about one
	// MIG device.
	wholeGPU = 0xFFFFFFFF
)

// watchedGPU is a GPU registered with the event set.
type watchedGPU struct {
	dev  nvml.Device
	uuid string
}

// WatchHealth streams XID errors and lost GPUs. The first watcher starts the
// one NVML event loop, which runs until Close; every watcher gets every
// event, and its channel is closed when its ctx ends.
func (b *Backend) WatchHealth(ctx context.Context) (<-chan nvdevice.HealthEvent, error) {
	err := b.locked(func() error {
		if b.stopLoop != nil {
			return nil
		}
		set, gpus, err := b.registerEvents(ctx)
		if err != nil {
			return err
		}
		loopCtx, cancel := context.WithCancel(klog.NewContext(context.Background(), klog.FromContext(ctx)))
		b.stopLoop, b.loopDone = cancel, make(chan struct{})
		go b.eventLoop(loopCtx, set, gpus, b.loopDone)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("watch GPU health: %w", err)
	}
	return b.health.Subscribe(ctx), nil
}

// registerEvents creates an event set with every GPU's XID errors in it.
// GPUs that cannot report them are logged and left out.
func (b *Backend) registerEvents(ctx context.Context) (nvml.EventSet, []watchedGPU, error) {
	logger := klog.FromContext(ctx)
	set, ret := b.lib.EventSetCreate()
	if err := check(ret, "create NVML event set"); err != nil {
		return nil, nil, err
	}
	fail := func(err error) (nvml.EventSet, []watchedGPU, error) {
		set.Free()
		return nil, nil, err
	}
	count, ret := b.lib.DeviceGetCount()
	if err := check(ret, "count GPUs"); err != nil {
		return fail(err)
	}
	var gpus []watchedGPU
	for i := range count {
		dev, ret := b.lib.DeviceGetHandleByIndex(i)
		if ret == nvml.ERROR_GPU_IS_LOST {
			logger.Error(check(ret, "get GPU %d", i), "GPU is lost, its health is not watched", "index", i)
			continue
		}
		if err := check(ret, "get handle of GPU %d", i); err != nil {
			return fail(err)
		}
		uuid, ret := dev.GetUUID()
		if err := check(ret, "read UUID of GPU %d", i); err != nil {
			return fail(err)
		}
		supported, ret := dev.GetSupportedEventTypes()
		if ret == nvml.SUCCESS && supported&nvml.EventTypeXidCriticalError != 0 {
			ret = dev.RegisterEvents(nvml.EventTypeXidCriticalError, set)
		} else if ret == nvml.SUCCESS {
			ret = nvml.ERROR_NOT_SUPPORTED
		}
		if ret == nvml.ERROR_NOT_SUPPORTED {
			logger.Info("GPU does not report XID events, its health is not watched", "index", i, "uuid", uuid)
			continue
		}
		if err := check(ret, "register XID events of GPU %d (%s)", i, uuid); err != nil {
			return fail(err)
		}
		gpus = append(gpus, watchedGPU{dev: dev, uuid: uuid})
	}
	return set, gpus, nil
}

// eventLoop waits for events until ctx ends. It is the only place the event
// set is used, and frees it before closing done.
func (b *Backend) eventLoop(ctx context.Context, set nvml.EventSet, gpus []watchedGPU, done chan<- struct{}) {
	defer close(done)
	defer set.Free()
	logger := klog.FromContext(ctx)
	wait := b.eventWait
	if wait <= 0 {
		wait = defaultEventWait
	}
	backoff := min(errorBackoff, wait)
	lost := map[string]bool{}
	for ctx.Err() == nil {
		data, ret := set.Wait(uint32(wait.Milliseconds()))
		switch ret {
		case nvml.SUCCESS:
			if ev, ok := translateEvent(data); ok {
				logger.Info("GPU health event", "kind", ev.Kind, "gpu", ev.GPUUUID, "mig", ev.MigUUID, "xid", ev.XID)
				b.health.Publish(ev)
			}
		case nvml.ERROR_TIMEOUT:
		case nvml.ERROR_GPU_IS_LOST:
			for _, ev := range lostGPUs(gpus, lost) {
				logger.Error(nvdevice.ErrGPULost, "GPU health event", "kind", ev.Kind, "gpu", ev.GPUUUID)
				b.health.Publish(ev)
			}
			sleep(ctx, backoff)
		default:
			logger.Error(check(ret, "wait for NVML events"), "Health watch error")
			sleep(ctx, backoff)
		}
	}
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// lostGPUs finds the GPUs that fell off the bus when a wait says one did
// (the wait does not say which): those whose probe answers GPU_IS_LOST. If
// no probe does, every GPU not yet reported is, as NVIDIA's device plugin
// does, since a GPU the driver has lost must not stay schedulable. Each GPU
// is reported once.
func lostGPUs(gpus []watchedGPU, reported map[string]bool) []nvdevice.HealthEvent {
	now := time.Now()
	var out []nvdevice.HealthEvent
	add := func(g watchedGPU) {
		reported[g.uuid] = true
		out = append(out, nvdevice.HealthEvent{Kind: nvdevice.HealthGPULost, GPUUUID: g.uuid, Time: now, Message: "GPU is lost (NVML_ERROR_GPU_IS_LOST)"})
	}
	var unknown []watchedGPU
	probed := false
	for _, g := range gpus {
		if reported[g.uuid] {
			continue
		}
		if _, ret := g.dev.GetMemoryInfo(); ret == nvml.ERROR_GPU_IS_LOST {
			add(g)
			probed = true
			continue
		}
		unknown = append(unknown, g)
	}
	if !probed && len(reported) == 0 {
		for _, g := range unknown {
			add(g)
		}
	}
	return out
}

// translateEvent turns one NVML XID event into a health event. An event about
// one MIG device (its GPU instance id set) carries that device's UUID.
func translateEvent(data nvml.EventData) (nvdevice.HealthEvent, bool) {
	if data.EventType != nvml.EventTypeXidCriticalError || data.Device == nil {
		return nvdevice.HealthEvent{}, false
	}
	uuid, ret := data.Device.GetUUID()
	if ret != nvml.SUCCESS {
		return nvdevice.HealthEvent{}, false
	}
	ev := nvdevice.HealthEvent{Kind: nvdevice.HealthXID, GPUUUID: uuid, XID: data.EventData, Time: time.Now(),
		Message: fmt.Sprintf("XID %d", data.EventData)}
	if data.GpuInstanceId != wholeGPU {
		ev.MigUUID = migUUIDOf(data.Device, int(data.GpuInstanceId), data.ComputeInstanceId)
		ev.Message = fmt.Sprintf("XID %d on GPU instance %d", data.EventData, data.GpuInstanceId)
		if data.ComputeInstanceId != wholeGPU {
			ev.Message += fmt.Sprintf(" compute instance %d", data.ComputeInstanceId)
		}
	}
	return ev, true
}

// migUUIDOf finds the MIG device of a GPU instance (and compute instance,
// unless the event covers the whole GPU instance); "" when there is none.
func migUUIDOf(dev nvml.Device, gi int, ci uint32) string {
	uuids, err := migUUIDs(dev)
	if err != nil {
		return ""
	}
	if ci != wholeGPU {
		return uuids[[2]int{gi, int(ci)}]
	}
	found, lowest := "", -1
	for k, uuid := range uuids { // the GPU instance's first compute instance
		if k[0] == gi && (lowest < 0 || k[1] < lowest) {
			found, lowest = uuid, k[1]
		}
	}
	return found
}
