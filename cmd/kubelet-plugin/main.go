// Command gpudra-kubelet-plugin is gpudra's node agent: it runs on every
// GPU node as the DRA kubelet plugin (--mode=dra: publishes the node's GPUs
// and prepares claims for the kubelet) or as the classic device plugin
// (--mode=device-plugin, docs/device-plugin.md), one mode per node.
package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/component-base/featuregate"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/component"
	"github.com/gpudra/gpudra/pkg/deviceplugin"
	"github.com/gpudra/gpudra/pkg/drivertools"
	"github.com/gpudra/gpudra/pkg/features"
	"github.com/gpudra/gpudra/pkg/kubeclient"
	"github.com/gpudra/gpudra/pkg/local"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/nvml"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/plugin"
	"github.com/gpudra/gpudra/pkg/plugin/checkpoint"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
	"github.com/gpudra/gpudra/pkg/telemetry"
)

func main() {
	c := component.New("gpudra-kubelet-plugin")
	o := addFlags(c.Flags)
	c.Main(func(ctx context.Context) error { return run(ctx, o, c.Features, c.LoggingArgs()) })
}

// driverTool is where the driver tool is: the flag's value (a path under
// the driver root, or an absolute path outside it), which must exist, or
// else <name> looked for in drivertools.ToolDirs under the driver root when
// it is there, or else empty.
func driverTool(tools drivertools.Runner, flag, flagValue, name string) (string, error) {
	if flagValue != "" {
		p, ok := tools.Path(flagValue)
		if !ok {
			return "", fmt.Errorf("--%s=%s: not found (a path under driver root %s, or an absolute path outside it)", flag, flagValue, tools.Root)
		}
		return p, nil
	}
	if p, ok := tools.Path(name); ok {
		return p, nil
	}
	return "", nil
}

// newBackend is the GPU backend of --backend, and where the container
// runtime finds the driver's files the backend discovers (empty: where they
// were found).
func newBackend(ctx context.Context, f *options, tools drivertools.Runner) (nvdevice.Interface, string, error) {
	switch f.backend {
	case "nvml":
		smi, err := driverTool(tools, "nvidia-smi", f.nvidiaSMI, "nvidia-smi")
		if err != nil {
			return nil, "", err
		}
		opts := nvml.Options{DriverRoot: f.driverRoot, ProcRoot: f.procRoot}
		if smi != "" {
			opts.ComputePolicy = drivertools.NvidiaSMI{Runner: tools, Path: smi}
		}
		backend, err := nvml.New(ctx, opts)
		if err != nil {
			return nil, "", err
		}
		// The driver's files the backend discovers under --driver-root
		// are at --host-driver-root for the container runtime.
		return backend, f.hostDriverRoot, nil
	case "sim":
		m, err := sim.NewBuiltin(f.machine, f.nodeName)
		if err != nil {
			return nil, "", err
		}
		// A simulated driver (sim.WriteDriverRoot, as devcluster lays one
		// out for each node, marked as such) under --driver-root gives the
		// machine its driver files, at --host-driver-root for the
		// container runtime; a host's real driver never does.
		if sim.IsSimulatedDriverRoot(f.driverRoot) {
			m.SetDriverRoot(f.driverRoot)
			return m, f.hostDriverRoot, nil
		}
		return m, "", nil
	}
	return nil, "", fmt.Errorf("--backend: unknown backend %q, want nvml or sim", f.backend)
}

// run is the node agent's wiring in DRA mode (device plugin mode is
// runDevicePlugin): the API client, the GPU backend, the plugin
// and its metrics server. A fatal error in the background cancels ctx with
// its cause, which run returns.
func run(ctx context.Context, f *options, gates featuregate.FeatureGate, logArgs []string) error {
	if err := f.validate(gates); err != nil {
		return err
	}
	// gpudra local hands out the same GPUs without Kubernetes: one or the
	// other owns them (docs/local.md): marked and checked under its lock.
	if err := local.ClaimForPlugin(ctx, f.localStateDir, f.pluginDataDir); err != nil {
		return err
	}
	if f.mode == modeDevicePlugin {
		return runDevicePlugin(ctx, f, logArgs)
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	effect := resourceapi.DeviceTaintEffect(f.taintEffect)
	cfg, err := kubeclient.RESTConfig(f.kubeconfig)
	if err != nil {
		return err
	}
	cfg.QPS, cfg.Burst = float32(f.qps), f.burst
	client, err := kubeclient.NewForConfig(cfg)
	if err != nil {
		return fmt.Errorf("API client: %w", err)
	}
	// nvidia-smi and nvidia-cuda-mps-control run through the driver root's
	// own loader, so that a host libc never meets this image's.
	tools := drivertools.Runner{Root: f.driverRoot}
	mpsControl, err := driverTool(tools, "mps-control-binary", f.mpsControl, "nvidia-cuda-mps-control")
	if err != nil {
		return err
	}
	// A node runs one mode: DRA starts only when no pod holds a GPU through
	// a device plugin; the device plugin mode's CDI specs then go.
	dpConfig, err := loadDevicePluginConfig(f.devicePluginConfig)
	if err != nil {
		return err
	}
	if err := checkDevicePluginDrained(ctx, f, dpConfig); err != nil {
		return err
	}
	if err := deviceplugin.RemoveCDISpecs(ctx, f.cdiDir); err != nil {
		return err
	}
	backend, driverFilesHostRoot, err := newBackend(ctx, f, tools)
	if err != nil {
		return err
	}
	defer backend.Close()
	pc := plugin.Config{NodeName: f.nodeName, Backend: backend, Client: client, PodUID: f.podUID, RegistrarDir: f.registrarDir, PluginDataDir: f.pluginDataDir, CDIDir: f.cdiDir,
		FractionalGPUs: f.fractional, DCGMExporterAttributes: f.dcgmExporterAttributes, MigDevices: migPolicy(f.migDevices), UnhealthyTaintEffect: effect, MPSControlBinary: mpsControl, DriverTools: tools,
		MPSServerImage: f.mpsServerImage, MPSServerServiceAccount: f.mpsServerServiceAccount, MPSServerLogArgs: logArgs, Namespace: f.namespace, HostDriverRoot: f.hostDriverRoot, Metrics: plugin.NewMetrics(),
		HealthIgnoredXIDs: f.healthIgnoredXIDs, FeatureGates: gates,
		DriverFilesHostRoot: driverFilesHostRoot, CDIHookPath: f.cdiHook}
	telemetryCollector := telemetry.Register(ctx, pc.Metrics.Registry, backend, f.nodeName, f.telemetryInterval)
	f.startAttribution(telemetryCollector)
	// The plugin's health watch (DeviceHealth) feeds the health metrics.
	if features.Enabled(gates, features.DeviceHealth) {
		if pc.HealthObserver, err = registerHealthMetrics(ctx, pc.Metrics.Registry, backend, f.nodeName); err != nil {
			return err
		}
	}
	if pc.BootID, err = checkpoint.BootID(f.procRoot); err != nil {
		return err
	}
	p, err := plugin.Start(ctx, pc, cancel)
	if err != nil {
		return err
	}
	defer p.Stop()
	if telemetryCollector != nil {
		// Device series are attributed to the claims prepared on them.
		telemetryCollector.SetClaims(p.PreparedClaims)
	}
	if f.metricsAddr != "" {
		serve, err := metricsServer(f, pc.Metrics.Handler(p.Sockets...))
		if err != nil {
			return err
		}
		go func() {
			if err := serve(ctx); err != nil {
				cancel(err)
			}
		}()
	}
	klog.FromContext(ctx).Info("gpudra kubelet plugin running", "node", f.nodeName, "backend", f.backend)
	<-ctx.Done()
	if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, context.Canceled) {
		return cause
	}
	return nil
}

// migPolicy is the parsed --mig-devices (validated with the other flags).
func migPolicy(s string) slicebuilder.MigPolicy {
	p, _ := slicebuilder.ParseMigPolicy(s)
	return p
}

// registerHealthMetrics exports what the health watch sees
// (gpudra_gpu_xid_errors_total, gpudra_gpu_healthy) for the backend's GPUs
// on the registry /metrics serves; the health watch feeds what it returns.
func registerHealthMetrics(ctx context.Context, reg prometheus.Registerer, backend nvdevice.Inventorier, node string) (*telemetry.HealthMetrics, error) {
	inv, err := backend.Inventory(ctx)
	if err != nil {
		return nil, fmt.Errorf("the GPUs of the health metrics: %w", err)
	}
	h := telemetry.NewHealthMetrics(node, inv.GPUs)
	reg.MustRegister(h)
	return h, nil
}
