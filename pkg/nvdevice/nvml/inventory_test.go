//go:build cgo && linux

package nvml

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

func TestInventoryOfAnH100(t *testing.T) {
	gpus := board(2, nvml.DEVICE_MIG_DISABLE)
	inv, err := testBackend(t, fakeLib(gpus)).Inventory(context.Background())
	require.NoError(t, err)
	require.Len(t, inv.GPUs, 2)
	g, g1 := inv.GPUs[0], inv.GPUs[1]

	for _, tc := range []struct {
		field     string
		got, want any
	}{
		{"driver version", inv.DriverVersion, "570.172.08"},
		{"CUDA driver version", inv.CUDADriverVersion, "12.8"},
		{"GPU driver version", g.DriverVersion, "570.172.08"},
		{"GPU CUDA driver version", g.CUDADriverVersion, "12.8"},
		{"index", g1.Index, 1},
		{"minor", g1.Minor, 1},
		{"uuid", g.UUID, "GPU-0"},
		{"product name", g.ProductName, "NVIDIA H100 80GB HBM3"},
		{"brand", g.Brand, "NVIDIA"},
		{"architecture", g.Architecture, "Hopper"},
		{"compute capability", g.CUDAComputeCapability, "9.0"},
		{"memory MiB", g.MemoryMiB, uint64(81559)},
		{"bus id: 4-digit domain", g.PCI.BusID, "0000:18:00.0"},
		{"bus id: lower case", g1.PCI.BusID, "0000:2a:00.0"},
		{"PCI device id", g.PCI.DeviceID, "10de:2330"},
		{"no sysfs: NUMA node unknown", g.NUMANode, -1},
		{"no sysfs: PCIe root unknown", g.PCI.PCIeRoot, ""},
		{"MIG capable", g.MIG.Capable, true},
		{"MIG mode", g.MIG.Enabled, false},
		{"full GPU SMs from the 7g profile", g.Engines, nvdevice.Engines{Multiprocessors: 132, CopyEngines: 8, Decoders: 7, JPEGEngines: 7, OFAEngines: 1}},
		{"no MIG devices while MIG is off", len(g.MIG.Devices), 0},
	} {
		t.Run(tc.field, func(t *testing.T) { assert.Equal(t, tc.want, tc.got) })
	}
}

func TestNormalizeBusID(t *testing.T) {
	for _, tc := range []struct{ nvml, want string }{
		{"00000000:18:00.0", "0000:18:00.0"},
		{"00000000:2A:00.0", "0000:2a:00.0"},
		{"00000001:C1:00.0", "0001:c1:00.0"},
		{"00010000:E1:00.0", "10000:e1:00.0"}, // VMD domain, as sysfs prints it
		{"0000:18:00.0", "0000:18:00.0"},
		{"18:00.0", "18:00.0"},
		{"", ""},
	} {
		t.Run(tc.nvml, func(t *testing.T) {
			assert.Equal(t, tc.want, normalizeBusID(func() []int8 { b := cString(tc.nvml); return b[:] }()))
		})
	}
}

func TestNames(t *testing.T) {
	for _, tc := range []struct {
		got, want string
	}{
		{brandName(nvml.BRAND_NVIDIA), "NVIDIA"},
		{brandName(nvml.BRAND_TESLA), "Tesla"},
		{brandName(nvml.BRAND_NVIDIA_RTX), "NVIDIA RTX"},
		{brandName(nvml.BrandType(99)), "Unknown"},
		{architectureName(nvml.DEVICE_ARCH_HOPPER), "Hopper"},
		{architectureName(nvml.DEVICE_ARCH_AMPERE), "Ampere"},
		{architectureName(nvml.DEVICE_ARCH_BLACKWELL), "Blackwell"},
		{architectureName(nvml.DEVICE_ARCH_ADA), "Ada Lovelace"},
		{architectureName(nvml.DEVICE_ARCH_UNKNOWN), "Unknown"},
		{cudaVersion(12080), "12.8"},
		{cudaVersion(12020), "12.2"},
		{cudaVersion(13000), "13.0"},
	} {
		assert.Equal(t, tc.want, tc.got)
	}
}

func TestSysfsTopology(t *testing.T) {
	for _, tc := range []struct {
		name     string
		link     string // target of /sys/bus/pci/devices/0000:18:00.0
		numa     string
		wantRoot string
		wantNUMA int
	}{
		{"behind a bridge", "../../../devices/pci0000:15/0000:15:01.0/0000:18:00.0", "1\n", "pci0000:15", 1},
		{"on the root bus", "../../../devices/pci0000:17/0000:18:00.0", "0\n", "pci0000:17", 0},
		{"no NUMA affinity", "../../../devices/pci0000:15/0000:18:00.0", "-1\n", "pci0000:15", -1},
		{"link to another device", "../../../devices/pci0000:15/0000:19:00.0", "", "", -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sysfs := t.TempDir()
			target := filepath.Join(sysfs, "bus/pci/devices", tc.link)
			require.NoError(t, os.MkdirAll(target, 0o755))
			require.NoError(t, os.MkdirAll(filepath.Join(sysfs, "bus/pci/devices"), 0o755))
			if tc.numa != "" {
				require.NoError(t, os.WriteFile(filepath.Join(target, "numa_node"), []byte(tc.numa), 0o644))
			}
			require.NoError(t, os.Symlink(tc.link, filepath.Join(sysfs, "bus/pci/devices/0000:18:00.0")))

			lib := fakeLib(board(1, nvml.DEVICE_MIG_DISABLE))
			b := testBackend(t, lib)
			b.sysfs = sysfs
			inv, err := b.Inventory(context.Background())
			require.NoError(t, err)
			assert.Equal(t, tc.wantRoot, inv.GPUs[0].PCI.PCIeRoot)
			assert.Equal(t, tc.wantNUMA, inv.GPUs[0].NUMANode)
		})
	}
}

func TestInventoryLeavesOutALostGPU(t *testing.T) {
	gpus := board(3, nvml.DEVICE_MIG_DISABLE)
	gpus[1].GetMemoryInfoFunc = func() (nvml.Memory, nvml.Return) { return nvml.Memory{}, nvml.ERROR_GPU_IS_LOST }
	inv, err := testBackend(t, fakeLib(gpus)).Inventory(context.Background())
	require.NoError(t, err)
	var uuids []string
	for _, g := range inv.GPUs {
		uuids = append(uuids, g.UUID)
	}
	assert.Equal(t, []string{"GPU-0", "GPU-2"}, uuids)
}

func TestInventoryFailsOnOtherErrors(t *testing.T) {
	gpus := board(2, nvml.DEVICE_MIG_DISABLE)
	gpus[1].GetCudaComputeCapabilityFunc = func() (int, int, nvml.Return) { return 0, 0, nvml.ERROR_UNKNOWN }
	_, err := testBackend(t, fakeLib(gpus)).Inventory(context.Background())
	require.Error(t, err)
	assert.Contains(t, err.Error(), "compute capability of GPU 1 (GPU-1)")
	assert.ErrorIs(t, err, nvml.ERROR_UNKNOWN)
}

func TestClosedBackend(t *testing.T) {
	lib := fakeLib(board(1, nvml.DEVICE_MIG_DISABLE))
	b := testBackend(t, lib)
	require.NoError(t, b.Close())
	require.NoError(t, b.Close(), "closing twice is fine")
	assert.Len(t, lib.ShutdownCalls(), 1, "NVML is shut down once")

	_, err := b.Inventory(context.Background())
	assert.ErrorIs(t, err, errClosed)
	_, err = b.CreateMigDevice(context.Background(), nvdevice.MigCreateRequest{ParentUUID: "GPU-0", Profile: "1g.10gb"})
	assert.ErrorIs(t, err, errClosed)
	_, err = b.WatchHealth(context.Background())
	assert.ErrorIs(t, err, errClosed)
	assert.Empty(t, lib.DeviceGetCountCalls(), "no NVML call after Close")
}
