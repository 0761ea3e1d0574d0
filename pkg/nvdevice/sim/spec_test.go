package sim

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

func TestParseSpec(t *testing.T) {
	tests := []struct {
		name    string
		yaml    string
		wantErr string
	}{
		{name: "minimal", yaml: "name: x\ngpuCount: 2\n"},
		{name: "full", yaml: `
name: two
gpuModel: h100-sxm5
gpuCount: 2
nvlink: nvswitch
migEnabled: [0]
migDevices:
- {gpu: 0, profile: 3g.40gb, start: 4}
fabric: {clusterUUID: 4d1c2b3a-0000-4000-8000-000000000001, cliqueID: 7}
driverVersion: 550.90.07
cudaDriverVersion: "12.4"
`},
		{name: "unknown field", yaml: "name: x\ngpuCount: 1\ngpus: 3\n", wantErr: `unknown field "gpus"`},
		{name: "no GPUs", yaml: "name: x\n", wantErr: "gpuCount: must be between 1 and 64, got 0"},
		{name: "bad model", yaml: "name: x\ngpuCount: 1\ngpuModel: a100\n", wantErr: `gpuModel: unknown model "a100"`},
		{name: "pcie has no nvlink", yaml: "name: x\ngpuCount: 1\ngpuModel: h100-pcie\nnvlink: nvswitch\n", wantErr: "nvlink: model h100-pcie has no NVLink"},
		{name: "bridged pairs", yaml: "name: x\ngpuCount: 4\ngpuModel: h100-pcie\nnvlink: bridged-pairs\n"},
		{name: "bridged pairs, odd count", yaml: "name: x\ngpuCount: 3\ngpuModel: h100-pcie\nnvlink: bridged-pairs\n", wantErr: "nvlink: bridged-pairs needs an even gpuCount, got 3"},
		{name: "sxm5 has no bridges", yaml: "name: x\ngpuCount: 2\nnvlink: bridged-pairs\n", wantErr: "nvlink: model h100-sxm5 has no NVLink bridges"},
		{name: "unknown nvlink", yaml: "name: x\ngpuCount: 2\nnvlink: ring\n", wantErr: `nvlink: unknown topology "ring"`},
		{name: "bad migEnabled", yaml: "name: x\ngpuCount: 1\nmigEnabled: some\n", wantErr: "migEnabled: want"},
		{name: "migEnabled out of range", yaml: "name: x\ngpuCount: 1\nmigEnabled: [3]\n", wantErr: "migEnabled: GPU index 3 out of range"},
		{name: "mig device without MIG", yaml: "name: x\ngpuCount: 2\nmigEnabled: [0]\nmigDevices: [{gpu: 1, profile: 1g.10gb, start: 0}]\n", wantErr: "migDevices[0].gpu: MIG is not enabled on GPU 1"},
		{name: "mixed products", yaml: "name: x\ngpuCount: 3\nnvlink: nvswitch\nmigEnabled: all\notherModels: [{model: l40s, gpus: [2]}]\n"},
		{name: "other model unknown", yaml: "name: x\ngpuCount: 2\notherModels: [{model: a100, gpus: [1]}]\n", wantErr: `otherModels[0].model: unknown model "a100"`},
		{name: "other model out of range", yaml: "name: x\ngpuCount: 2\notherModels: [{model: l40s, gpus: [2]}]\n", wantErr: "otherModels[0].gpus: GPU index 2 out of range [0,2)"},
		{name: "other model named twice", yaml: "name: x\ngpuCount: 2\notherModels: [{model: l40s, gpus: [1]}, {model: h200-sxm, gpus: [1]}]\n", wantErr: "otherModels[1].gpus: GPU 1 is named twice"},
		{name: "other model without GPUs", yaml: "name: x\ngpuCount: 2\notherModels: [{model: l40s}]\n", wantErr: "otherModels[0].gpus: name at least one GPU index"},
		{name: "MIG on a product without MIG", yaml: "name: x\ngpuCount: 2\nmigEnabled: [1]\notherModels: [{model: l40s, gpus: [1]}]\n", wantErr: "migEnabled: GPU 1 is a l40s, which is not MIG-capable"},
		{name: "bridged pairs with a product without bridges", yaml: "name: x\ngpuCount: 2\ngpuModel: h100-pcie\nnvlink: bridged-pairs\notherModels: [{model: l40s, gpus: [1]}]\n", wantErr: "otherModels[0].model: l40s has no NVLink bridges"},
		{name: "bad cluster uuid", yaml: "name: x\ngpuCount: 1\nnvlink: nvswitch\nfabric: {clusterUUID: nope}\n", wantErr: "fabric.clusterUUID"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseSpec([]byte(tc.yaml))
			if tc.wantErr == "" {
				require.NoError(t, err)
				return
			}
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.wantErr)
		})
	}
}

func TestSpecFileMachine(t *testing.T) {
	file := filepath.Join(t.TempDir(), "m.yaml")
	require.NoError(t, os.WriteFile(file, []byte(`
name: two
gpuCount: 2
nvlink: nvswitch
migEnabled: all
migDevices:
- {gpu: 1, profile: 3g.40gb, start: 4}
- {gpu: 1, profile: 2g.20gb, start: 0}
fabric: {clusterUUID: 4d1c2b3a-0000-4000-8000-000000000001, cliqueID: 7}
`), 0o600))
	m, err := NewBuiltin(file, "node-x")
	require.NoError(t, err)
	inv := inventory(t, m)
	require.Len(t, inv.GPUs, 2)
	assert.Empty(t, inv.GPUs[0].MIG.Devices)
	require.Len(t, inv.GPUs[1].MIG.Devices, 2)
	assert.Equal(t, "3g.40gb", inv.GPUs[1].MIG.Devices[0].Profile)
	assert.Equal(t, "4d1c2b3a-0000-4000-8000-000000000001.7", inv.GPUs[0].NVLink.FabricClique)

	_, err = NewBuiltin(filepath.Join(t.TempDir(), "missing.yaml"), "n")
	require.ErrorContains(t, err, "neither a built-in machine (dgx-h100, dgx-h100-nomig, h100-nvlink-fabric, h100-pcie, h100-pcie-nvlink, hgx-h200, hgx-h200-nomig) nor a readable file")
}

func TestSpecMigDevicesObeyHardwareRules(t *testing.T) {
	spec, err := ParseSpec([]byte("name: x\ngpuCount: 1\nmigEnabled: all\nmigDevices:\n- {gpu: 0, profile: 4g.40gb, start: 0}\n- {gpu: 0, profile: 3g.40gb, start: 0}\n"))
	require.NoError(t, err)
	_, err = New(spec, "n")
	require.ErrorContains(t, err, "migDevices[1]")
	require.ErrorContains(t, err, "overlaps")
}

// FuzzParseSpec: a machine file never panics the parser, and a spec it
// accepts always builds a machine.
func FuzzParseSpec(f *testing.F) {
	f.Add([]byte("name: x\ngpuCount: 2\nmigEnabled: all\nmigDevices:\n- {gpu: 0, profile: 3g.40gb, start: 4}\n"))
	f.Add([]byte("gpuCount: 1\nnvlink: nvswitch\nfabric: {clusterUUID: 4d1c2b3a-0000-4000-8000-000000000001, cliqueID: 7}\n"))
	f.Add([]byte("migEnabled: [0, 9]\n"))
	f.Add([]byte("name: x\ngpuModel: h100-pcie\ngpuCount: 4\nnvlink: bridged-pairs\n"))
	f.Add([]byte("gpuModel: h100-pcie\ngpuCount: 3\nnvlink: bridged-pairs\nmigEnabled: all\n"))
	f.Add([]byte("gpuCount: 2\nnvlink: bridged-pairs\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		spec, err := ParseSpec(b)
		if err != nil {
			return
		}
		m, err := New(spec, "n")
		if err != nil {
			// Only the hardware rules on listed MIG devices may refuse a valid spec.
			if len(spec.MigDevices) == 0 {
				t.Fatalf("valid spec without MIG devices failed to build: %v", err)
			}
			return
		}
		inv, err := m.Inventory(t.Context())
		if err != nil || len(inv.GPUs) != spec.GPUCount {
			t.Fatalf("inventory: %v, %d GPUs for gpuCount %d", err, len(inv.GPUs), spec.GPUCount)
		}
	})
}

// TestSpecRoundTrip: a spec written out (devcluster hands a real node's
// plugin its machine as a file) reads back the same, whichever form
// migEnabled has.
func TestSpecRoundTrip(t *testing.T) {
	for _, mig := range []MigEnabledSpec{{All: true}, {}, {Indexes: []int{6, 7}}, {Indexes: []int{0}}} {
		spec := MachineSpec{Name: "m", GPUModel: ModelH100SXM5, GPUCount: 8, NVLink: NVLinkNVSwitch, MigEnabled: mig}
		data, err := yaml.Marshal(spec)
		require.NoError(t, err, "migEnabled %+v", mig)
		back, err := ParseSpec(data)
		require.NoError(t, err, "migEnabled %+v:\n%s", mig, data)
		assert.Equal(t, spec.MigEnabled, back.MigEnabled, "%s", data)
		assert.Equal(t, spec.GPUCount, back.GPUCount)
	}
}

// TestMixedMachine builds examples/machines/h100-l40s-mixed.yaml: the
// H100s are MIG-capable and in MIG mode ("all"), the L40S cards are
// neither, have no NVLink and take no MIG device; telemetry reads each
// product's own figures (no GPM on the L40S).
func TestMixedMachine(t *testing.T) {
	m, err := NewBuiltin("../../../examples/machines/h100-l40s-mixed.yaml", "node-a")
	require.NoError(t, err)
	ctx := context.Background()
	inv, err := m.Inventory(ctx)
	require.NoError(t, err)
	require.Len(t, inv.GPUs, 4)
	for _, g := range inv.GPUs[:2] {
		assert.Equal(t, "NVIDIA H100 80GB HBM3", g.ProductName)
		assert.True(t, g.MIG.Capable && g.MIG.Enabled, "GPU %d", g.Index)
		assert.NotEmpty(t, g.NVLink.Domain, "GPU %d", g.Index)
	}
	for _, g := range inv.GPUs[2:] {
		assert.Equal(t, "NVIDIA L40S", g.ProductName)
		assert.Equal(t, "Ada Lovelace", g.Architecture)
		assert.Equal(t, "8.9", g.CUDAComputeCapability)
		assert.Equal(t, uint64(46068), g.MemoryMiB)
		assert.Equal(t, "10de:26b9", g.PCI.DeviceID)
		assert.False(t, g.MIG.Capable || g.MIG.Enabled, "GPU %d", g.Index)
		assert.Empty(t, g.MIG.Profiles)
		assert.Empty(t, g.NVLink.Links)
		assert.Empty(t, g.NVLink.Domain)
	}
	_, err = m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: inv.GPUs[2].UUID, Profile: "1g.10gb", Start: 0})
	require.Error(t, err, "a MIG device on an L40S")

	samples, err := m.Telemetry(ctx)
	require.NoError(t, err)
	byUUID := map[string]nvdevice.TelemetrySample{}
	for _, s := range samples {
		byUUID[s.UUID] = s
	}
	assert.Equal(t, 700.0, byUUID[inv.GPUs[0].UUID].PowerLimitWatts.Value)
	assert.Equal(t, 350.0, byUUID[inv.GPUs[2].UUID].PowerLimitWatts.Value)
	assert.False(t, byUUID[inv.GPUs[2].UUID].SMActive.Supported, "GPM on an L40S")
}

// TestDriverReload: while the driver is unloaded every read and MIG
// operation fails with ErrDriverNotLoaded and the MIG instances go; loaded
// again at a new version, the GPUs are the same and report it.
func TestDriverReload(t *testing.T) {
	m, err := NewBuiltin("../../../examples/machines/two-h100-mig.yaml", "node-a")
	require.NoError(t, err)
	ctx := context.Background()
	before, err := m.Inventory(ctx)
	require.NoError(t, err)
	require.Len(t, before.GPUs[0].MIG.Devices, 1)

	m.UnloadDriver()
	_, err = m.Inventory(ctx)
	require.ErrorIs(t, err, nvdevice.ErrDriverNotLoaded)
	_, err = m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: before.GPUs[0].UUID, Profile: "1g.10gb", Start: 0})
	require.ErrorIs(t, err, nvdevice.ErrDriverNotLoaded)
	_, err = m.Telemetry(ctx)
	require.ErrorIs(t, err, nvdevice.ErrDriverNotLoaded)

	m.LoadDriver("580.159.04", "13.0")
	after, err := m.Inventory(ctx)
	require.NoError(t, err)
	assert.Equal(t, "580.159.04", after.DriverVersion)
	assert.Equal(t, "13.0", after.CUDADriverVersion)
	assert.Equal(t, "580.159.04", after.GPUs[1].DriverVersion)
	assert.Equal(t, before.GPUs[1].UUID, after.GPUs[1].UUID)
	assert.True(t, after.GPUs[0].MIG.Enabled, "MIG mode survives")
	assert.Empty(t, after.GPUs[0].MIG.Devices, "MIG instances do not")
}
