//go:build cgo

package nvml

import (
	"context"
	"fmt"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// eventWaitMillis bounds each wait on the event set so the loop notices
// cancellation.
const eventWaitMillis = 5000

// WatchHealth streams XID errors and lost GPUs. The first watcher starts the
// one NVML event loop; every watcher gets every event.
func (b *Backend) WatchHealth(ctx context.Context) (<-chan nvdevice.HealthEvent, error) {
	err := b.locked(func() error {
		if b.stop != nil {
			return nil
		}
		set, err := b.registerEvents(ctx)
		if err != nil {
			return err
		}
		loopCtx, cancel := context.WithCancel(context.Background())
		b.stop = cancel
		go b.eventLoop(klog.NewContext(loopCtx, klog.FromContext(ctx)), set)
		return nil
	})
	if err != nil {
		return nil, err
	}
	return b.health.Subscribe(ctx), nil
}

func (b *Backend) registerEvents(ctx context.Context) (nvml.EventSet, error) {
	set, ret := b.lib.EventSetCreate()
	if err := check(ret, "create NVML event set"); err != nil {
		return nil, err
	}
	count, ret := b.lib.DeviceGetCount()
	if err := check(ret, "count GPUs"); err != nil {
		set.Free()
		return nil, err
	}
	for i := 0; i < count; i++ {
		dev, ret := b.lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			continue
		}
		ret = dev.RegisterEvents(nvml.EventTypeXidCriticalError, set)
		if ret == nvml.ERROR_NOT_SUPPORTED {
			klog.FromContext(ctx).Info("GPU does not report XID events; its health is not watched", "index", i)
			continue
		}
		if err := check(ret, "register XID events on GPU %d", i); err != nil {
			set.Free()
			return nil, err
		}
	}
	return set, nil
}

func (b *Backend) eventLoop(ctx context.Context, set nvml.EventSet) {
	logger := klog.FromContext(ctx)
	defer set.Free()
	for ctx.Err() == nil {
		data, ret := set.Wait(eventWaitMillis)
		if ev, ok := translateEvent(data, ret); ok {
			logger.Info("GPU health event", "kind", ev.Kind, "gpu", ev.GPUUUID, "xid", ev.XID)
			b.health.Publish(ev)
		} else if ret != nvml.SUCCESS && ret != nvml.ERROR_TIMEOUT {
			logger.Error(check(ret, "wait for NVML events"), "Health watch error")
			time.Sleep(time.Second)
		}
	}
}

// translateEvent turns one NVML event into a health event.
func translateEvent(data nvml.EventData, ret nvml.Return) (nvdevice.HealthEvent, bool) {
	now := time.Now()
	if ret == nvml.ERROR_GPU_IS_LOST {
		ev := nvdevice.HealthEvent{Kind: nvdevice.HealthGPULost, Time: now, Message: "GPU is lost"}
		if data.Device != nil {
			ev.GPUUUID, _ = data.Device.GetUUID()
		}
		return ev, true
	}
	if ret != nvml.SUCCESS || data.EventType != nvml.EventTypeXidCriticalError || data.Device == nil {
		return nvdevice.HealthEvent{}, false
	}
	uuid, r := data.Device.GetUUID()
	if r != nvml.SUCCESS {
		return nvdevice.HealthEvent{}, false
	}
	ev := nvdevice.HealthEvent{Kind: nvdevice.HealthXID, GPUUUID: uuid, XID: data.EventData, Time: now,
		Message: fmt.Sprintf("XID %d", data.EventData)}
	// 0xFFFFFFFF means "the whole GPU"; otherwise the ids name the MIG device.
	if data.GpuInstanceId != 0xFFFFFFFF && data.Device != nil {
		ev.Message = fmt.Sprintf("XID %d on GPU instance %d compute instance %d", data.EventData, data.GpuInstanceId, data.ComputeInstanceId)
	}
	return ev, true
}
