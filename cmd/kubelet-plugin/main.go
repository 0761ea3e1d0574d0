// Command gpudra-kubelet-plugin is gpudra's DRA kubelet plugin: it runs on
// every GPU node, publishes the node's GPUs and prepares claims for the
// kubelet.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"syscall"

	"github.com/gpudra/gpudra/pkg/kubeclient"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/drivertools"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/nvml"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/plugin"
	"github.com/gpudra/gpudra/pkg/plugin/checkpoint"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// driverTool is where the driver tool is: the flag's value (a path under
// the driver root, or an absolute path outside it), which must exist, or
// else usr/bin/<name> under the driver root when it exists there, or else
// empty.
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

// envNumber is the environment variable's number, or def when it is unset
// or not a number.
func envNumber(key string, def float64) float64 {
	v, err := strconv.ParseFloat(os.Getenv(key), 64)
	if err != nil {
		return def
	}
	return v
}

func envBool(key string) bool {
	v, err := strconv.ParseBool(os.Getenv(key))
	return err == nil && v
}

type flags struct {
	taintEffect                                                           string
	fractional                                                            bool
	mpsControl, mpsServerImage, namespace, hostDriverRoot                 string
	nvidiaSMI                                                             string
	nodeName, kubeconfig, driverRoot, cdiDir, pluginDataDir, registrarDir string
	backend, machine, procRoot, podUID, metricsAddr                       string
	qps                                                                   float64
	burst                                                                 int
}

func env(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

func main() {
	var f flags
	klog.InitFlags(nil)
	flag.StringVar(&f.nodeName, "node-name", env("NODE_NAME", ""), "this node's name (env NODE_NAME)")
	flag.StringVar(&f.kubeconfig, "kubeconfig", env("KUBECONFIG", ""), "kubeconfig; in-cluster config when empty (env KUBECONFIG)")
	flag.StringVar(&f.driverRoot, "driver-root", env("DRIVER_ROOT", nvml.DefaultDriverRoot), "where the NVIDIA driver is installed (env DRIVER_ROOT)")
	flag.StringVar(&f.cdiDir, "cdi-dir", env("CDI_DIR", "/var/run/cdi"), "where CDI specs are written (env CDI_DIR)")
	flag.StringVar(&f.pluginDataDir, "plugin-data-dir", env("PLUGIN_DATA_DIR", filepath.Join(kubeletplugin.KubeletPluginsDir, slicebuilder.DriverName)), "DRA socket and checkpoint (env PLUGIN_DATA_DIR)")
	flag.StringVar(&f.registrarDir, "registrar-dir", env("REGISTRAR_DIR", kubeletplugin.KubeletRegistryDir), "kubelet plugin registry (env REGISTRAR_DIR)")
	flag.StringVar(&f.backend, "backend", env("BACKEND", "nvml"), "nvml or sim (env BACKEND)")
	flag.StringVar(&f.machine, "sim-machine", env("SIM_MACHINE", "dgx-h100"), "simulated machine for --backend sim: built-in name or YAML file (env SIM_MACHINE)")
	flag.StringVar(&f.procRoot, "proc-root", env("PROC_ROOT", "/proc"), "host /proc, for boot id, device majors and MIG minors (env PROC_ROOT)")
	flag.StringVar(&f.podUID, "pod-uid", env("POD_UID", ""), "this pod's UID, from the downward API: enables rolling updates (env POD_UID)")
	flag.StringVar(&f.metricsAddr, "metrics-address", env("METRICS_ADDRESS", ":9477"), "serves /metrics and /healthz (the liveness probe dials the plugin's sockets); empty disables (env METRICS_ADDRESS)")
	flag.Float64Var(&f.qps, "kube-api-qps", envNumber("KUBE_API_QPS", 100.0), "API client QPS: a prepare makes one request (the claim read), two for a shared device; client-go's default of 5 would queue prepares (env KUBE_API_QPS)")
	flag.IntVar(&f.burst, "kube-api-burst", int(envNumber("KUBE_API_BURST", 300.0)), "API client burst: covers a whole node's pods (110, two requests each) starting at once (env KUBE_API_BURST)")
	flag.BoolVar(&f.fractional, "fractional-gpus", envBool("FRACTIONAL_GPUS"), "publish whole GPUs with MIG off as shareable by several claims (consumable capacity), each share capped with MPS (env FRACTIONAL_GPUS)")
	flag.StringVar(&f.mpsControl, "mps-control-binary", env("MPS_CONTROL_BINARY", ""), "nvidia-cuda-mps-control: a path under the driver root, or an absolute path outside it; default: usr/bin/nvidia-cuda-mps-control under the driver root if it exists (env MPS_CONTROL_BINARY)")
	flag.StringVar(&f.mpsServerImage, "mps-server-image", env("MPS_SERVER_IMAGE", ""), "the gpudra image, for MPS server pods (one per GPU with MPS claims, independent of this container); empty: MPS servers run in this container and die with it (env MPS_SERVER_IMAGE)")
	flag.StringVar(&f.namespace, "namespace", env("POD_NAMESPACE", ""), "this pod's namespace, where MPS server pods run (env POD_NAMESPACE)")
	flag.StringVar(&f.hostDriverRoot, "host-driver-root", env("HOST_DRIVER_ROOT", "/"), "the driver root on the host (what --driver-root is a mount of), mounted into MPS server pods (env HOST_DRIVER_ROOT)")
	flag.StringVar(&f.nvidiaSMI, "nvidia-smi", env("NVIDIA_SMI", ""), "nvidia-smi, for time slices: a path under the driver root, or an absolute path outside it; default: usr/bin/nvidia-smi under the driver root (env NVIDIA_SMI)")
	flag.StringVar(&f.taintEffect, "unhealthy-taint-effect", env("UNHEALTHY_TAINT_EFFECT", "NoSchedule"), "taint on the devices of an unhealthy GPU: NoSchedule keeps new claims off, NoExecute also evicts the pods using them (env UNHEALTHY_TAINT_EFFECT)")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithCancelCause(ctx)
	if err := run(ctx, f, cancel); err != nil {
		klog.FromContext(ctx).Error(err, "gpudra-kubelet-plugin failed")
		klog.Flush()
		os.Exit(1)
	}
}

func run(ctx context.Context, f flags, cancel context.CancelCauseFunc) error {
	if f.nodeName == "" {
		return errors.New("--node-name (env NODE_NAME) is required")
	}
	if f.mpsServerImage != "" && f.namespace == "" {
		return errors.New("--mps-server-image needs --namespace (env POD_NAMESPACE): the namespace of the MPS server pods")
	}
	effect := resourceapi.DeviceTaintEffect(f.taintEffect)
	if effect != resourceapi.DeviceTaintEffectNoSchedule && effect != resourceapi.DeviceTaintEffectNoExecute {
		return fmt.Errorf("--unhealthy-taint-effect: %q is not NoSchedule or NoExecute", f.taintEffect)
	}
	cfg, err := clientConfig(f.kubeconfig)
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
	var backend nvdevice.Interface
	switch f.backend {
	case "nvml":
		smi, err := driverTool(tools, "nvidia-smi", f.nvidiaSMI, "nvidia-smi")
		if err != nil {
			return err
		}
		opts := nvml.Options{DriverRoot: f.driverRoot, ProcRoot: f.procRoot}
		if smi != "" {
			opts.ComputePolicy = drivertools.NvidiaSMI{Runner: tools, Path: smi}
		}
		if backend, err = nvml.New(ctx, opts); err != nil {
			return err
		}
	case "sim":
		if backend, err = sim.NewBuiltin(f.machine, f.nodeName); err != nil {
			return err
		}
	default:
		return fmt.Errorf("--backend: unknown backend %q, want nvml or sim", f.backend)
	}
	defer backend.Close()
	pc := plugin.Config{NodeName: f.nodeName, Backend: backend, Client: client, PodUID: f.podUID, RegistrarDir: f.registrarDir, PluginDataDir: f.pluginDataDir, CDIDir: f.cdiDir,
		FractionalGPUs: f.fractional, UnhealthyTaintEffect: effect, MPSControlBinary: mpsControl, DriverTools: tools,
		MPSServerImage: f.mpsServerImage, Namespace: f.namespace, HostDriverRoot: f.hostDriverRoot, Metrics: plugin.NewMetrics()}
	if pc.BootID, err = checkpoint.BootID(f.procRoot); err != nil {
		return err
	}
	p, err := plugin.Start(ctx, pc, cancel)
	if err != nil {
		return err
	}
	defer p.Stop()
	if f.metricsAddr != "" {
		go func() {
			if err := plugin.Serve(ctx, f.metricsAddr, pc.Metrics.Handler(p.Sockets...)); err != nil {
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

func clientConfig(kubeconfig string) (*rest.Config, error) {
	if kubeconfig != "" {
		return clientcmd.BuildConfigFromFlags("", kubeconfig)
	}
	cfg, err := rest.InClusterConfig()
	if err != nil {
		return nil, fmt.Errorf("no --kubeconfig and not in a cluster: %w", err)
	}
	return cfg, nil
}
