package sim

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

type placement struct {
	profile string
	start   int
}

func TestCreateMigDeviceRules(t *testing.T) {
	tests := []struct {
		name     string
		existing []placement
		create   placement
		wantErr  error
	}{
		{name: "first 1g.10gb", create: placement{"1g.10gb", 0}},
		{name: "seventh 1g.10gb", existing: ones("1g.10gb", 0, 1, 2, 3, 4, 5), create: placement{"1g.10gb", 6}},
		{name: "no 1g.10gb at slice 7", create: placement{"1g.10gb", 7}, wantErr: nvdevice.ErrInvalidPlacement},
		{name: "3g.40gb only at 0 and 4", create: placement{"3g.40gb", 2}, wantErr: nvdevice.ErrInvalidPlacement},
		{name: "overlap", existing: ones("3g.40gb", 4), create: placement{"1g.10gb", 5}, wantErr: nvdevice.ErrInsufficientResources},
		{name: "7g excludes everything", existing: ones("1g.10gb", 6), create: placement{"7g.80gb", 0}, wantErr: nvdevice.ErrInsufficientResources},
		{name: "4g + 3g fill the GPU", existing: ones("4g.40gb", 0), create: placement{"3g.40gb", 4}},
		{name: "only one +me", existing: ones("1g.10gb+me", 0), create: placement{"1g.10gb+me", 3}, wantErr: nvdevice.ErrInsufficientResources},
		{name: "+me beside six 1g.10gb", existing: ones("1g.10gb", 0, 1, 2, 3, 4, 5), create: placement{"1g.10gb+me", 6}},
		{name: "four 1g.20gb", existing: ones("1g.20gb", 0, 2, 4), create: placement{"1g.20gb", 6}},
		{name: "2g at 4 and 1g.20gb at 6", existing: ones("2g.20gb", 0, 2, 4), create: placement{"1g.20gb", 6}},
		{name: "unknown profile", create: placement{"1g.5gb", 0}, wantErr: nvdevice.ErrNotFound},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m, gpu := oneGPU(t, true)
			for _, e := range tc.existing {
				_, err := m.CreateMigDevice(context.Background(), nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: e.profile, Start: e.start})
				require.NoError(t, err, "setting up %v", e)
			}
			d, err := m.CreateMigDevice(context.Background(), nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: tc.create.profile, Start: tc.create.start})
			if tc.wantErr != nil {
				require.ErrorIs(t, err, tc.wantErr)
				assert.Contains(t, err.Error(), tc.create.profile, "the error names the profile")
				assert.Len(t, inventory(t, m).GPUs[0].MIG.Devices, len(tc.existing), "a refused create leaves nothing behind")
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.create.profile, d.Profile)
			assert.Equal(t, tc.create.start, d.Placement.Start)
			assert.Regexp(t, `^MIG-[0-9a-f-]{36}$`, d.UUID)
			assert.Equal(t, gpu, d.ParentUUID)
			assert.Len(t, inventory(t, m).GPUs[0].MIG.Devices, len(tc.existing)+1)
		})
	}
}

func ones(profile string, starts ...int) []placement {
	var p []placement
	for _, s := range starts {
		p = append(p, placement{profile, s})
	}
	return p
}

func oneGPU(t *testing.T, migEnabled bool) (*Machine, string) {
	t.Helper()
	spec := MachineSpec{Name: "one", GPUCount: 1, NVLink: NVLinkNone, MigEnabled: MigEnabledSpec{All: migEnabled}}
	m, err := New(spec, "n")
	require.NoError(t, err)
	return m, inventory(t, m).GPUs[0].UUID
}

func TestMigDisabled(t *testing.T) {
	m, gpu := oneGPU(t, false)
	_, err := m.CreateMigDevice(context.Background(), nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: "1g.10gb", Start: 0})
	require.ErrorIs(t, err, nvdevice.ErrMigDisabled)
}

func TestDeleteMigDevice(t *testing.T) {
	ctx := context.Background()
	m, gpu := oneGPU(t, true)
	d, err := m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: "3g.40gb", Start: 0})
	require.NoError(t, err)
	ref := nvdevice.MigDeviceRef{ParentUUID: gpu, GPUInstanceID: d.GPUInstanceID, ComputeInstanceID: d.ComputeInstanceID, UUID: d.UUID}

	wrong := ref
	wrong.UUID = "MIG-00000000-0000-0000-0000-000000000000"
	require.ErrorIs(t, m.DeleteMigDevice(ctx, wrong), nvdevice.ErrNotFound, "a UUID mismatch deletes nothing")
	assert.Len(t, inventory(t, m).GPUs[0].MIG.Devices, 1)

	require.NoError(t, m.DeleteMigDevice(ctx, ref))
	assert.Empty(t, inventory(t, m).GPUs[0].MIG.Devices)
	require.ErrorIs(t, m.DeleteMigDevice(ctx, ref), nvdevice.ErrNotFound)

	// The placement is free again, and a new device gets a new UUID.
	d2, err := m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: "4g.40gb", Start: 0})
	require.NoError(t, err)
	assert.NotEqual(t, d.UUID, d2.UUID)
}

func TestGPUInstanceIDsAreUnique(t *testing.T) {
	ctx := context.Background()
	m, gpu := oneGPU(t, true)
	ids := map[int]bool{}
	for s := 0; s < 7; s++ {
		d, err := m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: "1g.10gb", Start: s})
		require.NoError(t, err)
		assert.False(t, ids[d.GPUInstanceID], "GI id %d reused", d.GPUInstanceID)
		ids[d.GPUInstanceID] = true
	}
}
