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

func TestRepublishOnOutsideChanges(t *testing.T) {
	e := newEnv(t)
	d := &Driver{state: e.start(), backend: e.machine, pool: pool}
	published := 0
	d.publish = func(context.Context) error { published++; return nil }
	ctx := context.Background()
	var last string
	d.checkInventory(ctx, &last)
	d.checkInventory(ctx, &last)
	assert.Equal(t, 0, published, "nothing changed")

	inv, _ := e.machine.Inventory(ctx)
	_, err := e.machine.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: inv.GPUs[0].UUID, Profile: "4g.40gb", Start: 0})
	require.NoError(t, err)
	d.checkInventory(ctx, &last)
	assert.Equal(t, 1, published, "a MIG device made with nvidia-smi is noticed")
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
	assert.Equal(t, 2, published, "a vanished GPU is noticed")
}

// The driver's own MIG devices change nothing published: a prepare that
// creates one and the unprepare that destroys it leave the slices as they
// were, so neither republishes, and the inventory poll does not either.
func TestManagedMigChangesPublishNothing(t *testing.T) {
	e := newEnv(t)
	d := &Driver{state: e.start(), backend: e.machine, pool: pool}
	published := 0
	d.publish = func(context.Context) error { published++; return nil }
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
	assert.Equal(t, 0, published, "neither the calls nor the poll republished")
}
