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

const notFound = nvml.ERROR_FUNCTION_NOT_FOUND

// TestOptionalCallsMissingFromAnOlderDriver: every optional call of
// discovery answers FUNCTION_NOT_FOUND in turn (a libnvidia-ml that
// predates it); the inventory is still read, with that feature off.
func TestOptionalCallsMissingFromAnOlderDriver(t *testing.T) {
	fabric := &nvml.GpuFabricInfo{ClusterUuid: [16]uint8{1}, CliqueId: 7, State: nvml.GPU_FABRIC_STATE_COMPLETED}
	for _, tc := range []struct {
		call  string
		unset func(g *fakeGPU)
		check func(t *testing.T, g nvdevice.GPU)
	}{
		{
			call:  "GetMigMode",
			unset: func(g *fakeGPU) { g.GetMigModeFunc = func() (int, int, nvml.Return) { return 0, 0, notFound } },
			check: func(t *testing.T, g nvdevice.GPU) {
				assert.False(t, g.MIG.Capable)
				assert.Empty(t, g.MIG.Profiles)
			},
		},
		{
			call: "GetGpuInstanceProfileInfo",
			unset: func(g *fakeGPU) {
				g.GetGpuInstanceProfileInfoFunc = func(int) (nvml.GpuInstanceProfileInfo, nvml.Return) {
					return nvml.GpuInstanceProfileInfo{}, notFound
				}
			},
			check: func(t *testing.T, g nvdevice.GPU) { assert.Empty(t, g.MIG.Profiles) },
		},
		{
			call: "GetGpuInstancePossiblePlacements",
			unset: func(g *fakeGPU) {
				g.GetGpuInstancePossiblePlacementsFunc = func(*nvml.GpuInstanceProfileInfo) ([]nvml.GpuInstancePlacement, nvml.Return) {
					return nil, notFound
				}
			},
			check: func(t *testing.T, g nvdevice.GPU) {
				require.NotEmpty(t, g.MIG.Profiles)
				for _, p := range g.MIG.Profiles {
					assert.Empty(t, p.Placements, p.Name)
				}
			},
		},
		{
			call: "GetNvLinkState",
			unset: func(g *fakeGPU) {
				g.GetNvLinkStateFunc = func(int) (nvml.EnableState, nvml.Return) { return 0, notFound }
			},
			check: func(t *testing.T, g nvdevice.GPU) { assert.Empty(t, g.NVLink.Links) },
		},
		{
			call: "GetNvLinkRemotePciInfo",
			unset: func(g *fakeGPU) {
				g.GetNvLinkRemotePciInfoFunc = func(int) (nvml.PciInfo, nvml.Return) { return nvml.PciInfo{}, notFound }
			},
			check: func(t *testing.T, g nvdevice.GPU) {
				require.NotEmpty(t, g.NVLink.Links)
				assert.Empty(t, g.NVLink.Links[0].RemoteBusID)
			},
		},
		{
			call: "GetNvLinkRemoteDeviceType",
			unset: func(g *fakeGPU) {
				g.GetNvLinkRemoteDeviceTypeFunc = func(int) (nvml.IntNvLinkDeviceType, nvml.Return) { return 0, notFound }
			},
			check: func(t *testing.T, g nvdevice.GPU) {
				require.NotEmpty(t, g.NVLink.Links)
				assert.Equal(t, nvdevice.RemoteUnknown, g.NVLink.Links[0].RemoteKind)
			},
		},
		{
			call: "GetGpuFabricInfo",
			unset: func(g *fakeGPU) {
				g.GetGpuFabricInfoFunc = func() (nvml.GpuFabricInfo, nvml.Return) { return nvml.GpuFabricInfo{}, notFound }
			},
			check: func(t *testing.T, g nvdevice.GPU) {
				assert.Empty(t, g.NVLink.FabricClique)
				assert.Equal(t, "nvlink-0", g.NVLink.Domain, "an intra-node domain instead")
			},
		},
	} {
		t.Run(tc.call, func(t *testing.T) {
			gpus := board(2, nvml.DEVICE_MIG_DISABLE, "00000000:05:00.0")
			for _, g := range gpus {
				g.GetGpuFabricInfoFunc = func() (nvml.GpuFabricInfo, nvml.Return) { return *fabric, nvml.SUCCESS }
				tc.unset(g)
			}
			inv, err := testBackend(t, fakeLib(gpus)).Inventory(context.Background())
			require.NoError(t, err, "a missing optional call fails discovery")
			require.Len(t, inv.GPUs, 2)
			tc.check(t, inv.GPUs[0])
		})
	}
}

// TestMigCallsMissing: a GPU whose driver lacks the MIG-mode call is not
// MIG capable: creating a MIG device on it says so, as on a GPU without MIG.
func TestMigCallsMissing(t *testing.T) {
	gpus := board(1, nvml.DEVICE_MIG_ENABLE)
	gpus[0].GetMigModeFunc = func() (int, int, nvml.Return) { return 0, 0, notFound }
	_, err := testBackend(t, fakeLib(gpus)).CreateMigDevice(context.Background(),
		nvdevice.MigCreateRequest{ParentUUID: "GPU-0", Profile: "1g.10gb", Start: 0})
	require.ErrorIs(t, err, nvdevice.ErrMigDisabled)
}

// TestHealthEventCallsMissing: without the event calls a GPU's health is
// not watched, and the watch still starts for the others.
func TestHealthEventCallsMissing(t *testing.T) {
	for _, tc := range []struct {
		call  string
		unset func(g *fakeGPU)
	}{
		{"GetSupportedEventTypes", func(g *fakeGPU) {
			g.GetSupportedEventTypesFunc = func() (uint64, nvml.Return) { return 0, notFound }
		}},
		{"RegisterEvents", func(g *fakeGPU) {
			g.RegisterEventsFunc = func(uint64, nvml.EventSet) nvml.Return { return notFound }
		}},
	} {
		t.Run(tc.call, func(t *testing.T) {
			gpus := board(2, nvml.DEVICE_MIG_DISABLE)
			tc.unset(gpus[0])
			b, _, _ := watchedBackend(t, gpus)
			defer b.Close()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			_, err := b.WatchHealth(ctx)
			require.NoError(t, err)
			assert.Len(t, gpus[1].RegisterEventsCalls(), 1)
		})
	}
}

// TestTelemetryCallsMissing: every telemetry call answers
// FUNCTION_NOT_FOUND, and the library has no GPM at all (the mock panics
// if GPM is asked: calling a missing symbol kills the process). A pass
// still succeeds, with those readings unsupported.
func TestTelemetryCallsMissing(t *testing.T) {
	gpus := board(1, nvml.DEVICE_MIG_DISABLE)
	withTelemetry(gpus[0], telemetryFake{utilRet: notFound, powerRet: notFound, eccRet: notFound, remapRet: notFound, pcieRet: notFound})
	gpus[0].GpmQueryDeviceSupportFunc = nil
	gpus[0].GetComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) { return nil, notFound }
	samples, err := testBackend(t, fakeLib(gpus, symGpmQueryDeviceSupport)).Telemetry(context.Background())
	require.NoError(t, err)
	require.Len(t, samples, 1)
	s := samples[0]
	for name, r := range map[string]nvdevice.Reading{
		"utilization": s.GPUUtilization, "power": s.PowerWatts, "ECC": s.ECCVolatileCorrected,
		"remapped rows": s.RemappedRowsCorrectable, "PCIe": s.PCIeTXBytesPerSecond, "GPM": s.SMActive,
	} {
		assert.False(t, r.Supported, name)
	}
	assert.False(t, s.ProcessesRead)
	assert.True(t, s.FramebufferTotalBytes.Supported, "the rest is read")
}
