package plugin

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// TestDriverReload: the NVIDIA driver is unloaded under the running plugin
// and loaded again at a new version. Meanwhile every device stays
// published, tainted driver-not-loaded, and reported unhealthy; a prepared
// claim stays prepared, a new prepare fails with an error that says why.
// When the driver is back the taints go and the slices carry the new
// driverVersion.
func TestDriverReload(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	d := &Driver{state: e.start(), backend: e.machine, pool: pool, repub: newRepublisher()}
	_, err := prep(d.state, claim("u1", []string{"gpu-3"}))
	require.NoError(t, err)
	var last string
	d.checkInventory(ctx, &last)
	published := publishedSnapshot(t, d)
	assert.Equal(t, "570.172.8", published.driverVersion)
	assert.Empty(t, published.taints)

	e.machine.UnloadDriver()
	d.checkInventory(ctx, &last)
	assert.True(t, queuedRepublish(d), "the driver's absence is noticed")
	during := publishedSnapshot(t, d)
	assert.Equal(t, len(published.devices), len(during.devices), "the devices stay published")
	assert.Len(t, during.taints, len(during.devices), "every device is tainted")
	assert.Equal(t, driverNotLoaded, during.taints["gpu-4"])
	rep, err := d.report(ctx)
	require.NoError(t, err)
	for _, h := range rep.Devices {
		require.Equal(t, kubeletplugin.HealthStatusUnhealthy, h.Health, h.DeviceName)
	}
	_, err = prep(d.state, claim("u2", []string{"gpu-4"}))
	require.ErrorIs(t, err, nvdevice.ErrDriverNotLoaded)
	assert.Contains(t, err.Error(), "NVIDIA driver is not loaded")
	_, err = prep(d.state, claim("u1", []string{"gpu-3"}))
	require.NoError(t, err, "a prepared claim is answered from the checkpoint")
	d.checkInventory(ctx, &last)
	assert.False(t, queuedRepublish(d), "noticed once")

	e.machine.LoadDriver("580.159.04", "13.0")
	d.checkInventory(ctx, &last)
	assert.True(t, queuedRepublish(d), "the driver's return is noticed")
	after := publishedSnapshot(t, d)
	assert.Equal(t, "580.159.4", after.driverVersion)
	assert.Empty(t, after.taints)
	_, ok := preparedOf(t, d.state, "u1")
	assert.True(t, ok, "the prepared claim was kept")
	_, err = prep(d.state, claim("u2", []string{"gpu-4"}))
	require.NoError(t, err)
}

// TestDriverUpgradeWithoutAnOutageRepublishes: the inventory poll sees only
// the new version (the reload fell between two polls): republished.
func TestDriverUpgradeWithoutAnOutageRepublishes(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	d := &Driver{state: e.start(), backend: e.machine, pool: pool, repub: newRepublisher()}
	var last string
	d.checkInventory(ctx, &last)
	e.machine.UnloadDriver()
	e.machine.LoadDriver("580.159.04", "13.0")
	d.checkInventory(ctx, &last)
	assert.True(t, queuedRepublish(d))
	assert.Equal(t, "580.159.4", publishedSnapshot(t, d).driverVersion)
}

type snapshot struct {
	devices       map[string]bool
	taints        map[string]string
	driverVersion string // of gpu-0
}

func publishedSnapshot(t *testing.T, d *Driver) snapshot {
	t.Helper()
	res, _, err := d.Resources(context.Background())
	require.NoError(t, err)
	out := snapshot{devices: map[string]bool{}, taints: map[string]string{}}
	for _, s := range res.Pools[pool].Slices {
		for _, dev := range s.Devices {
			out.devices[dev.Name] = true
			if len(dev.Taints) > 0 {
				out.taints[dev.Name] = dev.Taints[0].Value
			}
			if dev.Name == "gpu-0" {
				out.driverVersion = *dev.Attributes["driverVersion"].VersionValue
			}
		}
	}
	return out
}
