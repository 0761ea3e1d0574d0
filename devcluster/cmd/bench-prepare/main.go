// Command bench-prepare measures the kubelet plugin's prepare and unprepare
// latency and peak memory against a real API server (make bench-prepare);
// its last line is the summary.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/prepbench"
)

func main() {
	var cfg prepbench.Config
	var pluginArgs string
	flag.StringVar(&cfg.PluginBinary, "plugin-binary", "bin/gpudra-kubelet-plugin", "gpudra-kubelet-plugin, as built by make build")
	flag.IntVar(&cfg.Claims, "claims", 200, "1-GPU claims, prepared and unprepared one after the other")
	flag.StringVar(&cfg.Machine, "sim-machine", "dgx-h100-nomig", "the plugin's simulated machine")
	flag.IntVar(&cfg.Devices, "devices", 8, "claims go round-robin over device indexes 0..<devices-1>")
	flag.StringVar(&cfg.DeviceFormat, "device-format", "gpu-%d", "a claim's device name from its index (e.g. gpu-%d-mig-3g-40gb-4 with --sim-machine=dgx-h100: a MIG device created at prepare)")
	flag.StringVar(&pluginArgs, "plugin-args", "", "space-separated flags added to the plugin's (e.g. --kube-api-qps=1000)")
	chart := devcluster.DefaultChart(".")
	flag.StringVar(&chart.Dir, "chart", chart.Dir, "the chart whose ServiceAccount and RBAC the plugin runs with")
	flag.StringVar(&chart.Helm, "helm", chart.Helm, "helm, to render the chart (make helm)")
	flag.Parse()
	cfg.Chart = chart
	cfg.PluginArgs = strings.Fields(pluginArgs)
	res, err := prepbench.Run(context.Background(), cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench-prepare:", err)
		os.Exit(1)
	}
	fmt.Printf("claim read (the API server's share) p50=%.2f p99=%.2f ms; plugin memory %s\n",
		float64(prepbench.Percentile(res.ClaimRead, 0.5).Microseconds())/1000, float64(prepbench.Percentile(res.ClaimRead, 0.99).Microseconds())/1000, res.Memory)
	fmt.Println(res.Line())
}
