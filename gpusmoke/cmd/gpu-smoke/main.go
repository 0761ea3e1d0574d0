// Command gpu-smoke runs devcluster's path on a real NVIDIA GPU
// (docs/gpu-smoke.md): one node backed by NVML beside a simulated one, a
// full-GPU claim prepared by the real plugin, containers whose probe runs
// nvidia-smi -L and a CUDA check, two MPS clients of one claim with a
// memory limit, a container without a claim, the NVML inventory beside the
// simulator's model, and prepare timed on the GPU. It never changes MIG
// mode, creates or destroys MIG devices, or resets a GPU, and refuses GPUs
// that other processes use. --simulated runs the same flow over a
// simulated GPU (the e2e suite does).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/gpusmoke"
)

func main() {
	cfg := gpusmoke.Config{OpenNVML: openNVML}
	var pluginArgs string
	fs := flag.NewFlagSet("gpu-smoke", flag.ExitOnError)
	fs.StringVar(&cfg.Runc, "runc", "bin/runc", "runc (make builds it)")
	fs.StringVar(&cfg.Probe, "probe", "bin/gpudra-probe", "the static probe (make probe)")
	fs.StringVar(&cfg.CUDACheck, "cuda-check", "bin/gpudra-cuda-check", "the CUDA check run inside the containers (make probe)")
	fs.StringVar(&cfg.MPSServer, "mps-server", "bin/gpudra-mps-server", "the static gpudra-mps-server the MPS server pods run (make probe)")
	fs.StringVar(&cfg.DriverRoot, "driver-root", "/", "where the NVIDIA driver is installed")
	fs.StringVar(&cfg.Results, "results", "", "a directory for what the run saw (comparison, slices, each pod's report, timings, RESULT)")
	fs.StringVar(&cfg.Simulated, "simulated", "", "a simulated machine (e.g. dgx-h100-nomig) behind the GPU node instead of NVML, with stand-ins for nvidia-smi and libcuda")
	fs.StringVar(&cfg.MPSControl, "mps-control-binary", "hack/fake-nvidia-cuda-mps-control", "with --simulated: what the simulated driver runs as nvidia-cuda-mps-control")
	fs.StringVar(&cfg.FakeLibCUDA, "fake-libcuda", "bin/fakecuda/libcuda.so", "with --simulated: the stand-in libcuda (make probe builds it from pkg/nvdevice/sim/fakecuda)")
	fs.StringVar(&cfg.MPSPinnedMemory, "mps-pinned-memory", "8Gi", "the MPS claim's pinned-memory limit; its clients allocate half and one and a half times it")
	fs.StringVar(&cfg.Timing.PluginBinary, "plugin-binary", "", "gpudra-kubelet-plugin: time prepare and unprepare on the GPU and on a simulated node (empty: no timing)")
	fs.IntVar(&cfg.Timing.Claims, "timing-claims", 50, "one-GPU claims prepared back to back per node when timing")
	fs.StringVar(&pluginArgs, "plugin-args", "", "flags added to the timed plugin's (default: as shipped, as make bench-prepare)")
	fs.DurationVar(&cfg.PodTimeout, "pod-timeout", 3*time.Minute, "how long to wait for each step's pods")
	fs.StringVar(&cfg.LogFile, "log-file", "", "the cluster's log (default: gpu-smoke.log in --results, else in the working directory)")
	cfg.Chart = chart.Default(".")
	fs.StringVar(&cfg.Chart.Dir, "chart", cfg.Chart.Dir, "the gpudra chart (its ServiceAccounts, RBAC and DeviceClasses)")
	fs.StringVar(&cfg.Chart.Helm, "helm", cfg.Chart.Helm, "helm, to render the chart")
	fs.StringVar(&cfg.Chart.Rendered, "rendered-chart", "", "the chart rendered ahead by --write-rendered-chart (the bundle's, which carries no helm): --chart and --helm are then unused")
	writeRendered := fs.String("write-rendered-chart", "", "render the chart with --helm for --rendered-chart into this file, and exit")
	klogFlags := flag.NewFlagSet("klog", flag.ExitOnError)
	klog.InitFlags(klogFlags)
	fs.Func("v", "log verbosity (in the log file)", func(v string) error { return klogFlags.Set("v", v) })
	_ = fs.Parse(os.Args[1:])
	cfg.Timing.PluginArgs = strings.Fields(pluginArgs)
	if *writeRendered != "" {
		rendered, err := chart.Render(context.Background(), cfg.Chart, chart.RenderedDirPlaceholder)
		if err == nil {
			err = os.WriteFile(*writeRendered, []byte(rendered), 0o644) //nolint:gosec // a chart, for people too
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "gpu-smoke:", err)
			os.Exit(1)
		}
		return
	}
	if cfg.LogFile == "" {
		cfg.LogFile = "gpu-smoke.log"
		if cfg.Results != "" {
			if err := os.MkdirAll(cfg.Results, 0o755); err == nil {
				cfg.LogFile = cfg.Results + "/gpu-smoke.log"
			}
		}
	}
	// The control plane logs a lot: into the file, not onto the terminal.
	for k, v := range map[string]string{"logtostderr": "false", "alsologtostderr": "false",
		"stderrthreshold": "FATAL", "log_file": cfg.LogFile, "one_output": "true"} {
		_ = klogFlags.Set(k, v)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := gpusmoke.Run(ctx, os.Stdout, cfg)
	stop()
	klog.Flush()
	if err != nil {
		fmt.Fprintln(os.Stderr, "gpu-smoke: FAIL:", err)
		os.Exit(1)
	}
	fmt.Println("gpu-smoke: PASS")
}
