package plugin

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
)

func TestHealthReportsAndTaints(t *testing.T) {
	e := newEnv(t)
	d := &Driver{state: e.start(), backend: e.machine, pool: pool}
	published := make(chan struct{}, 10)
	d.publish = func(context.Context) error { published <- struct{}{}; return nil }
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	require.NoError(t, d.watchHealth(ctx))
	reports := make(chan kubeletplugin.DeviceHealthReport)
	done := make(chan error)
	go func() { done <- d.WatchHealthStatus(ctx, reports) }()

	next := func() map[string]kubeletplugin.DeviceHealth {
		t.Helper()
		select {
		case r := <-reports:
			out := map[string]kubeletplugin.DeviceHealth{}
			for _, h := range r.Devices {
				out[h.DeviceName] = h
			}
			return out
		case <-time.After(5 * time.Second):
			t.Fatal("no health report")
			return nil
		}
	}
	first := next()
	require.Len(t, first, 2*26+6, "the first report covers every device: 2 GPUs in MIG mode with 25 placements each, 6 without")
	assert.Equal(t, kubeletplugin.HealthStatusHealthy, first["gpu-1"].Health)

	inv, _ := e.machine.Inventory(ctx)
	require.NoError(t, e.machine.InjectXID(inv.GPUs[1].UUID, "", 13)) // application error: ignored
	require.NoError(t, e.machine.InjectXID(inv.GPUs[1].UUID, "", 79)) // fallen off the bus: unhealthy
	rep := next()
	assert.Equal(t, kubeletplugin.HealthStatusUnhealthy, rep["gpu-1"].Health)
	assert.Equal(t, "xid-79", rep["gpu-1"].Message)
	assert.Equal(t, kubeletplugin.HealthStatusUnhealthy, rep["gpu-1-mig-1g-10gb-0"].Health, "its MIG devices too")
	assert.Equal(t, kubeletplugin.HealthStatusHealthy, rep["gpu-0"].Health)
	<-published

	res, _, err := d.Resources(ctx)
	require.NoError(t, err)
	tainted := 0
	for _, s := range res.Pools[pool].Slices {
		for _, dev := range s.Devices {
			if len(dev.Taints) > 0 {
				tainted++
				assert.Equal(t, UnhealthyTaintKey, dev.Taints[0].Key)
				assert.Equal(t, resourceapi.DeviceTaintEffectNoSchedule, dev.Taints[0].Effect, "NoSchedule unless configured")
			}
		}
	}
	assert.Equal(t, 26, tainted, "the GPU and its 25 placements are tainted")

	require.NoError(t, e.machine.RecoverGPU(inv.GPUs[1].UUID))
	assert.Equal(t, kubeletplugin.HealthStatusHealthy, next()["gpu-1"].Health, "the device comes back")
	res, _, err = d.Resources(ctx)
	require.NoError(t, err)
	for _, s := range res.Pools[pool].Slices {
		for _, dev := range s.Devices {
			assert.Empty(t, dev.Taints, dev.Name)
		}
	}
	cancel()
	require.NoError(t, <-done)
}

// Without any kubelet health stream, an unhealthy GPU is still tainted in
// the published slices, with the configured effect.
func TestHealthTaintsWithoutAHealthStream(t *testing.T) {
	e := newEnv(t)
	d := &Driver{state: e.start(), backend: e.machine, pool: pool, taintEffect: resourceapi.DeviceTaintEffectNoExecute}
	published := make(chan struct{}, 10)
	d.publish = func(context.Context) error { published <- struct{}{}; return nil }
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	require.NoError(t, d.watchHealth(ctx))
	inv, err := e.machine.Inventory(ctx)
	require.NoError(t, err)
	require.NoError(t, e.machine.InjectXID(inv.GPUs[2].UUID, "", 48)) // double-bit ECC error
	select {
	case <-published:
	case <-time.After(5 * time.Second):
		t.Fatal("not republished after a critical XID")
	}
	res, _, err := d.Resources(ctx)
	require.NoError(t, err)
	for _, s := range res.Pools[pool].Slices {
		for _, dev := range s.Devices {
			if dev.Name == "gpu-2" {
				require.Len(t, dev.Taints, 1)
				assert.Equal(t, resourceapi.DeviceTaintEffectNoExecute, dev.Taints[0].Effect)
				assert.Equal(t, "xid-48", dev.Taints[0].Value)
			}
		}
	}
}
