package prepbench

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestPercentileAndLine(t *testing.T) {
	var prep, unprep []time.Duration
	for i := 1; i <= 100; i++ {
		prep = append(prep, time.Duration(i)*time.Millisecond)
		unprep = append(unprep, time.Duration(i)*100*time.Microsecond)
	}
	assert.Equal(t, 51*time.Millisecond, Percentile(prep, 0.5))
	assert.Equal(t, 99*time.Millisecond, Percentile(prep, 0.99))
	assert.Equal(t, 100*time.Millisecond, Percentile(prep, 1), "p100 is the maximum")
	assert.Equal(t, time.Duration(0), Percentile(nil, 0.5))
	r := Result{Prepare: prep, Unprepare: unprep, PeakRSS: 41 << 20}
	assert.Equal(t, "prepare p50=51.00 p90=90.00 p99=99.00 max=100.00 unprepare p50=5.10 p99=9.90 max=10.00 rss=41.0", r.Line())
}

var paths = Paths{Node: "n1", Kubeconfig: "/d/kubeconfig", PluginsDir: "/d/plugins", RegistrarDir: "/d/registry", CDIDir: "/d/cdi", Devices: 8}

// The default is what make bench-prepare ran before foreign plugins and
// backends: gpudra's plugin over the simulator, at its own client limits.
func TestCommandDefaultIsGpudraOverTheSimulator(t *testing.T) {
	cfg := Config{Machine: "dgx-h100-nomig", Devices: 8, Claims: 1}
	require.NoError(t, cfg.validate())
	args, env, socket := cfg.Command(paths)
	assert.Equal(t, []string{"--node-name=n1", "--kubeconfig=/d/kubeconfig", "--backend=sim", "--sim-machine=dgx-h100-nomig",
		"--plugin-data-dir=/d/plugins/gpu.gpudra.dev", "--registrar-dir=/d/registry", "--cdi-dir=/d/cdi", "--metrics-address=", "-v=0",
		"--kubelet-device-checkpoint=/d/device-plugins/kubelet_internal_checkpoint", "--pod-resources-socket=/d/pod-resources/kubelet.sock"}, args)
	assert.Empty(t, env)
	assert.Equal(t, "/d/plugins/gpu.gpudra.dev/dra.sock", socket)
	assert.Equal(t, "gpu.gpudra.dev", cfg.driver())
	assert.Equal(t, "bench-node", cfg.node())
}

func TestCommandNVMLBackendClientLimitsAndExtras(t *testing.T) {
	cfg := Config{Backend: "nvml", Machine: "ignored", ClientQPS: 1000, ClientBurst: 2000,
		PluginArgs: []string{"--mig-devices=all"}, PluginEnv: []string{"GODEBUG=gctrace=1"}}
	args, env, _ := cfg.Command(paths)
	assert.Equal(t, []string{"--node-name=n1", "--kubeconfig=/d/kubeconfig", "--backend=nvml", "--driver-root=/",
		"--plugin-data-dir=/d/plugins/gpu.gpudra.dev", "--registrar-dir=/d/registry", "--cdi-dir=/d/cdi", "--metrics-address=", "-v=0",
		"--kubelet-device-checkpoint=/d/device-plugins/kubelet_internal_checkpoint", "--pod-resources-socket=/d/pod-resources/kubelet.sock",
		"--kube-api-qps=1000", "--kube-api-burst=2000", "--mig-devices=all"}, args)
	assert.Equal(t, []string{"GODEBUG=gctrace=1"}, env)

	cfg.DriverRoot = "/run/nvidia/driver"
	args, _, _ = cfg.Command(paths)
	assert.Contains(t, args, "--driver-root=/run/nvidia/driver")
	assert.NotContains(t, args, "--sim-machine=ignored")
}

func TestCommandExampleDriver(t *testing.T) {
	cfg := Config{Foreign: ExampleDriver(), ClientQPS: 1000, ClientBurst: 1000, Devices: 8, Claims: 1}
	require.NoError(t, cfg.validate())
	args, env, socket := cfg.Command(paths)
	assert.Equal(t, []string{"--node-name=n1", "--kubeconfig=/d/kubeconfig", "--device-profile=gpu", "--driver-name=gpu.example.com",
		"--num-devices=8", "--kubelet-plugins-directory-path=/d/plugins", "--kubelet-registrar-directory-path=/d/registry",
		"--cdi-root=/d/cdi", "--healthcheck-port=-1", "--metrics-port=-1", "--kube-api-qps=1000", "--kube-api-burst=1000"}, args)
	assert.Empty(t, env)
	assert.Equal(t, "/d/plugins/gpu.example.com/dra.sock", socket)
	assert.Equal(t, "gpu.example.com", cfg.driver())
	assert.Equal(t, "dra-example-driver", cfg.name())

	f := &Foreign{Name: "x", Driver: "x.dev", Socket: "{pluginsDir}/x.sock", Env: []string{"NODE={node}", "N={devices}"}}
	_, env, socket = Config{Foreign: f}.Command(paths)
	assert.Equal(t, []string{"NODE=n1", "N=8"}, env)
	assert.Equal(t, "/d/plugins/x.sock", socket)
}

func TestClaimDevices(t *testing.T) {
	cfg := Config{Devices: 8}
	assert.Equal(t, "gpu-0", cfg.device(0))
	assert.Equal(t, "gpu-1", cfg.device(9))
	cfg.DeviceFormat = "gpu-%d-mig-3g-40gb-4"
	assert.Equal(t, "gpu-7-mig-3g-40gb-4", cfg.device(15))
	cfg.DevicesOverride = []string{"gpu-0", "gpu-3"}
	assert.Equal(t, []string{"gpu-0", "gpu-3", "gpu-0"}, []string{cfg.device(0), cfg.device(1), cfg.device(2)})
}

func TestValidate(t *testing.T) {
	for name, c := range map[string]struct {
		cfg Config
		err string
	}{
		"no claims":                {Config{Devices: 8}, "Claims and Devices (or DevicesOverride) must be positive"},
		"no devices":               {Config{Claims: 1}, "Claims and Devices (or DevicesOverride) must be positive"},
		"override is enough":       {Config{Claims: 1, DevicesOverride: []string{"gpu-0"}, Backend: "nvml"}, ""},
		"unknown backend":          {Config{Claims: 1, Devices: 1, Backend: "cuda"}, `Backend "cuda": want sim or nvml`},
		"backend of a foreign":     {Config{Claims: 1, Devices: 1, Backend: "sim", Foreign: ExampleDriver()}, "Backend is gpudra's plugin's flag; a Foreign plugin brings its own devices"},
		"foreign without socket":   {Config{Claims: 1, Devices: 1, Foreign: &Foreign{Driver: "x"}}, "a Foreign plugin needs its Driver and Socket"},
		"foreign without a driver": {Config{Claims: 1, Devices: 1, Foreign: &Foreign{Socket: "s"}}, "a Foreign plugin needs its Driver and Socket"},
	} {
		t.Run(name, func(t *testing.T) {
			err := c.cfg.validate()
			if c.err == "" {
				assert.NoError(t, err)
				return
			}
			assert.EqualError(t, err, c.err)
		})
	}
}
