package deviceplugin

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// Serve on a mixed node: every resource registers, and what Allocate
// answers resolves in the CDI directory with the real CDI library.
func TestServe(t *testing.T) {
	m, inv := migMachine(t)
	dir, cdiDir := t.TempDir(), t.TempDir()
	k := startKubelet(t, dir)
	w, err := cdi.NewWriter(cdiDir)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	metrics := NewMetrics()
	go func() {
		done <- Serve(ctx, ServeOptions{Backend: m, CDI: w, PluginDir: dir, PollInterval: 20 * time.Millisecond,
			XIDPolicy: nvdevice.DefaultXIDPolicy, Metrics: metrics,
			Resources: ResourceOptions{Config: mustConfig(t, "version: v1\nflags: {migStrategy: mixed, plugin: {deviceListStrategy: cdi-cri}}\n")}})
	}()
	endpoints := map[string]string{}
	for i := 0; i < 3; i++ {
		r := k.waitRegistration(t)
		endpoints[r.ResourceName] = r.Endpoint
	}
	assert.Equal(t, map[string]string{
		"nvidia.com/gpu":         "gpudra-nvidia.com-gpu.sock",
		"nvidia.com/mig-1g.10gb": "gpudra-nvidia.com-mig-1g.10gb.sock",
		"nvidia.com/mig-3g.40gb": "gpudra-nvidia.com-mig-3g.40gb.sock",
	}, endpoints)

	c := dialPlugin(t, dir, endpoints["nvidia.com/mig-1g.10gb"])
	migUUID := inv.GPUs[1].MIG.Devices[1].UUID
	resp, err := c.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{migUUID}}}})
	require.NoError(t, err)
	require.Len(t, resp.ContainerResponses[0].CdiDevices, 1)
	name := resp.ContainerResponses[0].CdiDevices[0].Name

	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(cdiDir), cdiapi.WithAutoRefresh(false))
	require.NoError(t, err)
	require.NoError(t, cache.Refresh())
	spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
	_, err = cache.InjectDevices(spec, name)
	require.NoError(t, err)
	assert.Contains(t, spec.Process.Env, cdi.DeviceUUIDEnv(cdi.DeviceName(SpecUID, "gpu-1-mig-1g-10gb-1"))+"="+migUUID)
	_, err = c.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{"MIG-not-here"}}}})
	require.Error(t, err)
	assert.Equal(t, 1.0, testutil.ToFloat64(metrics.allocations.WithLabelValues("nvidia.com/mig-1g.10gb", "success")))
	assert.Equal(t, 1.0, testutil.ToFloat64(metrics.allocations.WithLabelValues("nvidia.com/mig-1g.10gb", "error")))
	assert.Equal(t, 0.0, testutil.ToFloat64(metrics.allocations.WithLabelValues("nvidia.com/gpu", "success")))
	// Counted when the kubelet's Register returns to the plugin, which may
	// be after the kubelet has seen the request.
	assert.Eventually(t, func() bool {
		return testutil.ToFloat64(metrics.registrations.WithLabelValues("nvidia.com/gpu", "success")) == 1
	}, 5*time.Second, 10*time.Millisecond, "the registration is counted")
	assert.NoError(t, metrics.Healthz(), "every plugin socket answers")

	// Health from the machine reaches the MIG resource's stream.
	stream, err := c.ListAndWatch(ctx, &pluginapi.Empty{})
	require.NoError(t, err)
	recv(t, stream)
	require.NoError(t, m.InjectXID(inv.GPUs[1].UUID, migUUID, 48))
	after := recv(t, stream)
	assert.Equal(t, pluginapi.Unhealthy, after[migUUID])
	assert.Equal(t, pluginapi.Healthy, after[inv.GPUs[1].MIG.Devices[0].UUID], "an XID on one MIG device leaves its neighbour healthy")
	assert.Equal(t, 1.0, testutil.ToFloat64(metrics.devices.WithLabelValues("nvidia.com/mig-1g.10gb", "unhealthy")))
	assert.Equal(t, 1.0, testutil.ToFloat64(metrics.devices.WithLabelValues("nvidia.com/mig-1g.10gb", "healthy")))
	assert.Equal(t, 1.0, testutil.ToFloat64(metrics.devices.WithLabelValues("nvidia.com/gpu", "healthy")))

	cancel()
	require.NoError(t, <-done)
}

// /healthz fails naming a socket that does not answer, and passes with no
// socket served yet.
func TestMetricsHealthz(t *testing.T) {
	m := NewMetrics()
	assert.NoError(t, m.Healthz(), "nothing served yet")
	gone := filepath.Join(t.TempDir(), "gpudra-nvidia.com-gpu.sock")
	m.serving([]string{gone})
	err := m.Healthz()
	require.Error(t, err)
	assert.Contains(t, err.Error(), "device plugin socket "+gone)
}
