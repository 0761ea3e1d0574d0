//go:build cgo && linux

package nvml

import (
	"context"
	"fmt"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

func TestDeleteMigPlacement(t *testing.T) {
	const (
		gi3g, ci3c = nvml.GPU_INSTANCE_PROFILE_3_SLICE, nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE
		gi2g, ci1c = nvml.GPU_INSTANCE_PROFILE_2_SLICE, nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE
	)
	at := func(profile string, start int, uuid string) nvdevice.MigPlacementRef {
		return nvdevice.MigPlacementRef{ParentUUID: "GPU-0", Profile: profile, Start: start, UUID: uuid}
	}
	for _, tc := range []struct {
		name          string
		setup         func(g *fakeGPU)
		migOff, busy  bool
		ref           nvdevice.MigPlacementRef
		wantErr       []error
		wantDestroyed []string
		wantGIsLeft   int
		wantInMsg     string
	}{
		{name: "MIG device", setup: func(g *fakeGPU) { g.addGI(gi3g, 4, ci3c) },
			ref: at("3g.40gb", 4, "MIG-1"), wantDestroyed: []string{"ci 1/0", "gi 1"}},
		{name: "the GPU instance at the placement, not the other of the profile",
			setup: func(g *fakeGPU) { g.addGI(gi3g, 0, ci3c); g.addGI(gi3g, 4, ci3c) },
			ref:   at("3g.40gb", 4, "MIG-2"), wantDestroyed: []string{"ci 2/0", "gi 2"}, wantGIsLeft: 1},
		{name: "GPU instance a kill left without compute instance", setup: func(g *fakeGPU) { g.addGI(gi3g, 4) },
			ref: at("3g.40gb", 4, ""), wantDestroyed: []string{"gi 1"}},
		{name: "GPU instance left without compute instance, UUID recorded", setup: func(g *fakeGPU) { g.addGI(gi3g, 4) },
			ref: at("3g.40gb", 4, "MIG-7"), wantDestroyed: []string{"gi 1"}},
		{name: "every compute instance, then the GPU instance", setup: func(g *fakeGPU) { g.addGI(gi2g, 2, ci1c, ci1c) },
			ref: at("2g.20gb", 2, ""), wantDestroyed: []string{"ci 1/0", "ci 1/1", "gi 1"}},
		{name: "another MIG device's UUID", setup: func(g *fakeGPU) { g.addGI(gi3g, 4, ci3c) },
			ref: at("3g.40gb", 4, "MIG-other"), wantErr: []error{nvdevice.ErrNotFound}, wantGIsLeft: 1,
			wantInMsg: `GPU instance 1 holds MIG device "MIG-1" (compute instance 0), not MIG-other`},
		{name: "one compute instance is another MIG device", setup: func(g *fakeGPU) { g.addGI(gi2g, 2, ci1c, ci1c) },
			ref: at("2g.20gb", 2, "MIG-1"), wantErr: []error{nvdevice.ErrNotFound}, wantGIsLeft: 1, wantInMsg: `"MIG-2"`},
		{name: "no GPU instance at the placement", setup: func(g *fakeGPU) { g.addGI(gi3g, 0, ci3c) },
			ref: at("3g.40gb", 4, ""), wantErr: []error{nvdevice.ErrNotFound}, wantGIsLeft: 1,
			wantInMsg: "GPU 0 has no 3g.40gb GPU instance at placement start 4"},
		{name: "another profile at the placement", setup: func(g *fakeGPU) { g.addGI(nvml.GPU_INSTANCE_PROFILE_4_SLICE, 0, nvml.COMPUTE_INSTANCE_PROFILE_4_SLICE) },
			ref: at("3g.40gb", 0, ""), wantErr: []error{nvdevice.ErrNotFound}, wantGIsLeft: 1},
		{name: "unknown profile", setup: func(g *fakeGPU) { g.addGI(gi3g, 4, ci3c) },
			ref: at("5g.50gb", 4, ""), wantErr: []error{nvdevice.ErrNotFound}, wantGIsLeft: 1, wantInMsg: `no MIG profile "5g.50gb"`},
		{name: "compute instance in use", setup: func(g *fakeGPU) { g.addGI(gi3g, 4, ci3c) }, busy: true,
			ref: at("3g.40gb", 4, "MIG-1"), wantErr: []error{nvdevice.ErrInUse}, wantGIsLeft: 1, wantInMsg: "destroy compute instance 0 of GPU instance 1"},
		{name: "MIG mode off", setup: func(g *fakeGPU) { g.addGI(gi3g, 4, ci3c) }, migOff: true,
			ref: at("3g.40gb", 4, ""), wantErr: []error{nvdevice.ErrNotFound, nvdevice.ErrMigDisabled}, wantGIsLeft: 1},
		{name: "unknown GPU", setup: func(g *fakeGPU) { g.addGI(gi3g, 4, ci3c) },
			ref: nvdevice.MigPlacementRef{ParentUUID: "GPU-9", Profile: "3g.40gb", Start: 4}, wantErr: []error{nvdevice.ErrNotFound}, wantGIsLeft: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mode := nvml.DEVICE_MIG_ENABLE
			if tc.migOff {
				mode = nvml.DEVICE_MIG_DISABLE
			}
			gpus := board(1, mode)
			tc.setup(gpus[0])
			gpus[0].busy = tc.busy
			err := testBackend(t, fakeLib(gpus)).DeleteMigPlacement(context.Background(), tc.ref)
			if tc.wantErr == nil {
				require.NoError(t, err)
			} else {
				for _, want := range tc.wantErr {
					require.ErrorIs(t, err, want)
				}
				assert.Contains(t, err.Error(), fmt.Sprintf("delete MIG %s at placement start %d on GPU %s: ", tc.ref.Profile, tc.ref.Start, tc.ref.ParentUUID))
				assert.Contains(t, err.Error(), tc.wantInMsg)
			}
			assert.Equal(t, tc.wantDestroyed, gpus[0].destroyed, "what was destroyed, in order")
			assert.Len(t, gpus[0].gis, tc.wantGIsLeft)
		})
	}
}

// TestRetryAfterAFailedGIDestroy: NVML refuses the GPU instance after the
// compute instance went. The retry, by placement or by instance ids, must
// destroy the GPU instance: before, the retry's compute-instance lookup said
// ErrNotFound, which callers take for "already deleted", and the GPU
// instance leaked.
func TestRetryAfterAFailedGIDestroy(t *testing.T) {
	ways := []struct {
		name string
		del  func(b *Backend, d nvdevice.MigDevice) error
	}{
		{"by placement", func(b *Backend, d nvdevice.MigDevice) error {
			return b.DeleteMigPlacement(context.Background(), nvdevice.MigPlacementRef{ParentUUID: d.ParentUUID, Profile: d.Profile, Start: d.Placement.Start, UUID: d.UUID})
		}},
		{"by instance ids", func(b *Backend, d nvdevice.MigDevice) error {
			return b.DeleteMigDevice(context.Background(), nvdevice.MigDeviceRef{ParentUUID: d.ParentUUID, GPUInstanceID: d.GPUInstanceID, ComputeInstanceID: d.ComputeInstanceID, UUID: d.UUID})
		}},
	}
	for _, first := range ways {
		for _, again := range ways {
			t.Run(first.name+" then "+again.name, func(t *testing.T) {
				ctx := context.Background()
				gpus := board(1, nvml.DEVICE_MIG_ENABLE)
				b := testBackend(t, fakeLib(gpus))
				d, err := b.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: "GPU-0", Profile: "3g.40gb", Start: 4})
				require.NoError(t, err)

				gpus[0].failGIDestroy = nvml.ERROR_IN_USE
				err = first.del(b, *d)
				require.ErrorIs(t, err, nvdevice.ErrInUse)
				assert.Contains(t, err.Error(), "destroy GPU instance 1")
				assert.Equal(t, []string{"ci 1/0"}, gpus[0].destroyed)
				inv, err := b.Inventory(ctx)
				require.NoError(t, err)
				require.Len(t, inv.GPUs[0].MIG.Devices, 1)
				left := inv.GPUs[0].MIG.Devices[0]
				assert.Equal(t, "3g.40gb (no compute instance)", left.Profile)
				assert.Equal(t, -1, left.ComputeInstanceID)
				assert.Empty(t, left.UUID)

				require.NoError(t, again.del(b, *d), "the retry destroys the GPU instance")
				assert.Equal(t, []string{"ci 1/0", "gi 1"}, gpus[0].destroyed)
				assert.Empty(t, gpus[0].gis)
				require.ErrorIs(t, again.del(b, *d), nvdevice.ErrNotFound, "then it is gone")
			})
		}
	}
}

// TestCreateRollback: a compute instance that fails is rolled back, compute
// instance before GPU instance; what the rollback cannot destroy is named in
// the error and found again by placement.
func TestCreateRollback(t *testing.T) {
	ctx := context.Background()
	t.Run("compute instance, then GPU instance", func(t *testing.T) {
		gpus := board(1, nvml.DEVICE_MIG_ENABLE)
		gpus[0].GetMigDeviceHandleByIndexFunc = func(int) (nvml.Device, nvml.Return) { return nil, nvml.ERROR_NOT_FOUND }
		_, err := testBackend(t, fakeLib(gpus)).CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: "GPU-0", Profile: "3g.40gb", Start: 4})
		require.Error(t, err)
		assert.Contains(t, err.Error(), "no MIG device handle for GPU instance 1 compute instance 0")
		assert.Equal(t, []string{"ci 1/0", "gi 1"}, gpus[0].destroyed)
		assert.Empty(t, gpus[0].gis)
	})
	t.Run("GPU instance left behind", func(t *testing.T) {
		gpus := board(1, nvml.DEVICE_MIG_ENABLE)
		gpus[0].createCIRet = nvml.ERROR_INSUFFICIENT_RESOURCES
		gpus[0].failGIDestroy = nvml.ERROR_UNKNOWN
		b := testBackend(t, fakeLib(gpus))
		_, err := b.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: "GPU-0", Profile: "1g.10gb", Start: 6})
		require.ErrorIs(t, err, nvdevice.ErrInsufficientResources)
		assert.Contains(t, err.Error(), "rollback: destroy GPU instance")
		require.Len(t, gpus[0].gis, 1)
		assert.Empty(t, gpus[0].gis[0].cis)

		require.NoError(t, b.DeleteMigPlacement(ctx, nvdevice.MigPlacementRef{ParentUUID: "GPU-0", Profile: "1g.10gb", Start: 6}))
		assert.Equal(t, []string{"gi 1"}, gpus[0].destroyed)
		assert.Empty(t, gpus[0].gis)
	})
}
