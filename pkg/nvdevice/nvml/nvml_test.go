//go:build cgo

package nvml

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

func busID(s string) [32]int8 {
	var b [32]int8
	for i, c := range s {
		b[i] = int8(c)
	}
	return b
}

// h100Profiles is what NVML reports for an H100 80GB (by profile enum).
var h100Profiles = map[int]nvml.GpuInstanceProfileInfo{
	nvml.GPU_INSTANCE_PROFILE_1_SLICE:      {Id: 19, SliceCount: 1, InstanceCount: 7, MultiprocessorCount: 16, CopyEngineCount: 1, DecoderCount: 1, JpegCount: 1, MemorySizeMB: 9984},
	nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1: {Id: 20, SliceCount: 1, InstanceCount: 1, MultiprocessorCount: 16, CopyEngineCount: 1, DecoderCount: 1, JpegCount: 1, OfaCount: 1, MemorySizeMB: 9984},
	nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2: {Id: 15, SliceCount: 1, InstanceCount: 4, MultiprocessorCount: 26, CopyEngineCount: 1, DecoderCount: 1, JpegCount: 1, MemorySizeMB: 20096},
	nvml.GPU_INSTANCE_PROFILE_2_SLICE:      {Id: 14, SliceCount: 2, InstanceCount: 3, MultiprocessorCount: 32, CopyEngineCount: 2, DecoderCount: 2, JpegCount: 2, MemorySizeMB: 20096},
	nvml.GPU_INSTANCE_PROFILE_3_SLICE:      {Id: 9, SliceCount: 3, InstanceCount: 2, MultiprocessorCount: 60, CopyEngineCount: 3, DecoderCount: 3, JpegCount: 3, MemorySizeMB: 40448},
	nvml.GPU_INSTANCE_PROFILE_4_SLICE:      {Id: 5, SliceCount: 4, InstanceCount: 1, MultiprocessorCount: 64, CopyEngineCount: 4, DecoderCount: 4, JpegCount: 4, MemorySizeMB: 40448},
	nvml.GPU_INSTANCE_PROFILE_7_SLICE:      {Id: 0, SliceCount: 7, InstanceCount: 1, MultiprocessorCount: 132, CopyEngineCount: 8, DecoderCount: 7, JpegCount: 7, OfaCount: 1, MemorySizeMB: 81152},
}

var h100Placements = map[uint32][]nvml.GpuInstancePlacement{
	19: {{Start: 0, Size: 1}, {Start: 1, Size: 1}, {Start: 2, Size: 1}, {Start: 3, Size: 1}, {Start: 4, Size: 1}, {Start: 5, Size: 1}, {Start: 6, Size: 1}},
	20: {{Start: 0, Size: 1}, {Start: 1, Size: 1}, {Start: 2, Size: 1}, {Start: 3, Size: 1}, {Start: 4, Size: 1}, {Start: 5, Size: 1}, {Start: 6, Size: 1}},
	15: {{Start: 0, Size: 2}, {Start: 2, Size: 2}, {Start: 4, Size: 2}, {Start: 6, Size: 2}},
	14: {{Start: 0, Size: 2}, {Start: 2, Size: 2}, {Start: 4, Size: 2}},
	9:  {{Start: 0, Size: 4}, {Start: 4, Size: 4}},
	5:  {{Start: 0, Size: 4}},
	0:  {{Start: 0, Size: 8}},
}

// fakeH100 is an H100 SXM5 behind go-nvml's generated mocks, its links to
// the given NVSwitch bus ids.
func fakeH100(index int, uuid, bus string, migMode int, switches []string, fabric *nvml.GpuFabricInfo) *mock.Device {
	return &mock.Device{
		GetUUIDFunc:        func() (string, nvml.Return) { return uuid, nvml.SUCCESS },
		GetMinorNumberFunc: func() (int, nvml.Return) { return index, nvml.SUCCESS },
		GetIndexFunc:       func() (int, nvml.Return) { return index, nvml.SUCCESS },
		GetNameFunc:        func() (string, nvml.Return) { return "NVIDIA H100 80GB HBM3", nvml.SUCCESS },
		GetBrandFunc:       func() (nvml.BrandType, nvml.Return) { return nvml.BRAND_NVIDIA, nvml.SUCCESS },
		GetArchitectureFunc: func() (nvml.DeviceArchitecture, nvml.Return) {
			return nvml.DEVICE_ARCH_HOPPER, nvml.SUCCESS
		},
		GetCudaComputeCapabilityFunc: func() (int, int, nvml.Return) { return 9, 0, nvml.SUCCESS },
		GetMemoryInfoFunc: func() (nvml.Memory, nvml.Return) {
			return nvml.Memory{Total: 81559 << 20}, nvml.SUCCESS
		},
		GetPciInfoFunc: func() (nvml.PciInfo, nvml.Return) {
			return nvml.PciInfo{BusId: busID(bus), PciDeviceId: 0x233010de}, nvml.SUCCESS
		},
		GetMigModeFunc: func() (int, int, nvml.Return) { return migMode, migMode, nvml.SUCCESS },
		GetGpuInstanceProfileInfoFunc: func(p int) (nvml.GpuInstanceProfileInfo, nvml.Return) {
			if info, ok := h100Profiles[p]; ok {
				return info, nvml.SUCCESS
			}
			return nvml.GpuInstanceProfileInfo{}, nvml.ERROR_NOT_SUPPORTED
		},
		GetGpuInstancePossiblePlacementsFunc: func(info *nvml.GpuInstanceProfileInfo) ([]nvml.GpuInstancePlacement, nvml.Return) {
			return h100Placements[info.Id], nvml.SUCCESS
		},
		GetMaxMigDeviceCountFunc: func() (int, nvml.Return) { return 0, nvml.SUCCESS },
		GetGpuInstancesFunc: func(*nvml.GpuInstanceProfileInfo) ([]nvml.GpuInstance, nvml.Return) {
			return nil, nvml.SUCCESS
		},
		GetNvLinkStateFunc: func(l int) (nvml.EnableState, nvml.Return) {
			if len(switches) == 0 {
				return 0, nvml.ERROR_NOT_SUPPORTED
			}
			if l >= 18 {
				return 0, nvml.ERROR_INVALID_ARGUMENT
			}
			return nvml.FEATURE_ENABLED, nvml.SUCCESS
		},
		GetNvLinkRemotePciInfoFunc: func(l int) (nvml.PciInfo, nvml.Return) {
			return nvml.PciInfo{BusId: busID(switches[l%len(switches)])}, nvml.SUCCESS
		},
		GetNvLinkRemoteDeviceTypeFunc: func(int) (nvml.IntNvLinkDeviceType, nvml.Return) {
			return nvml.NVLINK_DEVICE_TYPE_SWITCH, nvml.SUCCESS
		},
		GetGpuFabricInfoFunc: func() (nvml.GpuFabricInfo, nvml.Return) {
			if fabric == nil {
				return nvml.GpuFabricInfo{}, nvml.ERROR_NOT_SUPPORTED
			}
			return *fabric, nvml.SUCCESS
		},
	}
}

func fakeLib(devs ...*mock.Device) *mock.Interface {
	return &mock.Interface{
		SystemGetDriverVersionFunc:     func() (string, nvml.Return) { return "570.172.08", nvml.SUCCESS },
		SystemGetCudaDriverVersionFunc: func() (int, nvml.Return) { return 12080, nvml.SUCCESS },
		DeviceGetCountFunc:             func() (int, nvml.Return) { return len(devs), nvml.SUCCESS },
		DeviceGetHandleByIndexFunc: func(i int) (nvml.Device, nvml.Return) {
			return devs[i], nvml.SUCCESS
		},
		DeviceGetHandleByUUIDFunc: func(uuid string) (nvml.Device, nvml.Return) {
			for _, d := range devs {
				if u, _ := d.GetUUID(); u == uuid {
					return d, nvml.SUCCESS
				}
			}
			return nil, nvml.ERROR_NOT_FOUND
		},
		ShutdownFunc: func() nvml.Return { return nvml.SUCCESS },
	}
}

func TestInventoryOfAnH100Board(t *testing.T) {
	switches := []string{"00000000:05:00.0", "00000000:06:00.0"}
	lib := fakeLib(
		fakeH100(0, "GPU-a", "00000000:18:00.0", nvml.DEVICE_MIG_ENABLE, switches, nil),
		fakeH100(1, "GPU-b", "00000000:2A:00.0", nvml.DEVICE_MIG_DISABLE, switches, nil),
	)
	b := newBackend(lib, t.TempDir())
	inv, err := b.Inventory(context.Background())
	require.NoError(t, err)
	assert.Equal(t, "570.172.08", inv.DriverVersion)
	assert.Equal(t, "12.8", inv.CUDADriverVersion)
	require.Len(t, inv.GPUs, 2)
	g := inv.GPUs[0]
	assert.Equal(t, "NVIDIA H100 80GB HBM3", g.ProductName)
	assert.Equal(t, uint64(81559), g.MemoryMiB)
	assert.Equal(t, "9.0", g.CUDAComputeCapability)
	assert.Equal(t, "Hopper", g.Architecture)
	assert.Equal(t, "NVIDIA", g.Brand)
	assert.Equal(t, "0000:18:00.0", g.PCI.BusID)
	assert.Equal(t, "0000:2a:00.0", inv.GPUs[1].PCI.BusID, "bus ids are lower case with a 4-digit domain")
	assert.Equal(t, "10de:2330", g.PCI.DeviceID)
	assert.Equal(t, -1, g.NUMANode, "no sysfs entry, no NUMA node")
	assert.Equal(t, 132, g.Engines.Multiprocessors, "full-GPU units come from the 7-slice profile")
	assert.True(t, g.MIG.Enabled)
	assert.False(t, inv.GPUs[1].MIG.Enabled)

	names := map[string][]nvdevice.Placement{}
	for _, p := range g.MIG.Profiles {
		names[p.Name] = p.Placements
	}
	assert.Len(t, names, 7)
	assert.Len(t, names["1g.10gb"], 7)
	assert.Len(t, names["1g.10gb+me"], 7)
	assert.Equal(t, []nvdevice.Placement{{Start: 0, Size: 2}, {Start: 2, Size: 2}, {Start: 4, Size: 2}, {Start: 6, Size: 2}}, names["1g.20gb"])
	assert.Equal(t, []nvdevice.Placement{{Start: 0, Size: 4}, {Start: 4, Size: 4}}, names["3g.40gb"])
	assert.Contains(t, names, "7g.80gb")

	assert.Equal(t, 18, g.NVLink.ActiveLinks())
	assert.Equal(t, nvdevice.RemoteNVSwitch, g.NVLink.Links[0].RemoteKind)
	assert.Equal(t, "nvlink-a", g.NVLink.Domain)
	assert.Equal(t, g.NVLink.Domain, inv.GPUs[1].NVLink.Domain, "GPUs on common NVSwitches share a domain")
}

func TestFabricClique(t *testing.T) {
	fabric := &nvml.GpuFabricInfo{ClusterUuid: [16]uint8{0x4d, 0x1c, 0x2b, 0x3a, 0x9e, 0x8f, 0x4a, 0x7b, 0x8c, 0x6d, 0x5e, 0x4f, 0x3a, 0x2b, 0x1c, 0x0d}, CliqueId: 7}
	zero := &nvml.GpuFabricInfo{CliqueId: 7}
	for _, tc := range []struct {
		name       string
		fabric     *nvml.GpuFabricInfo
		wantClique string
	}{
		{"multi-node NVLink", fabric, "4d1c2b3a-9e8f-4a7b-8c6d-5e4f3a2b1c0d.7"},
		{"HGX H100: zero cluster UUID", zero, ""},
		{"no fabric support", nil, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lib := fakeLib(fakeH100(0, "GPU-a", "00000000:18:00.0", 0, []string{"00000000:05:00.0"}, tc.fabric))
			inv, err := newBackend(lib, t.TempDir()).Inventory(context.Background())
			require.NoError(t, err)
			assert.Equal(t, tc.wantClique, inv.GPUs[0].NVLink.FabricClique)
			if tc.wantClique != "" {
				assert.Equal(t, tc.wantClique, inv.GPUs[0].NVLink.Domain)
			} else {
				assert.Equal(t, "nvlink-a", inv.GPUs[0].NVLink.Domain)
			}
		})
	}
}

func TestNoNVLink(t *testing.T) {
	inv, err := newBackend(fakeLib(fakeH100(0, "GPU-a", "00000000:18:00.0", 0, nil, nil)), t.TempDir()).Inventory(context.Background())
	require.NoError(t, err)
	assert.Empty(t, inv.GPUs[0].NVLink.Links)
	assert.Empty(t, inv.GPUs[0].NVLink.Domain)
}

func TestCreateMigDeviceErrors(t *testing.T) {
	for _, tc := range []struct {
		name    string
		ret     nvml.Return
		wantErr error
	}{
		{"overlap", nvml.ERROR_INSUFFICIENT_RESOURCES, nvdevice.ErrInsufficientResources},
		{"bad placement", nvml.ERROR_INVALID_ARGUMENT, nvdevice.ErrInvalidPlacement},
		{"lost", nvml.ERROR_GPU_IS_LOST, nvdevice.ErrGPULost},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dev := fakeH100(0, "GPU-a", "00000000:18:00.0", nvml.DEVICE_MIG_ENABLE, nil, nil)
			var placement *nvml.GpuInstancePlacement
			dev.CreateGpuInstanceWithPlacementFunc = func(_ *nvml.GpuInstanceProfileInfo, p *nvml.GpuInstancePlacement) (nvml.GpuInstance, nvml.Return) {
				placement = p
				return nil, tc.ret
			}
			_, err := newBackend(fakeLib(dev), t.TempDir()).CreateMigDevice(context.Background(),
				nvdevice.MigCreateRequest{ParentUUID: "GPU-a", Profile: "3g.40gb", Start: 4})
			require.ErrorIs(t, err, tc.wantErr)
			assert.Contains(t, err.Error(), "create MIG 3g.40gb at placement start 4 on GPU GPU-a")
			assert.Equal(t, &nvml.GpuInstancePlacement{Start: 4, Size: 3}, placement, "slice count is passed as NVML expects")
		})
	}

	dev := fakeH100(0, "GPU-a", "00000000:18:00.0", nvml.DEVICE_MIG_DISABLE, nil, nil)
	_, err := newBackend(fakeLib(dev), t.TempDir()).CreateMigDevice(context.Background(),
		nvdevice.MigCreateRequest{ParentUUID: "GPU-a", Profile: "3g.40gb", Start: 4})
	require.ErrorIs(t, err, nvdevice.ErrMigDisabled)
}

func TestCreateMigDeviceRollsBackTheGPUInstance(t *testing.T) {
	dev := fakeH100(0, "GPU-a", "00000000:18:00.0", nvml.DEVICE_MIG_ENABLE, nil, nil)
	destroyed := false
	gi := &mock.GpuInstance{
		GetInfoFunc: func() (nvml.GpuInstanceInfo, nvml.Return) {
			return nvml.GpuInstanceInfo{Id: 2, Placement: nvml.GpuInstancePlacement{Start: 0, Size: 1}}, nvml.SUCCESS
		},
		GetComputeInstanceProfileInfoFunc: func(int, int) (nvml.ComputeInstanceProfileInfo, nvml.Return) {
			return nvml.ComputeInstanceProfileInfo{Id: 0}, nvml.SUCCESS
		},
		CreateComputeInstanceFunc: func(*nvml.ComputeInstanceProfileInfo) (nvml.ComputeInstance, nvml.Return) {
			return nil, nvml.ERROR_INSUFFICIENT_RESOURCES
		},
		DestroyFunc: func() nvml.Return { destroyed = true; return nvml.SUCCESS },
	}
	dev.CreateGpuInstanceWithPlacementFunc = func(*nvml.GpuInstanceProfileInfo, *nvml.GpuInstancePlacement) (nvml.GpuInstance, nvml.Return) {
		return gi, nvml.SUCCESS
	}
	_, err := newBackend(fakeLib(dev), t.TempDir()).CreateMigDevice(context.Background(),
		nvdevice.MigCreateRequest{ParentUUID: "GPU-a", Profile: "1g.10gb", Start: 0})
	require.ErrorIs(t, err, nvdevice.ErrInsufficientResources)
	assert.True(t, destroyed, "the GPU instance is destroyed when its compute instance fails")
}

func TestCreateAndDeleteMigDevice(t *testing.T) {
	dev := fakeH100(0, "GPU-a", "00000000:18:00.0", nvml.DEVICE_MIG_ENABLE, nil, nil)
	migDev := &mock.Device{GetUUIDFunc: func() (string, nvml.Return) { return "MIG-x", nvml.SUCCESS }}
	var calls []string
	ci := &mock.ComputeInstance{
		GetInfoFunc: func() (nvml.ComputeInstanceInfo, nvml.Return) {
			return nvml.ComputeInstanceInfo{Id: 0, Device: migDev}, nvml.SUCCESS
		},
		DestroyFunc: func() nvml.Return { calls = append(calls, "ci"); return nvml.SUCCESS },
	}
	gi := &mock.GpuInstance{
		GetInfoFunc: func() (nvml.GpuInstanceInfo, nvml.Return) {
			return nvml.GpuInstanceInfo{Id: 1, Placement: nvml.GpuInstancePlacement{Start: 4, Size: 4}}, nvml.SUCCESS
		},
		GetComputeInstanceProfileInfoFunc: func(p, e int) (nvml.ComputeInstanceProfileInfo, nvml.Return) {
			assert.Equal(t, nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE, p)
			return nvml.ComputeInstanceProfileInfo{}, nvml.SUCCESS
		},
		CreateComputeInstanceFunc: func(*nvml.ComputeInstanceProfileInfo) (nvml.ComputeInstance, nvml.Return) {
			return ci, nvml.SUCCESS
		},
		GetComputeInstanceByIdFunc: func(int) (nvml.ComputeInstance, nvml.Return) { return ci, nvml.SUCCESS },
		DestroyFunc:                func() nvml.Return { calls = append(calls, "gi"); return nvml.SUCCESS },
	}
	dev.CreateGpuInstanceWithPlacementFunc = func(*nvml.GpuInstanceProfileInfo, *nvml.GpuInstancePlacement) (nvml.GpuInstance, nvml.Return) {
		return gi, nvml.SUCCESS
	}
	dev.GetGpuInstanceByIdFunc = func(int) (nvml.GpuInstance, nvml.Return) { return gi, nvml.SUCCESS }
	b := newBackend(fakeLib(dev), t.TempDir())
	d, err := b.CreateMigDevice(context.Background(), nvdevice.MigCreateRequest{ParentUUID: "GPU-a", Profile: "3g.40gb", Start: 4})
	require.NoError(t, err)
	assert.Equal(t, "MIG-x", d.UUID)
	assert.Equal(t, 1, d.GPUInstanceID)
	assert.Equal(t, nvdevice.Placement{Start: 4, Size: 4}, d.Placement)
	assert.Equal(t, uint64(40448), d.MemoryMiB)

	ref := nvdevice.MigDeviceRef{ParentUUID: "GPU-a", GPUInstanceID: 1, UUID: "MIG-other"}
	require.ErrorIs(t, b.DeleteMigDevice(context.Background(), ref), nvdevice.ErrNotFound, "UUID mismatch")
	assert.Empty(t, calls)
	ref.UUID = "MIG-x"
	require.NoError(t, b.DeleteMigDevice(context.Background(), ref))
	assert.Equal(t, []string{"ci", "gi"}, calls, "compute instance first, then GPU instance")
}

func TestProfileNames(t *testing.T) {
	want := map[int]string{
		nvml.GPU_INSTANCE_PROFILE_1_SLICE: "1g.10gb", nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1: "1g.10gb+me",
		nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2: "1g.20gb", nvml.GPU_INSTANCE_PROFILE_2_SLICE: "2g.20gb",
		nvml.GPU_INSTANCE_PROFILE_3_SLICE: "3g.40gb", nvml.GPU_INSTANCE_PROFILE_4_SLICE: "4g.40gb",
		nvml.GPU_INSTANCE_PROFILE_7_SLICE: "7g.80gb",
	}
	for idx, name := range want {
		assert.Equal(t, name, ProfileName(idx, h100Profiles[idx]))
	}
}

func TestTranslateEvent(t *testing.T) {
	dev := &mock.Device{GetUUIDFunc: func() (string, nvml.Return) { return "GPU-a", nvml.SUCCESS }}
	ev, ok := translateEvent(nvml.EventData{Device: dev, EventType: nvml.EventTypeXidCriticalError, EventData: 79, GpuInstanceId: 0xFFFFFFFF}, nvml.SUCCESS)
	require.True(t, ok)
	assert.Equal(t, nvdevice.HealthXID, ev.Kind)
	assert.Equal(t, uint64(79), ev.XID)
	assert.Equal(t, "GPU-a", ev.GPUUUID)
	assert.True(t, ev.Critical())

	_, ok = translateEvent(nvml.EventData{}, nvml.ERROR_TIMEOUT)
	assert.False(t, ok, "a timeout is not an event")

	ev, ok = translateEvent(nvml.EventData{Device: dev}, nvml.ERROR_GPU_IS_LOST)
	require.True(t, ok)
	assert.Equal(t, nvdevice.HealthGPULost, ev.Kind)
}

func TestNewWithoutDriver(t *testing.T) {
	root := t.TempDir()
	_, err := New(context.Background(), Options{DriverRoot: root})
	require.ErrorIs(t, err, nvdevice.ErrLibraryNotFound)
	assert.Contains(t, err.Error(), "NVIDIA driver library not found: looked for libnvidia-ml.so.1 in "+root+"/usr/lib64")
	assert.NotContains(t, err.Error(), "\n", "one line")
}

func TestSysfsTopology(t *testing.T) {
	sysfs := t.TempDir()
	devDir := filepath.Join(sysfs, "devices/pci0000:15/0000:15:01.0/0000:18:00.0")
	require.NoError(t, os.MkdirAll(devDir, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(devDir, "numa_node"), []byte("1\n"), 0o644))
	require.NoError(t, os.MkdirAll(filepath.Join(sysfs, "bus/pci/devices"), 0o755))
	require.NoError(t, os.Symlink("../../../devices/pci0000:15/0000:15:01.0/0000:18:00.0", filepath.Join(sysfs, "bus/pci/devices/0000:18:00.0")))

	inv, err := newBackend(fakeLib(fakeH100(0, "GPU-a", "00000000:18:00.0", 0, nil, nil)), sysfs).Inventory(context.Background())
	require.NoError(t, err)
	assert.Equal(t, "pci0000:15", inv.GPUs[0].PCI.PCIeRoot)
	assert.Equal(t, 1, inv.GPUs[0].NUMANode)
}
