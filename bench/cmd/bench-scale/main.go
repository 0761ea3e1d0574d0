// Command bench-scale measures what gpudra costs a cluster as it grows
// (make bench-scale): scheduler throughput and latency, the control
// plane's memory and etcd's size, and gpudra-controller's idle CPU, memory
// and gang planning, from 100 to 1,000 simulated DGX H100 nodes per node
// mix. Its last line is the summary of the largest point.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/bench/scalebench"
	"github.com/gpudra/gpudra/devcluster/chart"
)

func main() {
	var cfg scalebench.Config
	var nodes, mixes string
	var quick bool
	var qps float64
	flag.StringVar(&nodes, "nodes", "", "node counts, comma-separated, grown in order on one control plane per mix (default 100,300,1000; --quick: 50)")
	flag.StringVar(&mixes, "mixes", "", "node mixes, comma-separated: "+strings.Join(scalebench.AllMixes, ",")+"; none: only the gang planning step (default all; --quick: migoff,migmode-default)")
	flag.IntVar(&cfg.Pods, "pods", 0, "pods per workload per point, fewer where the point's free GPUs are short (default 100; --quick: 20)")
	flag.IntVar(&cfg.Gangs, "gangs", 0, "gangs per point, on nodes of their own, after the other workloads (default 8)")
	flag.DurationVar(&cfg.IdleWindow, "idle-window", 0, "how long idle CPU is measured after each point (default 15s; --quick: 5s)")
	flag.DurationVar(&cfg.BoundTimeout, "bound-timeout", 0, "how long one workload may take to be bound (default 3m)")
	flag.IntVar(&cfg.GangPlanNodes, "gang-plan-nodes", 0, "nodes of the gang planning step (one 64-GPU gang planned as the controller plans it, over migmode-all nodes); -1 skips it (default 1000; --quick: skipped)")
	flag.IntVar(&cfg.GangPlanClaims, "gang-plan-claims", 0, "claims allocated in the gang planning step (default 10000)")
	flag.BoolVar(&quick, "quick", os.Getenv("BENCH_SCALE") == "quick", "the short run: 50 nodes, two mixes, 20 pods per workload (also BENCH_SCALE=quick)")
	flag.StringVar(&cfg.ControllerBinary, "controller-binary", "bin/gpudra-controller", "gpudra-controller, as built by make build")
	flag.StringVar(&cfg.PluginBinary, "plugin-binary", "bin/gpudra-kubelet-plugin", "gpudra-kubelet-plugin: its --mig-devices default is the migmode-default mix's policy")
	flag.StringVar(&cfg.MigDefault, "mig-default", "", "the migmode-default mix's --mig-devices instead of the plugin binary's default")
	// Tuned by default: at the shipped limits the ResourceClaim
	// controller (20 QPS, two writes per pod) caps every point at about
	// 10 pods/s, and the sweep would measure that limit, not the
	// scheduler's cost of gpudra's devices.
	flag.Float64Var(&qps, "control-plane-qps", 1000, "client QPS of the scheduler and the controllers, burst twice that (0: the limits they ship with)")
	flag.StringVar(&cfg.Out, "out", "bench-scale-results.md", "the Markdown results")
	flag.StringVar(&cfg.CSV, "csv", "bench-scale-results.csv", "the CSV results")
	var plot string
	flag.StringVar(&plot, "plot", "", "the PNG plot of throughput and memory against node count (default "+scalebench.DefaultPlot+"; --quick: none, so that a quick run never overwrites the committed plot)")
	flag.StringVar(&cfg.Dir, "dir", "", "where the clusters keep their files (default: a temporary directory)")
	chartOpts := chart.Default(".")
	flag.StringVar(&chartOpts.Dir, "chart", chartOpts.Dir, "the chart whose identities and DeviceClasses the cluster gets")
	flag.StringVar(&chartOpts.Helm, "helm", chartOpts.Helm, "helm, to render the chart (make helm)")
	flag.Parse()
	cfg.Chart = chartOpts
	cfg.ControlPlaneQPS = float32(qps)
	var err error
	if cfg.Nodes, err = ints(nodes); err != nil {
		fmt.Fprintln(os.Stderr, "bench-scale: --nodes:", err)
		os.Exit(2)
	}
	if mixes != "" {
		cfg.Mixes = strings.Split(mixes, ",")
	}
	if quick {
		cfg.Quick()
	}
	cfg.Plot = scalebench.PlotPath(plot, quick)
	ctx := klog.NewContext(context.Background(), klog.Background())
	start := time.Now()
	if _, err := scalebench.Run(ctx, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "bench-scale:", err)
		os.Exit(1)
	}
	klog.FromContext(ctx).Info("Sweep done", "elapsed", time.Since(start).Round(time.Second))
}

func ints(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil {
			return nil, err
		}
		out = append(out, n)
	}
	return out, nil
}
