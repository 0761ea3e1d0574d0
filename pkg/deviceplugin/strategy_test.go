package deviceplugin

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// What Allocate answers under each device list strategy, from NVIDIA's
// documented configs (testdata/): NVIDIA's part as NVIDIA's plugin sends it,
// and the CDI-free part (DeviceSpecs, Mounts, Envs) with every non-CDI
// strategy.
func TestAllocateDeviceListStrategies(t *testing.T) {
	m, inv := builtin(t, "dgx-h100-nomig")
	dir := specDir(t, m, inv)
	driver := writeDriverSpec(t, m, dir, "")
	u := func(i int) string { return inv.GPUs[i].UUID }
	names := []string{CDIDeviceName("gpu-1"), CDIDeviceName("gpu-4"), cdi.DriverDeviceID}
	sum := sha256.Sum256([]byte("nvidia.com/gpu"))
	annotation := "gpudra-device-plugin_" + hex.EncodeToString(sum[:8])
	tests := []struct {
		config          string
		wantVisible     string // NVIDIA_VISIBLE_DEVICES
		wantCDI         []string
		wantAnnotations map[string]string
		wantSpecs       bool     // DeviceSpecs and the driver's mounts
		wantMarkers     []string // volume-mounts: /dev/null mounted there
	}{
		{config: "nvidia-config0.yaml", wantVisible: u(1) + "," + u(4), wantSpecs: true},
		{config: "volume-mounts.yaml", wantVisible: VolumeMountsRoot, wantSpecs: true,
			wantMarkers: []string{VolumeMountsRoot + "/" + u(1), VolumeMountsRoot + "/" + u(4)}},
		{config: "cdi-annotations.yaml", wantVisible: "void",
			wantAnnotations: map[string]string{"cdi.k8s.io/" + annotation: names[0] + "," + names[1] + "," + names[2]}},
		{config: "cdi-cri.yaml", wantVisible: "void", wantCDI: names},
		{config: "envvar-and-cdi-cri.yaml", wantVisible: u(1) + "," + u(4), wantCDI: names, wantSpecs: true},
		{config: "index.yaml", wantVisible: VolumeMountsRoot, wantSpecs: true,
			wantMarkers: []string{VolumeMountsRoot + "/1", VolumeMountsRoot + "/4"}},
	}
	for _, tc := range tests {
		t.Run(tc.config, func(t *testing.T) {
			rs, err := Resources(inv, ResourceOptions{Config: testdataConfig(t, tc.config)})
			require.NoError(t, err)
			p, err := New(Options{Resource: rs[0], CDIDir: dir, ExtraCDIDevices: driver})
			require.NoError(t, err)
			out, err := p.Allocate(context.Background(), &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{u(1), u(4)}}}})
			require.NoError(t, err)
			r := out.ContainerResponses[0]
			assert.Equal(t, tc.wantVisible, r.Envs[VisibleDevicesEnv])
			var cdiNames []string
			for _, d := range r.CdiDevices {
				cdiNames = append(cdiNames, d.Name)
			}
			assert.Equal(t, tc.wantCDI, cdiNames)
			assert.Equal(t, tc.wantAnnotations, r.Annotations)
			mounts := map[string]*pluginapi.Mount{}
			for _, mt := range r.Mounts {
				mounts[mt.ContainerPath] = mt
			}
			for _, path := range tc.wantMarkers {
				require.Contains(t, mounts, path)
				assert.Equal(t, "/dev/null", mounts[path].HostPath)
			}
			if !tc.wantSpecs {
				assert.Empty(t, r.Devices, "CDI strategies only: the runtime creates the nodes from the spec")
				assert.Empty(t, r.Mounts)
				assert.Equal(t, map[string]string{VisibleDevicesEnv: "void"}, r.Envs)
				return
			}
			specs := map[string]*pluginapi.DeviceSpec{}
			for _, d := range r.Devices {
				specs[d.ContainerPath] = d
			}
			for _, n := range []string{"/dev/nvidia1", "/dev/nvidia4", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"} {
				require.Contains(t, specs, n)
				assert.Equal(t, n, specs[n].HostPath)
				assert.Equal(t, "rwm", specs[n].Permissions, "the access CDI grants")
			}
			assert.Len(t, r.Devices, 5, "two GPUs and the control nodes, once each")
			assert.Contains(t, mounts, "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "the driver spec's soname mounts")
			assert.True(t, mounts["/usr/lib/x86_64-linux-gnu/libcuda.so.1"].ReadOnly)
			assert.Equal(t, u(4), r.Envs[cdi.DeviceUUIDEnv(cdi.DeviceName(SpecUID, "gpu-4"))])
		})
	}
}

// A custom cdiAnnotationPrefix replaces cdi.k8s.io/ in the key, as in
// NVIDIA's plugin; two resources never share a key.
func TestCDIAnnotationPrefix(t *testing.T) {
	r := responseFor(mustConfig(t, "version: v1\nflags: {plugin: {deviceListStrategy: cdi-annotations, cdiAnnotationPrefix: nvidia.cdi.k8s.io/}}\n"))
	a, err := r.annotationKey("nvidia.com/gpu")
	require.NoError(t, err)
	b, err := r.annotationKey("nvidia.com/mig-1g.10gb")
	require.NoError(t, err)
	assert.Regexp(t, `^nvidia\.cdi\.k8s\.io/gpudra-device-plugin_[0-9a-f]{16}$`, a)
	assert.NotEqual(t, a, b)
}

// Serve with no config (NVIDIA's defaults: none, envvar): containers get
// NVIDIA_VISIBLE_DEVICES and their device nodes, mounts and variables
// without CDI, from the specs Serve wrote.
func TestServeDefaultsPassDeviceSpecs(t *testing.T) {
	m, inv := builtin(t, "dgx-h100")
	dir, cdiDir := t.TempDir(), t.TempDir()
	k := startKubelet(t, dir)
	w, err := cdi.NewWriter(cdiDir)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Serve(ctx, ServeOptions{Backend: m, CDI: w, PluginDir: dir, PollInterval: 20 * time.Millisecond, XIDPolicy: nvdevice.DefaultXIDPolicy})
	}()
	reg := k.waitRegistration(t)
	assert.Equal(t, "nvidia.com/gpu", reg.ResourceName, "none: the GPUs in MIG mode, whole")
	c := dialPlugin(t, dir, reg.Endpoint)
	resp, err := c.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{inv.GPUs[7].UUID}}}})
	require.NoError(t, err)
	r := resp.ContainerResponses[0]
	assert.Equal(t, inv.GPUs[7].UUID, r.Envs[VisibleDevicesEnv])
	assert.Empty(t, r.CdiDevices)
	var paths []string
	for _, d := range r.Devices {
		paths = append(paths, d.ContainerPath)
	}
	assert.ElementsMatch(t, []string{"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia7"}, paths)
	cancel()
	require.NoError(t, <-done)
}
