package plugin

import (
	"context"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

// TestHealthStreamWhileAPrepareBlocks: a prepare hangs in a MIG creation
// (between the GPU instance and the compute instance, holding the node
// lock); the kubelet's health stream still reports a GPU that turns
// unhealthy meanwhile, and the prepare finishes once released.
func TestHealthStreamWhileAPrepareBlocks(t *testing.T) {
	e := newEnv(t)
	d := &Driver{state: e.start(), backend: e.machine, pool: pool}
	d.publish = func(ctx context.Context) error { _, _, err := d.Resources(ctx); return err }
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	d.startRepublishing(ctx)
	defer d.stopRepublishing()
	require.NoError(t, d.watchHealth(ctx))
	reports := make(chan kubeletplugin.DeviceHealthReport)
	go func() { _ = d.WatchHealthStatus(ctx, reports) }()
	next := func() map[string]kubeletplugin.DeviceHealth {
		t.Helper()
		return nextHealthReport(t, reports, "no health report within 5 s while a prepare blocks")
	}
	require.Equal(t, kubeletplugin.HealthStatusHealthy, next()["gpu-3"].Health)

	blocked, release := make(chan struct{}), make(chan struct{})
	var releaseOnce sync.Once
	// Released also when the test fails, so that nothing stays blocked.
	defer releaseOnce.Do(func() { close(release) })
	e.machine.SetStepHook(func(step string) {
		if step == sim.StepAfterGICreate {
			close(blocked)
			<-release
		}
	})
	prepared := make(chan error, 1)
	go func() {
		out, err := d.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{claim("u1", []string{"gpu-0-mig-1g-10gb-6"})})
		if err == nil {
			err = out["u1"].Err
		}
		prepared <- err
	}()
	<-blocked

	inv := inventory(t, e.machine)
	require.NoError(t, e.machine.InjectXID(inv.GPUs[3].UUID, "", 79)) // fallen off the bus
	rep := next()
	assert.Equal(t, kubeletplugin.HealthStatusUnhealthy, rep["gpu-3"].Health, "reported while the prepare blocks")
	assert.Equal(t, "xid-79", rep["gpu-3"].Message)
	assert.Equal(t, kubeletplugin.HealthStatusHealthy, rep["gpu-2"].Health)

	releaseOnce.Do(func() { close(release) })
	require.NoError(t, <-prepared)
}
