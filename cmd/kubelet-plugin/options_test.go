package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	logsapi "k8s.io/component-base/logs/api/v1"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/component"
)

func env(vars map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) {
		v, ok := vars[k]
		return v, ok
	}
}

func parse(t *testing.T, args []string, vars map[string]string) (*component.Component, *options, error) {
	t.Helper()
	c := component.New("gpudra-kubelet-plugin")
	o := addFlags(c.Flags)
	return c, o, c.Parse(args, env(vars))
}

// Every flag keeps its name, its environment variable and its default.
func TestFlagsAndTheirEnvironment(t *testing.T) {
	c, o, err := parse(t, nil, nil)
	require.NoError(t, err)
	want := map[string]string{
		"node-name": "NODE_NAME", "kubeconfig": "KUBECONFIG", "driver-root": "DRIVER_ROOT", "cdi-dir": "CDI_DIR",
		"plugin-data-dir": "PLUGIN_DATA_DIR", "registrar-dir": "REGISTRAR_DIR", "backend": "BACKEND", "sim-machine": "SIM_MACHINE",
		"proc-root": "PROC_ROOT", "pod-uid": "POD_UID", "metrics-address": "METRICS_ADDRESS", "metrics-auth": "METRICS_AUTH", "metrics-tls": "METRICS_TLS", "kube-api-qps": "KUBE_API_QPS",
		"kube-api-burst": "KUBE_API_BURST", "fractional-gpus": "FRACTIONAL_GPUS", "dcgm-exporter-attributes": "DCGM_EXPORTER_ATTRIBUTES", "mig-devices": "MIG_DEVICES", "mps-control-binary": "MPS_CONTROL_BINARY",
		"mps-server-image": "MPS_SERVER_IMAGE", "namespace": "POD_NAMESPACE", "host-driver-root": "HOST_DRIVER_ROOT",
		"nvidia-smi": "NVIDIA_SMI", "unhealthy-taint-effect": "UNHEALTHY_TAINT_EFFECT", "health-ignored-xids": "HEALTH_IGNORED_XIDS",
		"nvidia-cdi-hook": "NVIDIA_CDI_HOOK", "mode": "MODE", "device-plugin-config": "DEVICE_PLUGIN_CONFIG",
		"gpu-resource-name": "GPU_RESOURCE_NAME", "device-plugin-dir": "DEVICE_PLUGIN_DIR", "kubelet-device-checkpoint": "KUBELET_DEVICE_CHECKPOINT",
		"pod-resources-socket": "POD_RESOURCES_SOCKET", "local-state-dir": "LOCAL_STATE_DIR",
		"telemetry-interval": "TELEMETRY_INTERVAL", "telemetry-processes": "TELEMETRY_PROCESSES", "container-log-dir": "CONTAINER_LOG_DIR",
	}
	for flag, envName := range want {
		assert.Equal(t, envName, component.EnvOf(c.Flags, flag), flag)
	}
	assert.Equal(t, options{
		driverRoot: "/", cdiDir: "/var/run/cdi", pluginDataDir: "/var/lib/kubelet/plugins/gpu.gpudra.dev",
		registrarDir: "/var/lib/kubelet/plugins_registry", backend: "nvml", machine: "dgx-h100", procRoot: "/proc",
		metricsAddr: ":9477", metricsAuth: true, metricsTLS: true, hostDriverRoot: "/", taintEffect: "NoSchedule", migDevices: "existing", qps: 100, burst: 300,
		// nvdevice.ApplicationXIDs, sorted.
		healthIgnoredXIDs: []uint64{13, 31, 43, 45, 68, 109},
		mode:              "dra", gpuResourceName: "nvidia.com/gpu", devicePluginDir: "/var/lib/kubelet/device-plugins",
		kubeletDeviceCheckpoint: "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint",
		podResourcesSocket:      "/var/lib/kubelet/pod-resources/kubelet.sock",
		localStateDir:           "/var/lib/gpudra/local",
		telemetryInterval:       10 * time.Second,
		telemetryProcesses:      true,
		containerLogDir:         "/var/log/containers",
	}, *o)
}

func TestEnvironment(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		env     map[string]string
		check   func(t *testing.T, o *options)
		wantErr []string
	}{
		{name: "KUBE_API_QPS=fifty", env: map[string]string{"KUBE_API_QPS": "fifty"},
			wantErr: []string{`environment variable KUBE_API_QPS="fifty" (--kube-api-qps): strconv.ParseFloat: parsing "fifty": invalid syntax`}},
		{name: "FRACTIONAL_GPUS=yes", env: map[string]string{"FRACTIONAL_GPUS": "yes"},
			wantErr: []string{`environment variable FRACTIONAL_GPUS="yes" (--fractional-gpus): strconv.ParseBool: parsing "yes": invalid syntax`}},
		{name: "HEALTH_IGNORED_XIDS with a word", env: map[string]string{"HEALTH_IGNORED_XIDS": "13,31,xid79"},
			wantErr: []string{`environment variable HEALTH_IGNORED_XIDS="13,31,xid79" (--health-ignored-xids): "xid79" is not an unsigned integer`}},
		{name: "KUBE_API_BURST=3e2", env: map[string]string{"KUBE_API_BURST": "3e2"},
			wantErr: []string{`environment variable KUBE_API_BURST="3e2" (--kube-api-burst)`}},
		{name: "the chart's environment", env: map[string]string{"NODE_NAME": "node-a", "KUBE_API_QPS": "20.5", "KUBE_API_BURST": "40",
			"FRACTIONAL_GPUS": "true", "HEALTH_IGNORED_XIDS": "13,43", "POD_NAMESPACE": "gpudra", "METRICS_ADDRESS": ":19477",
			"MODE": "device-plugin", "GPU_RESOURCE_NAME": "example.com/gpu", "DEVICE_PLUGIN_CONFIG": "/config/config.yaml",
			"DEVICE_PLUGIN_DIR": "/dp", "KUBELET_DEVICE_CHECKPOINT": "/dp/cp", "POD_RESOURCES_SOCKET": "/pr/kubelet.sock",
			"TELEMETRY_INTERVAL": "30s", "DCGM_EXPORTER_ATTRIBUTES": "true"},
			check: func(t *testing.T, o *options) {
				assert.Equal(t, "device-plugin", o.mode)
				assert.Equal(t, "example.com/gpu", o.gpuResourceName)
				assert.Equal(t, "/config/config.yaml", o.devicePluginConfig)
				assert.Equal(t, "/dp", o.devicePluginDir)
				assert.Equal(t, "/dp/cp", o.kubeletDeviceCheckpoint)
				assert.Equal(t, "/pr/kubelet.sock", o.podResourcesSocket)
				assert.Equal(t, "node-a", o.nodeName)
				assert.InDelta(t, 20.5, o.qps, 0)
				assert.Equal(t, 40, o.burst)
				assert.True(t, o.fractional)
				assert.True(t, o.dcgmExporterAttributes)
				assert.Equal(t, []uint64{13, 43}, o.healthIgnoredXIDs)
				assert.Equal(t, "gpudra", o.namespace)
				assert.Equal(t, ":19477", o.metricsAddr)
				assert.Equal(t, 30*time.Second, o.telemetryInterval)
			}},
		{name: "TELEMETRY_INTERVAL=0 disables telemetry", env: map[string]string{"TELEMETRY_INTERVAL": "0"},
			check: func(t *testing.T, o *options) { assert.Zero(t, o.telemetryInterval) }},
		{name: "TELEMETRY_INTERVAL=10", env: map[string]string{"TELEMETRY_INTERVAL": "10"},
			wantErr: []string{`environment variable TELEMETRY_INTERVAL="10" (--telemetry-interval)`}},
		{name: "the command line wins", args: []string{"--kube-api-qps=1000", "--node-name=node-b", "--health-ignored-xids=", "--fractional-gpus=false"},
			env: map[string]string{"KUBE_API_QPS": "fifty", "NODE_NAME": "node-a", "HEALTH_IGNORED_XIDS": "13", "FRACTIONAL_GPUS": "true"},
			check: func(t *testing.T, o *options) {
				assert.InDelta(t, 1000, o.qps, 0)
				assert.Equal(t, "node-b", o.nodeName)
				assert.Equal(t, []uint64{}, o.healthIgnoredXIDs, "an empty flag: no XID is ignored")
				assert.False(t, o.fractional)
			}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, o, err := parse(t, tc.args, tc.env)
			if len(tc.wantErr) > 0 {
				require.Error(t, err)
				for _, want := range tc.wantErr {
					assert.Contains(t, err.Error(), want)
				}
				return
			}
			require.NoError(t, err)
			tc.check(t, o)
		})
	}
}

func TestValidate(t *testing.T) {
	tests := []struct {
		args []string
		want string // "": valid
	}{
		{[]string{"--node-name=a"}, ""},
		{[]string{"--node-name=a", "--fractional-gpus"}, ""},
		{nil, "--node-name (env NODE_NAME) is required"},
		{[]string{"--node-name=a", "--fractional-gpus", "--feature-gates=FractionalGPUs=false"},
			"fractional GPUs (--fractional-gpus): feature gate FractionalGPUs is disabled (--feature-gates=FractionalGPUs=true turns it on)"},
		{[]string{"--node-name=a", "--fractional-gpus", "--feature-gates=MPSSharing=false"}, "feature gate MPSSharing is disabled"},
		{[]string{"--node-name=a", "--feature-gates=FractionalGPUs=false"}, ""},
		{[]string{"--node-name=a", "--unhealthy-taint-effect=Evict"}, `--unhealthy-taint-effect: "Evict" is not NoSchedule or NoExecute`},
		{[]string{"--node-name=a", "--mig-devices=small"}, `--mig-devices (env MIG_DEVICES): MIG device policy "small": want all, existing or profiles=<profile>,<profile>...`},
		{[]string{"--node-name=a", "--mig-devices=profiles=1g.10gb,,3g.40gb"}, `MIG device policy "profiles=1g.10gb,,3g.40gb": an empty profile name`},
		{[]string{"--node-name=a", "--backend=cuda"}, `--backend: unknown backend "cuda", want nvml or sim`},
		{[]string{"--node-name=a", "--mps-server-image=x"}, "--mps-server-image needs --namespace (env POD_NAMESPACE)"},
		{[]string{"--node-name=a", "--mode=device-plugin"}, ""},
		{[]string{"--node-name=a", "--mode=device-plugin", "--gpu-resource-name=example.com/gpu", "--device-plugin-config=/etc/dp.yaml"}, ""},
		{[]string{"--node-name=a", "--mode=DRA"}, `--mode (env MODE): unknown mode "DRA", want dra or device-plugin`},
		{[]string{"--node-name=a", "--mode=device-plugin", "--gpu-resource-name=gpu"},
			`--gpu-resource-name (env GPU_RESOURCE_NAME): "gpu" is not a valid extended resource name (domain/name)`},
		{[]string{"--node-name=a", "--gpu-resource-name=kubernetes.io/gpu"}, `--gpu-resource-name (env GPU_RESOURCE_NAME): "kubernetes.io/gpu": the kubernetes.io domain is reserved`},
		{[]string{"--node-name=a", "--mode=device-plugin", "--device-plugin-dir="}, "--device-plugin-dir (env DEVICE_PLUGIN_DIR) is required in device plugin mode"},
		{[]string{"--node-name=a", "--device-plugin-dir="}, ""},
		{[]string{"--node-name=a", "--telemetry-interval=0"}, ""},
		{[]string{"--node-name=a", "--telemetry-interval=-1s"}, "--telemetry-interval (env TELEMETRY_INTERVAL): -1s is negative (0 disables telemetry)"},
		{[]string{"--node-name=a", "--container-log-dir="}, `--container-log-dir (env CONTAINER_LOG_DIR): "" is not an absolute path; --telemetry-processes (on) needs it`},
		{[]string{"--node-name=a", "--container-log-dir=var/log/containers"}, `--container-log-dir (env CONTAINER_LOG_DIR): "var/log/containers" is not an absolute path`},
		{[]string{"--node-name=a", "--pod-resources-socket="}, `--pod-resources-socket (env POD_RESOURCES_SOCKET): "" is not an absolute path`},
		{[]string{"--node-name=a", "--proc-root=proc"}, `--proc-root (env PROC_ROOT): "proc" is not an absolute path`},
		{[]string{"--node-name=a", "--container-log-dir=", "--telemetry-processes=false"}, ""},
		{[]string{"--node-name=a", "--container-log-dir=", "--telemetry-interval=0"}, ""},
	}
	for _, tc := range tests {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			c, o, err := parse(t, tc.args, nil)
			require.NoError(t, err)
			err = o.validate(c.Features)
			if tc.want == "" {
				assert.NoError(t, err)
				return
			}
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.want)
		})
	}
}

// The plugin's errors come out in the chosen log format: here a start
// without a node name, with --logging-format=json.
func TestErrorsAreLoggedAsJSON(t *testing.T) {
	t.Cleanup(func() { require.NoError(t, logsapi.ResetForTest(nil)) })
	c := component.New("gpudra-kubelet-plugin")
	o := addFlags(c.Flags)
	var stdout, stderr bytes.Buffer
	code := c.Execute(context.Background(), []string{"--logging-format=json", "--backend=sim"}, component.IO{Stdout: &stdout, Stderr: &stderr, LookupEnv: env(nil)},
		func(ctx context.Context) error { return run(ctx, o, c.Features, c.LoggingArgs()) })
	klog.Flush()
	assert.Equal(t, component.ExitFailed, code)
	lines := strings.Split(strings.TrimSpace(stderr.String()), "\n")
	require.Len(t, lines, 2, stderr.String())
	var last map[string]any
	for _, line := range lines {
		require.NoError(t, json.Unmarshal([]byte(line), &last), "not JSON: %s", line)
	}
	assert.Equal(t, "gpudra-kubelet-plugin failed", last["msg"])
	assert.Equal(t, "--node-name (env NODE_NAME) is required", last["err"])
}
