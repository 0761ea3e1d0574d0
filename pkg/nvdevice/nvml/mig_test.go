//go:build cgo && linux

package nvml

import (
	"context"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

func pls(size int, starts ...int) []nvdevice.Placement {
	out := make([]nvdevice.Placement, 0, len(starts))
	for _, s := range starts {
		out = append(out, nvdevice.Placement{Start: s, Size: size})
	}
	return out
}

func TestMigProfilesOfAnH100(t *testing.T) {
	for _, mode := range []int{nvml.DEVICE_MIG_ENABLE, nvml.DEVICE_MIG_DISABLE} {
		inv, err := testBackend(t, fakeLib(board(1, mode))).Inventory(context.Background())
		require.NoError(t, err)
		profiles := map[string]nvdevice.MigProfile{}
		for _, p := range inv.GPUs[0].MIG.Profiles {
			profiles[p.Name] = p
		}
		require.Len(t, profiles, 7, "MIG mode %d: profiles are listed whenever the GPU is MIG capable", mode)
		for _, want := range []nvdevice.MigProfile{
			{Name: "1g.10gb", ID: 19, NVMLIndex: 0, ComputeSlices: 1, MaxInstances: 7, MemoryMiB: 9984,
				Engines: nvdevice.Engines{Multiprocessors: 16, CopyEngines: 1, Decoders: 1, JPEGEngines: 1}, Placements: pls(1, 0, 1, 2, 3, 4, 5, 6)},
			{Name: "1g.10gb+me", ID: 20, NVMLIndex: 7, ComputeSlices: 1, MaxInstances: 1, MemoryMiB: 9984,
				Engines: nvdevice.Engines{Multiprocessors: 16, CopyEngines: 1, Decoders: 1, JPEGEngines: 1, OFAEngines: 1}, Placements: pls(1, 0, 1, 2, 3, 4, 5, 6)},
			{Name: "1g.20gb", ID: 15, NVMLIndex: 9, ComputeSlices: 1, MaxInstances: 4, MemoryMiB: 20096,
				Engines: nvdevice.Engines{Multiprocessors: 26, CopyEngines: 1, Decoders: 1, JPEGEngines: 1}, Placements: pls(2, 0, 2, 4, 6)},
			{Name: "2g.20gb", ID: 14, NVMLIndex: 1, ComputeSlices: 2, MaxInstances: 3, MemoryMiB: 20096,
				Engines: nvdevice.Engines{Multiprocessors: 32, CopyEngines: 2, Decoders: 2, JPEGEngines: 2}, Placements: pls(2, 0, 2, 4)},
			{Name: "3g.40gb", ID: 9, NVMLIndex: 2, ComputeSlices: 3, MaxInstances: 2, MemoryMiB: 40448,
				Engines: nvdevice.Engines{Multiprocessors: 60, CopyEngines: 3, Decoders: 3, JPEGEngines: 3}, Placements: pls(4, 0, 4)},
			{Name: "4g.40gb", ID: 5, NVMLIndex: 3, ComputeSlices: 4, MaxInstances: 1, MemoryMiB: 40448,
				Engines: nvdevice.Engines{Multiprocessors: 64, CopyEngines: 4, Decoders: 4, JPEGEngines: 4}, Placements: pls(4, 0)},
			{Name: "7g.80gb", ID: 0, NVMLIndex: 4, ComputeSlices: 7, MaxInstances: 1, MemoryMiB: 81152,
				Engines: nvdevice.Engines{Multiprocessors: 132, CopyEngines: 8, Decoders: 7, JPEGEngines: 7, OFAEngines: 1}, Placements: pls(8, 0)},
		} {
			t.Run(want.Name, func(t *testing.T) { assert.Equal(t, want, profiles[want.Name]) })
		}
	}
}

func TestProfileNames(t *testing.T) {
	const h100, h100NVL, a100 = 81559 << 20, 95830 << 20, 40960 << 20
	b := testBackend(t, fakeLib(nil))
	for _, tc := range []struct {
		name       string
		gi, ci     int
		memMiB     uint64
		totalBytes uint64
		want       string
	}{
		{"H100 1g", nvml.GPU_INSTANCE_PROFILE_1_SLICE, nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, 9984, h100, "1g.10gb"},
		{"H100 media extensions", nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, 9984, h100, "1g.10gb+me"},
		{"H100 1g with twice the memory", nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2, nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, 20096, h100, "1g.20gb"},
		{"H100 3g", nvml.GPU_INSTANCE_PROFILE_3_SLICE, nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE, 40448, h100, "3g.40gb"},
		{"H100 7g", nvml.GPU_INSTANCE_PROFILE_7_SLICE, nvml.COMPUTE_INSTANCE_PROFILE_7_SLICE, 81152, h100, "7g.80gb"},
		{"compute instance smaller than its GPU instance", nvml.GPU_INSTANCE_PROFILE_3_SLICE, nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, 40448, h100, "1c.3g.40gb"},
		{"no media extensions", nvml.GPU_INSTANCE_PROFILE_1_SLICE_NO_ME, nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, 9984, h100, "1g.10gb-me"},
		{"all media extensions", nvml.GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME, nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, 9984, h100, "1g.10gb+me.all"},
		{"graphics, newer than go-nvlib", nvml.GPU_INSTANCE_PROFILE_3_SLICE_GFX, nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE, 40448, h100, "3g.40gb+gfx"},
		// The memory figure is the profile's share of the GPU rounded to
		// eighths, not its MiB rounded up to GiB (10.75 GiB is "12gb" on a
		// 94 GB H100 NVL).
		{"H100 NVL 1g", nvml.GPU_INSTANCE_PROFILE_1_SLICE, nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, 11008, h100NVL, "1g.12gb"},
		{"H100 NVL 3g", nvml.GPU_INSTANCE_PROFILE_3_SLICE, nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE, 46848, h100NVL, "3g.47gb"},
		{"A100 40GB 1g", nvml.GPU_INSTANCE_PROFILE_1_SLICE, nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, 4864, a100, "1g.5gb"},
		{"A100 40GB 7g", nvml.GPU_INSTANCE_PROFILE_7_SLICE, nvml.COMPUTE_INSTANCE_PROFILE_7_SLICE, 40192, a100, "7g.40gb"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := b.profileName(tc.gi, tc.ci, tc.memMiB, tc.totalBytes)
			require.NoError(t, err)
			assert.Equal(t, tc.want, got)
		})
	}
}

func TestExistingMigDevices(t *testing.T) {
	gpus := board(1, nvml.DEVICE_MIG_ENABLE)
	gpu := gpus[0]
	gpu.addGI(nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4, nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE)                                        // MIG-1
	gpu.addGI(nvml.GPU_INSTANCE_PROFILE_1_SLICE, 0, nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE)                                        // MIG-2
	gpu.addGI(nvml.GPU_INSTANCE_PROFILE_2_SLICE, 2, nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE) // MIG-3, MIG-4
	gpu.addGI(nvml.GPU_INSTANCE_PROFILE_1_SLICE, 1)                                                                               // no compute instance yet

	inv, err := testBackend(t, fakeLib(gpus)).Inventory(context.Background())
	require.NoError(t, err)
	e1g := nvdevice.Engines{Multiprocessors: 16, CopyEngines: 1, Decoders: 1, JPEGEngines: 1}
	assert.Equal(t, []nvdevice.MigDevice{
		{UUID: "MIG-2", ParentUUID: "GPU-0", Profile: "1g.10gb", Placement: nvdevice.Placement{Start: 0, Size: 1},
			GPUInstanceID: 2, ComputeInstanceID: 0, MemoryMiB: 9984, Engines: e1g},
		{UUID: "", ParentUUID: "GPU-0", Profile: "1g.10gb (no compute instance)", Placement: nvdevice.Placement{Start: 1, Size: 1},
			GPUInstanceID: 4, ComputeInstanceID: -1, MemoryMiB: 9984, Engines: e1g},
		{UUID: "MIG-3", ParentUUID: "GPU-0", Profile: "1c.2g.20gb", Placement: nvdevice.Placement{Start: 2, Size: 2},
			GPUInstanceID: 3, ComputeInstanceID: 0, MemoryMiB: 20096,
			Engines: nvdevice.Engines{Multiprocessors: 32, CopyEngines: 2, Decoders: 2, JPEGEngines: 2}},
		{UUID: "MIG-1", ParentUUID: "GPU-0", Profile: "3g.40gb", Placement: nvdevice.Placement{Start: 4, Size: 4},
			GPUInstanceID: 1, ComputeInstanceID: 0, MemoryMiB: 40448,
			Engines: nvdevice.Engines{Multiprocessors: 60, CopyEngines: 3, Decoders: 3, JPEGEngines: 3}},
	}, inv.GPUs[0].MIG.Devices)
}

func TestCreateInventoryDeleteRoundTrip(t *testing.T) {
	gpus := board(2, nvml.DEVICE_MIG_ENABLE)
	b := testBackend(t, fakeLib(gpus))
	ctx := context.Background()

	d, err := b.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: "GPU-1", Profile: "3g.40gb", Start: 4})
	require.NoError(t, err)
	assert.Equal(t, &nvdevice.MigDevice{
		UUID: "MIG-1", ParentUUID: "GPU-1", ParentIndex: 1, Profile: "3g.40gb",
		Placement: nvdevice.Placement{Start: 4, Size: 4}, GPUInstanceID: 1, ComputeInstanceID: 0, MemoryMiB: 40448,
		Engines: nvdevice.Engines{Multiprocessors: 60, CopyEngines: 3, Decoders: 3, JPEGEngines: 3},
	}, d)
	calls := gpus[1].CreateGpuInstanceWithPlacementCalls()
	require.Len(t, calls, 1)
	assert.Equal(t, nvml.GpuInstancePlacement{Start: 4, Size: 4}, *calls[0].GpuInstancePlacement, "the placement NVML gets is in memory slices")
	assert.Equal(t, uint32(9), calls[0].GpuInstanceProfileInfo.Id, "instances are created by profile id")

	inv, err := b.Inventory(ctx)
	require.NoError(t, err)
	assert.Empty(t, inv.GPUs[0].MIG.Devices)
	require.Equal(t, []nvdevice.MigDevice{*d}, inv.GPUs[1].MIG.Devices, "the inventory sees what was created")

	ref := nvdevice.MigDeviceRef{ParentUUID: "GPU-1", GPUInstanceID: d.GPUInstanceID, ComputeInstanceID: d.ComputeInstanceID, UUID: d.UUID}
	require.NoError(t, b.DeleteMigDevice(ctx, ref))
	assert.Equal(t, []string{"ci 1/0", "gi 1"}, gpus[1].destroyed, "compute instance first, then GPU instance")
	inv, err = b.Inventory(ctx)
	require.NoError(t, err)
	assert.Empty(t, inv.GPUs[1].MIG.Devices)

	err = b.DeleteMigDevice(ctx, ref)
	assert.ErrorIs(t, err, nvdevice.ErrNotFound, "deleting twice")
}

func TestCreateMigDeviceErrors(t *testing.T) {
	for _, tc := range []struct {
		name      string
		req       nvdevice.MigCreateRequest
		migOff    bool
		existing  uint32 // start of an existing 3g.40gb, 99 for none
		giRet     nvml.Return
		ciRet     nvml.Return
		wantErr   error
		wantNVML  bool // whether NVML was asked to create the GPU instance
		wantInMsg string
	}{
		{name: "overlap", req: req("3g.40gb", 4), existing: 4, wantErr: nvdevice.ErrInsufficientResources, wantNVML: true,
			wantInMsg: "create MIG device 3g.40gb at placement start 4 on GPU GPU-0: create GPU instance at 4:4"},
		{name: "NVML refuses the placement", req: req("3g.40gb", 0), existing: 99, giRet: nvml.ERROR_INVALID_ARGUMENT, wantErr: nvdevice.ErrInvalidPlacement, wantNVML: true},
		{name: "no resources", req: req("1g.10gb", 6), existing: 99, giRet: nvml.ERROR_INSUFFICIENT_RESOURCES, wantErr: nvdevice.ErrInsufficientResources, wantNVML: true},
		{name: "GPU lost", req: req("1g.10gb", 6), existing: 99, giRet: nvml.ERROR_GPU_IS_LOST, wantErr: nvdevice.ErrGPULost, wantNVML: true},
		{name: "in use", req: req("1g.10gb", 6), existing: 99, giRet: nvml.ERROR_IN_USE, wantErr: nvdevice.ErrInUse, wantNVML: true},
		{name: "not found", req: req("1g.10gb", 6), existing: 99, giRet: nvml.ERROR_NOT_FOUND, wantErr: nvdevice.ErrNotFound, wantNVML: true},
		{name: "compute instance fails", req: req("1g.10gb", 6), existing: 99, ciRet: nvml.ERROR_INSUFFICIENT_RESOURCES, wantErr: nvdevice.ErrInsufficientResources, wantNVML: true,
			wantInMsg: "create compute instance in GPU instance 1"},
		{name: "placement the profile does not allow", req: req("3g.40gb", 2), existing: 99, wantErr: nvdevice.ErrInvalidPlacement,
			wantInMsg: "3g.40gb may start at 0, 4, not 2"},
		{name: "unknown profile", req: req("5g.50gb", 0), existing: 99, wantErr: nvdevice.ErrNotFound, wantInMsg: `no MIG profile "5g.50gb"`},
		{name: "unknown GPU", req: nvdevice.MigCreateRequest{ParentUUID: "GPU-x", Profile: "1g.10gb"}, existing: 99, wantErr: nvdevice.ErrNotFound},
		{name: "MIG mode off", req: req("1g.10gb", 0), migOff: true, existing: 99, wantErr: nvdevice.ErrMigDisabled},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mode := nvml.DEVICE_MIG_ENABLE
			if tc.migOff {
				mode = nvml.DEVICE_MIG_DISABLE
			}
			gpus := board(1, mode)
			gpu := gpus[0]
			if tc.existing != 99 {
				gpu.addGI(nvml.GPU_INSTANCE_PROFILE_3_SLICE, tc.existing, nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE)
			}
			gpu.createGIRet, gpu.createCIRet = tc.giRet, tc.ciRet
			before := len(gpu.gis)

			_, err := testBackend(t, fakeLib(gpus)).CreateMigDevice(context.Background(), tc.req)
			require.ErrorIs(t, err, tc.wantErr)
			assert.Contains(t, err.Error(), "create MIG device "+tc.req.Profile, "the error names the profile")
			assert.Contains(t, err.Error(), "on GPU "+tc.req.ParentUUID, "the error names the GPU")
			if tc.wantInMsg != "" {
				assert.Contains(t, err.Error(), tc.wantInMsg)
			}
			assert.Equal(t, tc.wantNVML, len(gpu.CreateGpuInstanceWithPlacementCalls()) > 0)
			assert.Len(t, gpu.gis, before, "nothing is left behind")
		})
	}
}

func req(profile string, start int) nvdevice.MigCreateRequest {
	return nvdevice.MigCreateRequest{ParentUUID: "GPU-0", Profile: profile, Start: start}
}

func TestDeleteMigDeviceErrors(t *testing.T) {
	for _, tc := range []struct {
		name      string
		ref       nvdevice.MigDeviceRef
		migMode   int
		busy      bool // the compute instance has processes
		wantErr   []error
		wantGIs   int
		wantInMsg string
	}{
		{name: "someone else's device at those ids", ref: nvdevice.MigDeviceRef{ParentUUID: "GPU-0", GPUInstanceID: 1, UUID: "MIG-other"},
			migMode: nvml.DEVICE_MIG_ENABLE, wantErr: []error{nvdevice.ErrNotFound}, wantGIs: 1, wantInMsg: `the MIG device there is "MIG-1", not MIG-other`},
		{name: "no such GPU instance", ref: nvdevice.MigDeviceRef{ParentUUID: "GPU-0", GPUInstanceID: 7},
			migMode: nvml.DEVICE_MIG_ENABLE, wantErr: []error{nvdevice.ErrNotFound}, wantGIs: 1},
		{name: "no such compute instance", ref: nvdevice.MigDeviceRef{ParentUUID: "GPU-0", GPUInstanceID: 1, ComputeInstanceID: 3},
			migMode: nvml.DEVICE_MIG_ENABLE, wantErr: []error{nvdevice.ErrNotFound}, wantGIs: 1},
		{name: "in use", ref: nvdevice.MigDeviceRef{ParentUUID: "GPU-0", GPUInstanceID: 1, UUID: "MIG-1"},
			migMode: nvml.DEVICE_MIG_ENABLE, busy: true, wantErr: []error{nvdevice.ErrInUse}, wantGIs: 1},
		{name: "MIG mode off", ref: nvdevice.MigDeviceRef{ParentUUID: "GPU-0", GPUInstanceID: 1},
			migMode: nvml.DEVICE_MIG_DISABLE, wantErr: []error{nvdevice.ErrNotFound, nvdevice.ErrMigDisabled}, wantGIs: 1},
		{name: "unknown GPU", ref: nvdevice.MigDeviceRef{ParentUUID: "GPU-9", GPUInstanceID: 1},
			migMode: nvml.DEVICE_MIG_ENABLE, wantErr: []error{nvdevice.ErrNotFound}, wantGIs: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gpus := board(1, tc.migMode)
			gpus[0].addGI(nvml.GPU_INSTANCE_PROFILE_3_SLICE, 0, nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE)
			gpus[0].busy = tc.busy
			b := testBackend(t, fakeLib(gpus))
			err := b.DeleteMigDevice(context.Background(), tc.ref)
			for _, want := range tc.wantErr {
				require.ErrorIs(t, err, want)
			}
			assert.Contains(t, err.Error(), "delete MIG device (GPU instance")
			assert.Contains(t, err.Error(), "on GPU "+tc.ref.ParentUUID)
			if tc.wantInMsg != "" {
				assert.Contains(t, err.Error(), tc.wantInMsg)
			}
			assert.Len(t, gpus[0].gis, tc.wantGIs)
			assert.Empty(t, gpus[0].destroyed, "nothing destroyed")
		})
	}
}
