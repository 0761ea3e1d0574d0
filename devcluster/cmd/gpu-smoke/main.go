// Command gpu-smoke runs devcluster's path on a real NVIDIA GPU
// (docs/gpu-smoke.md): one node backed by NVML beside a simulated one, a
// full-GPU claim prepared by the real plugin, a container whose probe runs
// nvidia-smi -L, a container without a claim, and the NVML inventory beside
// the simulator's model. It never changes MIG mode, creates or destroys MIG
// devices, or resets a GPU, and refuses GPUs that other processes use.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/gpusmoke"
)

func main() {
	cfg := gpusmoke.Config{}
	flag.StringVar(&cfg.Runc, "runc", "bin/runc", "runc (make builds it)")
	flag.StringVar(&cfg.Probe, "probe", "bin/gpudra-probe", "the static probe (make probe)")
	flag.StringVar(&cfg.DriverRoot, "driver-root", "/", "where the NVIDIA driver is installed")
	cfg.Chart = devcluster.DefaultChart(".")
	flag.StringVar(&cfg.Chart.Dir, "chart", cfg.Chart.Dir, "the gpudra chart (its ServiceAccounts and RBAC)")
	flag.StringVar(&cfg.Chart.Helm, "helm", cfg.Chart.Helm, "helm, to render the chart")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := gpusmoke.Run(ctx, os.Stdout, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "gpu-smoke: FAIL:", err)
		os.Exit(1)
	}
	fmt.Println("gpu-smoke: PASS")
}
