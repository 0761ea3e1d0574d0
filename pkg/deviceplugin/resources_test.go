package deviceplugin

import (
	"context"
	"testing"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/nvdevice"
)

func mustConfig(t *testing.T, y string) *Config {
	t.Helper()
	c, err := ParseConfig([]byte(y))
	require.NoError(t, err)
	return c
}

func TestResources(t *testing.T) {
	_, nomig := builtin(t, "dgx-h100-nomig")
	_, allMig := builtin(t, "dgx-h100")
	_, mixed := migMachine(t)
	g := func(inv *nvdevice.Inventory, i int) string { return inv.GPUs[i].UUID }
	mig := func(inv *nvdevice.Inventory, gpu, k int) string { return inv.GPUs[gpu].MIG.Devices[k].UUID }
	// mixedCfg starts a config with the mixed MIG strategy (the default is
	// none, as in NVIDIA's plugin).
	const mixedCfg = "version: v1\nflags: {migStrategy: mixed}\n"

	tests := []struct {
		name   string
		inv    *nvdevice.Inventory
		opts   ResourceOptions
		want   map[string][]string // resource -> device IDs
		check  func(t *testing.T, rs []Resource)
		errHas string
	}{
		{name: "whole GPUs under nvidia.com/gpu", inv: nomig,
			want: map[string][]string{"nvidia.com/gpu": {g(nomig, 0), g(nomig, 1), g(nomig, 2), g(nomig, 3), g(nomig, 4), g(nomig, 5), g(nomig, 6), g(nomig, 7)}},
			check: func(t *testing.T, rs []Resource) {
				d := rs[0].Devices[3]
				assert.Equal(t, "gpu-3", d.Name)
				assert.Equal(t, g(nomig, 3), d.GPUUUID)
				assert.NotEmpty(t, d.NVLinkDomain)
				assert.Equal(t, nomig.GPUs[3].NUMANode, d.NUMANode)
			}},
		{name: "configured GPU resource name", inv: twoDomains(t), opts: ResourceOptions{GPUResourceName: "example.com/h100"},
			check: func(t *testing.T, rs []Resource) {
				assert.Equal(t, []string{"example.com/h100"}, names(rs))
				assert.Len(t, rs[0].Devices, 8)
			}},
		{name: "invalid GPU resource name", inv: nomig, opts: ResourceOptions{GPUResourceName: "gpu"}, errHas: "GPU resource name"},
		{name: "mixed: MIG mode without MIG devices advertises nothing", inv: allMig, opts: ResourceOptions{Config: mustConfig(t, mixedCfg)},
			want: map[string][]string{}},
		{name: "mixed strategy: one resource per existing profile", inv: mixed, opts: ResourceOptions{Config: mustConfig(t, mixedCfg)},
			want: map[string][]string{
				"nvidia.com/gpu":         {g(mixed, 0)},
				"nvidia.com/mig-1g.10gb": {mig(mixed, 1, 0), mig(mixed, 1, 1)},
				"nvidia.com/mig-3g.40gb": {mig(mixed, 1, 2)},
			},
			check: func(t *testing.T, rs []Resource) {
				d := resourceNamed(t, rs, "nvidia.com/mig-3g.40gb").Devices[0]
				assert.Equal(t, "gpu-1-mig-3g-40gb-4", d.Name)
				assert.Equal(t, g(mixed, 1), d.GPUUUID)
				assert.Equal(t, "3g.40gb", d.MigProfile)
				assert.Empty(t, d.NVLinkDomain, "MIG devices have no NVLink peer-to-peer")
			}},
		{name: "none strategy (the default) advertises GPUs in MIG mode whole", inv: mixed,
			want: map[string][]string{"nvidia.com/gpu": {g(mixed, 0), g(mixed, 1)}},
			check: func(t *testing.T, rs []Resource) {
				d := rs[0].Devices[1]
				assert.Equal(t, "gpu-1", d.Name)
				assert.True(t, d.MigMode)
				assert.Empty(t, d.MigProfile)
			}},
		{name: "time-slicing replicas", inv: mixed,
			opts: ResourceOptions{Config: mustConfig(t, mixedCfg+"sharing:\n  timeSlicing:\n    resources: [{name: gpu, replicas: 3}]\n")},
			want: map[string][]string{
				"nvidia.com/gpu":         {g(mixed, 0) + "::0", g(mixed, 0) + "::1", g(mixed, 0) + "::2"},
				"nvidia.com/mig-1g.10gb": {mig(mixed, 1, 0), mig(mixed, 1, 1)},
				"nvidia.com/mig-3g.40gb": {mig(mixed, 1, 2)},
			},
			check: func(t *testing.T, rs []Resource) {
				d := resourceNamed(t, rs, "nvidia.com/gpu").Devices[2]
				assert.Equal(t, TimeSlicing, d.Sharing)
				assert.Equal(t, 2, d.Replica)
				assert.Equal(t, 3, d.Replicas)
				assert.Equal(t, "gpu-0", d.Name, "a replica is its GPU")
				assert.False(t, d.FailRequestsGreaterThanOne)
			}},
		{name: "rename moves the replicas, renameByDefault", inv: mixed,
			opts: ResourceOptions{Config: mustConfig(t, mixedCfg+"sharing:\n  timeSlicing:\n    renameByDefault: true\n    failRequestsGreaterThanOne: true\n    resources: [{name: mig-1g.10gb, replicas: 2}]\n")},
			want: map[string][]string{
				"nvidia.com/gpu":                {g(mixed, 0)},
				"nvidia.com/mig-1g.10gb.shared": {mig(mixed, 1, 0) + "::0", mig(mixed, 1, 0) + "::1", mig(mixed, 1, 1) + "::0", mig(mixed, 1, 1) + "::1"},
				"nvidia.com/mig-3g.40gb":        {mig(mixed, 1, 2)},
			},
			check: func(t *testing.T, rs []Resource) {
				assert.True(t, resourceNamed(t, rs, "nvidia.com/mig-1g.10gb.shared").Devices[0].FailRequestsGreaterThanOne)
			}},
		{name: "devices subset: the rest stays whole", inv: nomig,
			opts: ResourceOptions{Config: mustConfig(t, "version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: gpu, rename: gpu.shared, replicas: 2, devices: [0, "+nomig.GPUs[1].UUID+"]}]\n")},
			want: map[string][]string{
				"nvidia.com/gpu":        {g(nomig, 2), g(nomig, 3), g(nomig, 4), g(nomig, 5), g(nomig, 6), g(nomig, 7)},
				"nvidia.com/gpu.shared": {g(nomig, 0) + "::0", g(nomig, 0) + "::1", g(nomig, 1) + "::0", g(nomig, 1) + "::1"},
			}},
		{name: "MPS replicas refuse requests of more than one", inv: mixed,
			opts: ResourceOptions{Config: mustConfig(t, mixedCfg+"sharing:\n  mps:\n    resources: [{name: gpu, replicas: 2}]\n")},
			check: func(t *testing.T, rs []Resource) {
				r := resourceNamed(t, rs, "nvidia.com/gpu")
				require.Len(t, r.Devices, 2)
				assert.Equal(t, MPS, r.Devices[0].Sharing)
				assert.True(t, r.Devices[0].FailRequestsGreaterThanOne)
			}},
		{name: "a resource absent from the node is ignored", inv: nomig,
			opts:  ResourceOptions{Config: mustConfig(t, "version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: mig-1g.10gb, replicas: 2}]\n")},
			check: func(t *testing.T, rs []Resource) { assert.Equal(t, []string{"nvidia.com/gpu"}, names(rs)) }},
		{name: "rename onto an advertised resource", inv: mixed,
			opts:   ResourceOptions{Config: mustConfig(t, mixedCfg+"sharing:\n  timeSlicing:\n    resources: [{name: mig-1g.10gb, rename: mig-3g.40gb, replicas: 2}]\n")},
			errHas: "nvidia.com/mig-3g.40gb, a resource this node already advertises"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rs, err := Resources(tc.inv, tc.opts)
			if tc.errHas != "" {
				require.ErrorContains(t, err, tc.errHas)
				return
			}
			require.NoError(t, err)
			if tc.want != nil {
				got := map[string][]string{}
				for _, r := range rs {
					got[r.Name] = ids(r.Devices)
				}
				assert.Equal(t, tc.want, got)
			}
			if tc.check != nil {
				tc.check(t, rs)
			}
		})
	}
}

// The device plugin's CDI spec resolves, with the real CDI library, into
// the same container edits a DRA claim's device gets.
func TestCDISpecResolves(t *testing.T) {
	m, inv := migMachine(t)
	host, err := m.Host(context.Background())
	require.NoError(t, err)
	dir := t.TempDir()
	w, err := cdi.NewWriter(dir)
	require.NoError(t, err)
	require.NoError(t, WriteCDISpec(w, inv, host))

	rs, err := Resources(inv, ResourceOptions{Config: mustConfig(t, "version: v1\nflags: {migStrategy: mixed}\n")})
	require.NoError(t, err)
	none, err := Resources(inv, ResourceOptions{})
	require.NoError(t, err)
	rs = append(rs, none...) // GPU 1 in MIG mode, whole
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(dir), cdiapi.WithAutoRefresh(false))
	require.NoError(t, err)
	require.NoError(t, cache.Refresh())
	for _, r := range rs {
		for _, d := range r.Devices {
			spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
			unresolved, err := cache.InjectDevices(spec, CDIDeviceName(d.Name))
			require.NoError(t, err, "%s: unresolved %v", d.ID, unresolved)
			paths := map[string]oci.LinuxDevice{}
			for _, n := range spec.Linux.Devices {
				paths[n.Path] = n
			}
			assert.Contains(t, paths, "/dev/nvidiactl")
			assert.Contains(t, paths, "/dev/nvidia-uvm")
			gpuNode := cdi.GPUNode(host.Majors, d.GPUMinor)
			require.Contains(t, paths, gpuNode.Path)
			assert.Equal(t, gpuNode.Minor, paths[gpuNode.Path].Minor)
			assert.Contains(t, spec.Process.Env, cdi.VisibleDevicesVoid)
			assert.Contains(t, spec.Process.Env, cdi.DeviceUUIDEnv(cdi.DeviceName(SpecUID, d.Name))+"="+d.UUID)
			caps := 0
			for p := range paths {
				if len(p) > len("/dev/nvidia-caps/") && p[:len("/dev/nvidia-caps/")] == "/dev/nvidia-caps/" {
					caps++
				}
			}
			if d.MigProfile != "" {
				assert.Equal(t, 2, caps, "%s: a MIG device gets its GI and CI capability nodes", d.ID)
			} else {
				assert.Zero(t, caps)
			}
		}
	}
	assert.Equal(t, "gpu.gpudra.dev/claim=device-plugin-gpu-0", CDIDeviceName("gpu-0"))
}
