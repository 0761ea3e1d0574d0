package main

import (
	"context"
	"errors"
	"fmt"
	"os"

	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/deviceplugin"
	"github.com/gpudra/gpudra/pkg/drivertools"
	"github.com/gpudra/gpudra/pkg/kubeclient"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/plugin"
	"github.com/gpudra/gpudra/pkg/sharing"
	"github.com/gpudra/gpudra/pkg/telemetry"
)

// loadDevicePluginConfig reads --device-plugin-config; empty: nil (the
// defaults).
func loadDevicePluginConfig(path string) (*deviceplugin.Config, error) {
	if path == "" {
		return nil, nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("--device-plugin-config: %w", err)
	}
	cfg, err := deviceplugin.ParseConfig(b)
	if err != nil {
		return nil, fmt.Errorf("--device-plugin-config=%s: %w", path, err)
	}
	return cfg, nil
}

// runDevicePlugin is the node agent in device plugin mode: it refuses to
// start while the DRA side still has claims prepared on the node, then
// serves the classic device plugin API (pkg/deviceplugin) over the same
// backend, CDI directory, driver spec and health policy as DRA mode.
func runDevicePlugin(ctx context.Context, f *options, logArgs []string) error {
	if err := deviceplugin.CheckDRADrained(f.pluginDataDir); err != nil {
		return err
	}
	cfg, err := loadDevicePluginConfig(f.devicePluginConfig)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	tools := drivertools.Runner{Root: f.driverRoot}
	backend, driverFilesHostRoot, err := newBackend(ctx, f, tools)
	if err != nil {
		return err
	}
	defer backend.Close()
	writer, err := cdi.NewWriter(f.cdiDir)
	if err != nil {
		return err
	}
	mps, err := devicePluginMPS(f, cfg, tools, logArgs)
	if err != nil {
		return err
	}
	extra, err := writeDriverSpec(ctx, backend, writer, cdi.DriverOptions{HostRoot: driverFilesHostRoot, HookPath: f.cdiHook})
	if err != nil {
		return err
	}
	dpMetrics := deviceplugin.NewMetrics()
	f.startAttribution(telemetry.Register(ctx, dpMetrics.Registry, backend, f.nodeName, f.telemetryInterval))
	health, err := registerHealthMetrics(ctx, dpMetrics.Registry, backend, f.nodeName)
	if err != nil {
		return err
	}
	// A health watch of its own, under the device plugins' XID policy.
	if err := telemetry.FollowHealth(ctx, backend, health, nvdevice.NewXIDPolicy(f.healthIgnoredXIDs)); err != nil {
		return err
	}
	if f.metricsAddr != "" {
		// /metrics (the device plugin's and the process's) and /healthz
		// (every plugin's socket answers).
		serve, err := metricsServer(f, dpMetrics.Handler())
		if err != nil {
			return err
		}
		go func() {
			if err := serve(ctx); err != nil {
				cancel(err)
			}
		}()
	}
	klog.FromContext(ctx).Info("gpudra device plugin running", "node", f.nodeName, "backend", f.backend, "gpuResource", f.gpuResourceName,
		"config", f.devicePluginConfig)
	err = deviceplugin.Serve(ctx, deviceplugin.ServeOptions{
		Backend:         backend,
		Resources:       deviceplugin.ResourceOptions{GPUResourceName: f.gpuResourceName, Config: cfg},
		CDI:             writer,
		XIDPolicy:       nvdevice.NewXIDPolicy(f.healthIgnoredXIDs),
		PluginDir:       f.devicePluginDir,
		ExtraCDIDevices: extra,
		MPS:             mps,
		Metrics:         dpMetrics,
	})
	if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, context.Canceled) {
		return errors.Join(err, cause)
	}
	return err
}

// devicePluginMPS runs the MPS replicas' servers (sharing.mps) as DRA
// mode runs its MPS servers: pods of their own with --mps-server-image (the
// chart), so that they outlive this container, under the same directory
// and keys as DRA mode's. A config without MPS needs nothing; one with MPS
// but no nvidia-cuda-mps-control is refused by deviceplugin.Serve.
func devicePluginMPS(f *options, cfg *deviceplugin.Config, tools drivertools.Runner, logArgs []string) (deviceplugin.MPSOptions, error) {
	opts := deviceplugin.MPSOptions{PodResourcesSocket: f.podResourcesSocket, KubeletCheckpoint: f.kubeletDeviceCheckpoint}
	if cfg == nil || cfg.Sharing.MPS == nil {
		return opts, nil
	}
	control, err := driverTool(tools, "mps-control-binary", f.mpsControl, "nvidia-cuda-mps-control")
	if err != nil || control == "" {
		return opts, err
	}
	pc := plugin.Config{NodeName: f.nodeName, PluginDataDir: f.pluginDataDir, DriverTools: tools, MPSControlBinary: control,
		MPSServerImage: f.mpsServerImage, MPSServerServiceAccount: f.mpsServerServiceAccount, MPSServerLogArgs: logArgs, Namespace: f.namespace, HostDriverRoot: f.hostDriverRoot}
	if f.mpsServerImage != "" {
		restCfg, err := kubeclient.RESTConfig(f.kubeconfig)
		if err != nil {
			return opts, err
		}
		restCfg.QPS, restCfg.Burst = float32(f.qps), f.burst
		if pc.Client, err = kubeclient.NewForConfig(restCfg); err != nil {
			return opts, fmt.Errorf("API client (for MPS server pods): %w", err)
		}
	}
	m, err := sharing.NewManager(pc.SharingOptions())
	if err != nil {
		return opts, err
	}
	opts.MPS = m.MPS()
	return opts, nil
}

// writeDriverSpec writes the driver's common CDI spec as DRA mode does at
// start (cdi.BuildDriverSpec from what the backend discovers) and returns
// the CDI devices every container then gets: the driver device, or none
// when the backend finds no driver files (a simulated machine without a
// driver root). The spec is written once: a driver upgrade needs a restart
// of the agent in this mode.
func writeDriverSpec(ctx context.Context, backend nvdevice.DriverFiler, writer *cdi.Writer, opts cdi.DriverOptions) ([]string, error) {
	files, err := backend.DriverFiles(ctx)
	if errors.Is(err, nvdevice.ErrNotFound) {
		klog.FromContext(ctx).Info("No driver files found: containers get no driver libraries from the CDI spec", "reason", err.Error())
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("the driver's user-space files: %w", err)
	}
	spec, err := cdi.BuildDriverSpec(files, opts)
	if err != nil {
		return nil, err
	}
	if err := writer.WriteDriver(spec); err != nil {
		return nil, err
	}
	klog.FromContext(ctx).Info("Wrote the driver's CDI spec", "driverVersion", files.Version, "root", files.Root)
	return []string{cdi.DriverDeviceID}, nil
}

// checkDevicePluginDrained refuses DRA mode while pods of this node hold
// GPUs through a device plugin (gpudra's or NVIDIA's), as the kubelet's
// pod-resources API says (deviceplugin.CheckDevicePluginDrained with this
// agent's flags): node-local, no API request.
func checkDevicePluginDrained(ctx context.Context, f *options, cfg *deviceplugin.Config) error {
	return deviceplugin.CheckDevicePluginDrained(ctx,
		deviceplugin.DeviceHolders{PodResourcesSocket: f.podResourcesSocket, KubeletCheckpoint: f.kubeletDeviceCheckpoint},
		deviceplugin.OurResourceNames(f.gpuResourceName, cfg))
}
