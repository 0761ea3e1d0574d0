// Command bench-dashboard measures gpudra dashboard (issue 37) on a large
// fleet (make bench-dashboard): devcluster's control plane with API-only
// nodes of 8 H100s each, half their GPUs held, the dashboard's server in
// this process and a headless Chromium: first paint, where its time goes,
// the /api/view body, the cards in the DOM, how long an allocated or
// deleted claim takes to show, and the dashboard's heap. Markdown results
// to stdout and --out; the last line is the summary.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/bench/dashboardbench"
	"github.com/gpudra/gpudra/devcluster/chart"
)

func main() {
	var cfg dashboardbench.Config
	var out string
	flag.IntVar(&cfg.Nodes, "nodes", 1000, "API-only nodes of 8 GPUs each; half the GPUs are held by claims")
	flag.IntVar(&cfg.Runs, "runs", 5, "fresh tabs timed (the last one the first request of a new revision), and claims allocated and deleted")
	flag.IntVar(&cfg.Workers, "workers", 32, "parallel writers for the nodes, pods and claims")
	flag.StringVar(&cfg.Dir, "dir", "", "where the cluster keeps its files (default: a temporary directory)")
	flag.StringVar(&out, "out", "bench-dashboard-results.md", "the Markdown results")
	chartOpts := chart.Default(".")
	flag.StringVar(&chartOpts.Dir, "chart", chartOpts.Dir, "the chart whose identities and DeviceClasses the cluster gets")
	flag.StringVar(&chartOpts.Helm, "helm", chartOpts.Helm, "helm, to render the chart (make helm)")
	flag.Parse()
	cfg.Chart = chartOpts
	cfg.Out = os.Stdout
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx = klog.NewContext(ctx, klog.Background())
	start := time.Now()
	res, err := dashboardbench.Run(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench-dashboard:", err)
		os.Exit(1)
	}
	f, err := os.Create(out)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench-dashboard:", err)
		os.Exit(1)
	}
	res.Markdown(f)
	if err := f.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "bench-dashboard:", err)
		os.Exit(1)
	}
	klog.FromContext(ctx).Info("Benchmark done", "elapsed", time.Since(start).Round(time.Second))
	fmt.Println(res.Line())
}
