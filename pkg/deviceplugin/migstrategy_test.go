package deviceplugin

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

// simMachine is a two-GPU H100 machine in MIG mode with the given MIG
// devices configured.
func simMachine(t *testing.T, migEnabled sim.MigEnabledSpec, devices ...sim.MigDeviceSpec) (*sim.Machine, *nvdevice.Inventory) {
	t.Helper()
	m, err := sim.New(sim.MachineSpec{Name: "two", GPUModel: sim.ModelH100SXM5, GPUCount: 2, NVLink: sim.NVLinkNVSwitch,
		MigEnabled: migEnabled, MigDevices: devices}, "node-a")
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Close() })
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	return m, inv
}

// uniformMig fits the single strategy: both GPUs in MIG mode, two 3g.40gb
// on each.
func uniformMig(t *testing.T) (*sim.Machine, *nvdevice.Inventory) {
	return simMachine(t, sim.MigEnabledSpec{All: true},
		sim.MigDeviceSpec{GPU: 0, Profile: "3g.40gb", Start: 0}, sim.MigDeviceSpec{GPU: 0, Profile: "3g.40gb", Start: 4},
		sim.MigDeviceSpec{GPU: 1, Profile: "3g.40gb", Start: 0}, sim.MigDeviceSpec{GPU: 1, Profile: "3g.40gb", Start: 4})
}

// testdataConfig parses a config of testdata/ (NVIDIA's documented
// examples and variations of them).
func testdataConfig(t *testing.T, name string) *Config {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	require.NoError(t, err)
	c, err := ParseConfig(b)
	require.NoError(t, err, name)
	return c
}

// The MIG strategies with NVIDIA's meanings (internal/rm/device_map.go of
// NVIDIA's k8s-device-plugin), on nodes with MIG off, in MIG mode without
// MIG devices, mixed, uniform, with two profiles, and with MIG devices on
// some MIG-mode GPUs only.
func TestMIGStrategies(t *testing.T) {
	machines := map[string]func(t *testing.T) (*sim.Machine, *nvdevice.Inventory){
		"dgx-h100-nomig": func(t *testing.T) (*sim.Machine, *nvdevice.Inventory) { return builtin(t, "dgx-h100-nomig") },
		"dgx-h100":       func(t *testing.T) (*sim.Machine, *nvdevice.Inventory) { return builtin(t, "dgx-h100") },
		"mixed":          migMachine, // GPU 0 whole, GPU 1: 2 x 1g.10gb, 3g.40gb
		"uniform":        uniformMig,
		"two profiles": func(t *testing.T) (*sim.Machine, *nvdevice.Inventory) {
			return simMachine(t, sim.MigEnabledSpec{All: true},
				sim.MigDeviceSpec{GPU: 0, Profile: "1g.10gb", Start: 0}, sim.MigDeviceSpec{GPU: 1, Profile: "3g.40gb", Start: 4})
		},
		"one GPU without MIG devices": func(t *testing.T) (*sim.Machine, *nvdevice.Inventory) {
			return simMachine(t, sim.MigEnabledSpec{All: true}, sim.MigDeviceSpec{GPU: 0, Profile: "3g.40gb", Start: 0})
		},
	}
	tests := []struct {
		config  string
		machine string
		want    map[string]int // resource -> devices
		// wantMigDevices: the GPU resource holds MIG devices.
		wantMigDevices bool
		errHas         []string
	}{
		// none (NVIDIA's default): every GPU whole, MIG mode or not.
		{config: "nvidia-config0.yaml", machine: "dgx-h100-nomig", want: map[string]int{"nvidia.com/gpu": 8}},
		{config: "nvidia-config0.yaml", machine: "dgx-h100", want: map[string]int{"nvidia.com/gpu": 8}},
		{config: "nvidia-config0.yaml", machine: "mixed", want: map[string]int{"nvidia.com/gpu": 2}},
		{config: "nvidia-config0.yaml", machine: "uniform", want: map[string]int{"nvidia.com/gpu": 2}},
		// single: MIG devices as nvidia.com/gpu, or whole GPUs when MIG
		// is off everywhere; any other node is an error.
		{config: "mig-single.yaml", machine: "dgx-h100-nomig", want: map[string]int{"nvidia.com/gpu": 8}},
		{config: "mig-single.yaml", machine: "uniform", want: map[string]int{"nvidia.com/gpu": 4}, wantMigDevices: true},
		{config: "mig-single.yaml", machine: "dgx-h100",
			errHas: []string{`flags.migStrategy: "single" does not fit this node`, "GPU 0 (GPU-", "GPU 7 (GPU-", "in MIG mode without MIG devices"}},
		{config: "mig-single.yaml", machine: "mixed",
			errHas: []string{"MIG devices of more than one profile: 1g.10gb on GPU 1; 3g.40gb on GPU 1",
				"GPU 1 (GPU-", "in MIG mode but GPU 0 (GPU-", "not: single needs every GPU in the same MIG mode"}},
		{config: "mig-single.yaml", machine: "two profiles",
			errHas: []string{"MIG devices of more than one profile: 1g.10gb on GPU 0; 3g.40gb on GPU 1", `use "mixed"`}},
		{config: "mig-single.yaml", machine: "one GPU without MIG devices", errHas: []string{"GPU 1 (GPU-", "in MIG mode without MIG devices"}},
		// mixed: one resource per profile; MIG mode without MIG devices
		// advertises nothing for that GPU.
		{config: "nvidia-config1.yaml", machine: "dgx-h100-nomig", want: map[string]int{"nvidia.com/gpu": 8}},
		{config: "nvidia-config1.yaml", machine: "dgx-h100", want: map[string]int{}},
		{config: "nvidia-config1.yaml", machine: "mixed", want: map[string]int{"nvidia.com/gpu": 1, "nvidia.com/mig-1g.10gb": 2, "nvidia.com/mig-3g.40gb": 1}},
		{config: "nvidia-config1.yaml", machine: "uniform", want: map[string]int{"nvidia.com/mig-3g.40gb": 4}},
		{config: "nvidia-config1.yaml", machine: "one GPU without MIG devices", want: map[string]int{"nvidia.com/mig-3g.40gb": 1}},
	}
	for _, tc := range tests {
		t.Run(tc.config+" on "+tc.machine, func(t *testing.T) {
			_, inv := machines[tc.machine](t)
			rs, err := Resources(inv, ResourceOptions{Config: testdataConfig(t, tc.config)})
			if tc.errHas != nil {
				require.Error(t, err)
				for _, s := range tc.errHas {
					assert.Contains(t, err.Error(), s)
				}
				return
			}
			require.NoError(t, err)
			got := map[string]int{}
			for _, r := range rs {
				got[r.Name] = len(r.Devices)
			}
			assert.Equal(t, tc.want, got)
			for _, r := range rs {
				for _, d := range r.Devices {
					if r.Name == DefaultGPUResourceName {
						assert.Equal(t, tc.wantMigDevices, d.MigProfile != "", "%s", d.ID)
					}
				}
			}
		})
	}
}

// NVIDIA's documented sharing examples advertise what the README says they
// do: 80 replicas on a node of 8 GPUs.
func TestNVIDIASharingExamples(t *testing.T) {
	_, inv := builtin(t, "dgx-h100-nomig")
	for config, want := range map[string]map[string]int{
		"nvidia-timeslicing.yaml":        {"nvidia.com/gpu": 80},
		"nvidia-timeslicing-rename.yaml": {"nvidia.com/gpu.shared": 80},
		"nvidia-mps.yaml":                {"nvidia.com/gpu": 80},
	} {
		t.Run(config, func(t *testing.T) {
			rs, err := Resources(inv, ResourceOptions{Config: testdataConfig(t, config)})
			require.NoError(t, err)
			got := map[string]int{}
			for _, r := range rs {
				got[r.Name] = len(r.Devices)
			}
			assert.Equal(t, want, got)
		})
	}
}

// MPS cannot share a MIG device (single) or a GPU in MIG mode (none), as
// in NVIDIA's plugin; and a MIG profile with "+" gets a valid resource name.
func TestMIGResourceEdges(t *testing.T) {
	_, uniform := uniformMig(t)
	_, err := Resources(uniform, ResourceOptions{Config: mustConfig(t, "version: v1\nflags: {migStrategy: single}\nsharing:\n  mps:\n    resources: [{name: gpu, replicas: 2}]\n")})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "MPS cannot share it")
	_, err = Resources(uniform, ResourceOptions{Config: mustConfig(t, "version: v1\nsharing:\n  mps:\n    resources: [{name: gpu, replicas: 2}]\n")})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "a MIG device or a GPU in MIG mode")
	rs, err := Resources(uniform, ResourceOptions{Config: mustConfig(t, "version: v1\nflags: {migStrategy: single}\nsharing:\n  timeSlicing:\n    resources: [{name: gpu, replicas: 2}]\n")})
	require.NoError(t, err, "time-slicing of MIG devices is fine")
	assert.Len(t, resourceNamed(t, rs, "nvidia.com/gpu").Devices, 8)

	assert.Equal(t, "nvidia.com/mig-1g.10gb.me", MigResourceName("1g.10gb+me"))
	_, plus := simMachine(t, sim.MigEnabledSpec{Indexes: []int{0}}, sim.MigDeviceSpec{GPU: 0, Profile: "1g.10gb+me", Start: 0})
	rs, err = Resources(plus, ResourceOptions{Config: mustConfig(t, "version: v1\nflags: {migStrategy: mixed}\n")})
	require.NoError(t, err)
	for _, r := range rs {
		assert.NoError(t, ValidResourceName(r.Name))
	}
	assert.Len(t, resourceNamed(t, rs, "nvidia.com/mig-1g.10gb.me").Devices, 1)

	_, err = Resources(plus, ResourceOptions{Config: mustConfig(t, "version: v1\nflags: {migStrategy: mixed, plugin: {deviceIDStrategy: index}}\n")})
	require.Error(t, err)
	assert.Contains(t, err.Error(), `flags.plugin.deviceIDStrategy: "index" cannot name MIG device`)
	_, err = Resources(plus, ResourceOptions{Config: mustConfig(t, "version: v1\nflags: {migStrategy: mixed, plugin: {deviceIDStrategy: index, deviceListStrategy: cdi-cri}}\n")})
	assert.NoError(t, err, "index names nothing under CDI strategies")
}
