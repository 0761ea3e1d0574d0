package deviceplugin

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/nvdevice"
)

func TestRegistration(t *testing.T) {
	m, inv := builtin(t, "dgx-h100-nomig")
	rs, err := Resources(inv, ResourceOptions{})
	require.NoError(t, err)
	dir := t.TempDir()
	k := startKubelet(t, dir)
	p, err := New(Options{Resource: rs[0], PluginDir: dir, PollInterval: 20e6, CDIDir: specDir(t, m, inv)})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()

	reg := k.waitRegistration(t)
	assert.Equal(t, "nvidia.com/gpu", reg.ResourceName)
	assert.Equal(t, pluginapi.Version, reg.Version)
	assert.Equal(t, "gpudra-nvidia.com-gpu.sock", reg.Endpoint, "the endpoint is a file name in the plugin directory")
	assert.True(t, reg.Options.GetPreferredAllocationAvailable)
	assert.False(t, reg.Options.PreStartRequired)

	c := dialPlugin(t, dir, reg.Endpoint)
	opts, err := c.GetDevicePluginOptions(ctx, &pluginapi.Empty{})
	require.NoError(t, err)
	assert.True(t, opts.GetPreferredAllocationAvailable)
	_, err = c.PreStartContainer(ctx, &pluginapi.PreStartContainerRequest{DevicesIds: []string{inv.GPUs[0].UUID}})
	require.NoError(t, err)

	cancel()
	require.NoError(t, <-done)
	_, err = os.Stat(filepath.Join(dir, reg.Endpoint))
	assert.ErrorIs(t, err, os.ErrNotExist, "the socket is removed on the way out")
}

// Health flows from the simulated GPUs' XID events through HealthUpdates
// into ListAndWatch.
func TestListAndWatchHealth(t *testing.T) {
	tests := []struct {
		name     string
		config   string
		resource string
		// fault returns the GPU and MIG UUID to inject an XID on.
		fault func(inv *nvdevice.Inventory) (gpu, mig string)
		// unhealthy lists the device IDs expected unhealthy after it.
		unhealthy func(inv *nvdevice.Inventory) []string
	}{
		{name: "whole GPU", resource: "nvidia.com/gpu",
			fault:     func(inv *nvdevice.Inventory) (string, string) { return inv.GPUs[3].UUID, "" },
			unhealthy: func(inv *nvdevice.Inventory) []string { return []string{inv.GPUs[3].UUID} }},
		{name: "every replica of the GPU", resource: "nvidia.com/gpu",
			config: "version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: gpu, replicas: 3}]\n",
			fault:  func(inv *nvdevice.Inventory) (string, string) { return inv.GPUs[2].UUID, "" },
			unhealthy: func(inv *nvdevice.Inventory) []string {
				u := inv.GPUs[2].UUID
				return []string{u + "::0", u + "::1", u + "::2"}
			}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m, inv := builtin(t, "dgx-h100-nomig")
			var cfg *Config
			if tc.config != "" {
				cfg = mustConfig(t, tc.config)
			}
			rs, err := Resources(inv, ResourceOptions{Config: cfg})
			require.NoError(t, err)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			health, err := HealthUpdates(ctx, m, nvdevice.DefaultXIDPolicy)
			require.NoError(t, err)
			dir := t.TempDir()
			k := startKubelet(t, dir)
			_, c := runPlugin(t, dir, k, Options{Resource: resourceNamed(t, rs, tc.resource), Health: health, CDIDir: specDir(t, m, inv)})

			stream, err := c.ListAndWatch(ctx, &pluginapi.Empty{})
			require.NoError(t, err)
			first := recv(t, stream)
			assert.Len(t, first, len(resourceNamed(t, rs, tc.resource).Devices))
			for id, h := range first {
				assert.Equal(t, pluginapi.Healthy, h, id)
			}

			// An application XID changes nothing; a critical one does.
			gpu, mig := tc.fault(inv)
			require.NoError(t, m.InjectXID(gpu, mig, 13))
			require.NoError(t, m.InjectXID(gpu, mig, 48)) // double-bit ECC: needs a GPU reset
			second := recv(t, stream)
			want := map[string]string{}
			for id := range first {
				want[id] = pluginapi.Healthy
			}
			for _, id := range tc.unhealthy(inv) {
				want[id] = pluginapi.Unhealthy
			}
			assert.Equal(t, want, second)

			// The reset: every device healthy again.
			require.NoError(t, m.ResetGPU(gpu))
			assert.Equal(t, first, recv(t, stream))
		})
	}
}

// MIG devices: an XID on one MIG device makes it alone unhealthy; one on
// the parent GPU makes all of the GPU's MIG devices unhealthy.
func TestListAndWatchMigHealth(t *testing.T) {
	m, inv := migMachine(t)
	rs, err := Resources(inv, ResourceOptions{Config: mustConfig(t, "version: v1\nflags: {migStrategy: mixed}\n")})
	require.NoError(t, err)
	r := resourceNamed(t, rs, "nvidia.com/mig-1g.10gb")
	updates := make(chan HealthUpdate)
	dir := t.TempDir()
	k := startKubelet(t, dir)
	_, c := runPlugin(t, dir, k, Options{Resource: r, Health: updates, CDIDir: specDir(t, m, inv)})
	ctx := context.Background()
	stream, err := c.ListAndWatch(ctx, &pluginapi.Empty{})
	require.NoError(t, err)
	a, b := r.Devices[0].ID, r.Devices[1].ID
	assert.Equal(t, map[string]string{a: pluginapi.Healthy, b: pluginapi.Healthy}, recv(t, stream))

	updates <- HealthUpdate{UUID: b, Reason: "XID 79"}
	assert.Equal(t, map[string]string{a: pluginapi.Healthy, b: pluginapi.Unhealthy}, recv(t, stream))
	updates <- HealthUpdate{UUID: inv.GPUs[1].UUID, Reason: "gpu-lost"}
	assert.Equal(t, map[string]string{a: pluginapi.Unhealthy, b: pluginapi.Unhealthy}, recv(t, stream))
	updates <- HealthUpdate{UUID: inv.GPUs[1].UUID, Healthy: true}
	assert.Equal(t, map[string]string{a: pluginapi.Healthy, b: pluginapi.Healthy}, recv(t, stream), "a recovered GPU clears its MIG devices")
}

func TestGetPreferredAllocationGRPC(t *testing.T) {
	inv := twoDomains(t)
	rs, err := Resources(inv, ResourceOptions{})
	require.NoError(t, err)
	dir := t.TempDir()
	k := startKubelet(t, dir)
	_, c := runPlugin(t, dir, k, Options{Resource: rs[0], CDIDir: specDir(t, nil, inv)})
	gpu := func(is ...int) []string {
		var out []string
		for _, i := range is {
			out = append(out, inv.GPUs[i].UUID)
		}
		return out
	}
	domain := map[string]string{}
	for _, g := range inv.GPUs {
		domain[g.UUID] = g.NVLink.Domain
	}
	resp, err := c.GetPreferredAllocation(context.Background(), &pluginapi.PreferredAllocationRequest{ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{
		{AvailableDeviceIDs: gpu(0, 1, 2, 3, 4, 5, 6, 7), AllocationSize: 2},
		{AvailableDeviceIDs: gpu(0, 1, 2, 4, 5, 6, 7), AllocationSize: 4},
		{AvailableDeviceIDs: gpu(0, 1, 2, 3, 4, 5, 6, 7), MustIncludeDeviceIDs: gpu(5), AllocationSize: 4},
		{AvailableDeviceIDs: gpu(0, 1, 3, 4, 5, 6), MustIncludeDeviceIDs: gpu(1), AllocationSize: 2},
	}})
	require.NoError(t, err)
	require.Len(t, resp.ContainerResponses, 4)
	sameDomain := func(ids []string) {
		for _, id := range ids {
			assert.Equal(t, domain[ids[0]], domain[id], "%v spans NVLink domains", ids)
		}
	}
	two := resp.ContainerResponses[0].DeviceIDs
	require.Len(t, two, 2)
	sameDomain(two)
	assert.Equal(t, gpu(4, 5, 6, 7), resp.ContainerResponses[1].DeviceIDs, "4 go to the only domain with 4 free")
	four := resp.ContainerResponses[2].DeviceIDs
	assert.Equal(t, gpu(5), four[:1], "must-include first")
	assert.ElementsMatch(t, gpu(4, 5, 6, 7), four)
	pair := resp.ContainerResponses[3].DeviceIDs
	assert.Equal(t, gpu(1), pair[:1])
	sameDomain(pair)
}

// Allocate under the cdi-cri strategy: CDI names only, the errors naming
// the device ID (strategy_test.go covers the other strategies).
func TestAllocate(t *testing.T) {
	_, nomig := builtin(t, "dgx-h100-nomig")
	_, mixed := migMachine(t)
	const cri = "version: v1\nflags: {migStrategy: mixed, plugin: {deviceListStrategy: cdi-cri}}\n"
	plain, err := Resources(nomig, ResourceOptions{Config: mustConfig(t, cri)})
	require.NoError(t, err)
	shared, err := Resources(nomig, ResourceOptions{Config: mustConfig(t, cri+"sharing:\n  timeSlicing:\n    resources: [{name: gpu, rename: gpu.shared, replicas: 2, devices: [0]}, ]\n")})
	require.NoError(t, err)
	strict, err := Resources(nomig, ResourceOptions{Config: mustConfig(t, cri+"sharing:\n  timeSlicing:\n    failRequestsGreaterThanOne: true\n    resources: [{name: gpu, replicas: 2}]\n")})
	require.NoError(t, err)
	mps, err := Resources(nomig, ResourceOptions{Config: mustConfig(t, cri+"sharing:\n  mps:\n    resources: [{name: gpu, replicas: 4}]\n")})
	require.NoError(t, err)
	migs, err := Resources(mixed, ResourceOptions{Config: mustConfig(t, cri)})
	require.NoError(t, err)
	g := func(i int) string { return nomig.GPUs[i].UUID }

	tests := []struct {
		name      string
		resource  Resource
		opts      Options
		unhealthy []string
		ids       [][]string
		wantCDI   [][]string
		wantEnv   map[string]string
		errCode   codes.Code
		errHas    []string
	}{
		{name: "one GPU", resource: plain[0], ids: [][]string{{g(3)}},
			wantCDI: [][]string{{"gpu.gpudra.dev/claim=device-plugin-gpu-3"}}, wantEnv: map[string]string{"NVIDIA_VISIBLE_DEVICES": "void"}},
		{name: "two containers", resource: plain[0], ids: [][]string{{g(0), g(1)}, {g(7)}},
			wantCDI: [][]string{{CDIDeviceName("gpu-0"), CDIDeviceName("gpu-1")}, {CDIDeviceName("gpu-7")}}},
		{name: "driver device added", resource: plain[0], opts: Options{ExtraCDIDevices: []string{cdi.DriverDeviceID}}, ids: [][]string{{g(2)}},
			wantCDI: [][]string{{CDIDeviceName("gpu-2"), "gpu.gpudra.dev/driver=common"}}},
		{name: "MIG device", resource: resourceNamed(t, migs, "nvidia.com/mig-3g.40gb"), ids: [][]string{{mixed.GPUs[1].MIG.Devices[2].UUID}},
			wantCDI: [][]string{{CDIDeviceName("gpu-1-mig-3g-40gb-4")}}},
		{name: "replicas are their GPU", resource: resourceNamed(t, shared, "nvidia.com/gpu.shared"), ids: [][]string{{g(0) + "::0", g(0) + "::1"}},
			wantCDI: [][]string{{CDIDeviceName("gpu-0")}}},
		{name: "unknown ID", resource: plain[0], ids: [][]string{{g(0), "GPU-not-here"}},
			errCode: codes.InvalidArgument, errHas: []string{`unknown device ID "GPU-not-here"`, "nvidia.com/gpu"}},
		{name: "a GPU ID on the replica resource", resource: resourceNamed(t, shared, "nvidia.com/gpu.shared"), ids: [][]string{{g(0)}},
			errCode: codes.InvalidArgument, errHas: []string{`unknown device ID "` + g(0) + `"`}},
		{name: "unhealthy GPU", resource: plain[0], unhealthy: []string{g(4)}, ids: [][]string{{g(4)}},
			errCode: codes.FailedPrecondition, errHas: []string{`device ID "` + g(4) + `" is unhealthy`, "XID 79"}},
		{name: "replica of an unhealthy GPU", resource: strict[0], unhealthy: []string{g(1)}, ids: [][]string{{g(1) + "::1"}},
			errCode: codes.FailedPrecondition, errHas: []string{`device ID "` + g(1) + `::1" is unhealthy`}},
		{name: "failRequestsGreaterThanOne", resource: strict[0], ids: [][]string{{g(0) + "::0", g(1) + "::0"}},
			errCode: codes.InvalidArgument, errHas: []string{"must be requested alone", g(0) + "::0"}},
		{name: "MPS replica", resource: mps[0], opts: Options{MPS: true},
			ids: [][]string{{g(5) + "::3"}}, wantCDI: [][]string{{"gpu.gpudra.dev/claim=device-plugin-mps-gpu-5-gpu-5"}},
			wantEnv: map[string]string{"NVIDIA_VISIBLE_DEVICES": "void"}},
		{name: "MPS without a daemon", resource: mps[0], ids: [][]string{{g(5) + "::0"}},
			errCode: codes.FailedPrecondition, errHas: []string{"no MPS control daemon", g(5) + "::0"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			k := startKubelet(t, dir)
			opts := tc.opts
			opts.Resource = tc.resource
			p, c := runPlugin(t, dir, k, opts)
			for _, u := range tc.unhealthy {
				p.SetHealth(HealthUpdate{UUID: u, Reason: "XID 79"})
			}
			req := &pluginapi.AllocateRequest{}
			for _, ids := range tc.ids {
				req.ContainerRequests = append(req.ContainerRequests, &pluginapi.ContainerAllocateRequest{DevicesIds: ids})
			}
			resp, err := c.Allocate(context.Background(), req)
			if tc.errHas != nil {
				require.Error(t, err)
				assert.Equal(t, tc.errCode, status.Code(err))
				for _, s := range tc.errHas {
					assert.Contains(t, err.Error(), s)
				}
				return
			}
			require.NoError(t, err)
			require.Len(t, resp.ContainerResponses, len(tc.ids))
			for i, cr := range resp.ContainerResponses {
				var got []string
				for _, d := range cr.CdiDevices {
					got = append(got, d.Name)
				}
				assert.Equal(t, tc.wantCDI[i], got)
				assert.Empty(t, cr.Devices, "cdi-cri: device nodes come from CDI only")
				if tc.wantEnv != nil {
					assert.Equal(t, tc.wantEnv, cr.Envs)
				}
				assert.Empty(t, cr.Mounts, "cdi-cri: mounts come from CDI only")
			}
		})
	}
}

// A kubelet restart removes every socket in the plugin directory and
// brings up a new registration socket: the plugin serves again and
// registers again, and the new kubelet can use it.
func TestKubeletRestart(t *testing.T) {
	tests := []struct {
		name       string
		removeOurs bool
	}{
		{name: "sockets wiped", removeOurs: true},
		{name: "only kubelet socket recreated", removeOurs: false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m, inv := builtin(t, "dgx-h100-nomig")
			rs, err := Resources(inv, ResourceOptions{})
			require.NoError(t, err)
			dir := t.TempDir()
			k1 := startKubelet(t, dir)
			p, c := runPlugin(t, dir, k1, Options{Resource: rs[0], CDIDir: specDir(t, m, inv)})
			_, err = c.GetDevicePluginOptions(context.Background(), &pluginapi.Empty{})
			require.NoError(t, err)

			k1.stop()
			if tc.removeOurs {
				require.NoError(t, os.Remove(p.SocketPath()))
			}
			k2 := startKubelet(t, dir)
			reg := k2.waitRegistration(t)
			assert.Equal(t, "nvidia.com/gpu", reg.ResourceName)
			assert.Equal(t, pluginapi.Version, reg.Version)

			c2 := dialPlugin(t, dir, reg.Endpoint)
			stream, err := c2.ListAndWatch(context.Background(), &pluginapi.Empty{})
			require.NoError(t, err)
			assert.Len(t, recv(t, stream), 8)
			select {
			case r := <-k1.regs:
				t.Fatalf("the old kubelet got a registration after it stopped: %v", r)
			default:
			}
		})
	}
}
