package plugin

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// queuedRepublish says whether a republish was asked for since the last
// call, and takes it from the queue (no worker runs in these tests, so
// what was asked for stays there).
func queuedRepublish(d *Driver) bool {
	if d.repub.queue.Len() == 0 {
		return false
	}
	key, _ := d.repub.queue.Get()
	d.repub.queue.Forget(key)
	d.repub.queue.Done(key)
	return true
}

func TestRepublishOnOutsideChanges(t *testing.T) {
	e := newEnv(t)
	d := &Driver{state: e.start(), backend: e.machine, pool: pool, repub: newRepublisher()}
	ctx := context.Background()
	var last string
	d.checkInventory(ctx, &last)
	d.checkInventory(ctx, &last)
	assert.False(t, queuedRepublish(d), "nothing changed")

	inv, _ := e.machine.Inventory(ctx)
	_, err := e.machine.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: inv.GPUs[0].UUID, Profile: "4g.40gb", Start: 0})
	require.NoError(t, err)
	d.checkInventory(ctx, &last)
	assert.True(t, queuedRepublish(d), "a MIG device made with nvidia-smi is noticed")
	res, _, err := d.Resources(ctx)
	require.NoError(t, err)
	names := map[string]bool{}
	for _, s := range res.Pools[pool].Slices {
		for _, dev := range s.Devices {
			names[dev.Name] = true
		}
	}
	assert.False(t, names["gpu-0"], "the full GPU under a foreign MIG device is withdrawn")
	assert.True(t, names["gpu-0-mig-4g-40gb-0"])

	require.NoError(t, e.machine.LoseGPU(inv.GPUs[6].UUID))
	d.checkInventory(ctx, &last)
	assert.True(t, queuedRepublish(d), "a vanished GPU is noticed")
	d.checkInventory(ctx, &last)
	assert.False(t, queuedRepublish(d), "and only once")
}

// The driver's own MIG devices change nothing published: a prepare that
// creates one and the unprepare that destroys it leave the slices as they
// were, so neither republishes, and the inventory poll does not either.
func TestManagedMigChangesPublishNothing(t *testing.T) {
	e := newEnv(t)
	d := &Driver{state: e.start(), backend: e.machine, pool: pool, repub: newRepublisher()}
	ctx := context.Background()
	var last string
	d.checkInventory(ctx, &last)
	before, _, err := d.Resources(ctx)
	require.NoError(t, err)

	out, err := d.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{claim("u1", []string{"gpu-0-mig-3g-40gb-4"})})
	require.NoError(t, err)
	require.NoError(t, out["u1"].Err)
	require.Len(t, e.migDevices(), 1, "the prepare created a MIG device")
	during, _, err := d.Resources(ctx)
	require.NoError(t, err)
	assert.True(t, apiequality.Semantic.DeepEqual(before, during), "a created MIG device changes no published device")
	d.checkInventory(ctx, &last)

	errs, err := d.UnprepareResourceClaims(ctx, []kubeletplugin.NamespacedObject{{UID: "u1"}})
	require.NoError(t, err)
	require.NoError(t, errs["u1"])
	require.Empty(t, e.migDevices(), "the unprepare destroyed it")
	d.checkInventory(ctx, &last)
	assert.False(t, queuedRepublish(d), "neither the calls nor the poll republished")
}
