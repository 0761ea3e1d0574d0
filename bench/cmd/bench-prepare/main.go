// Command bench-prepare measures the kubelet plugin's prepare and unprepare
// latency and peak memory against a real API server (make bench-prepare);
// its last line is the summary.
//
// With --example-binary it runs gpudra's plugin and the DRA example
// driver's, interleaved (gpudra, example, gpudra, example, ... for
// --rounds rounds), each on a control plane of its own started the same
// way, at the same client limits, over the same claims; the last line then
// compares them. --before-binary adds another build of gpudra's plugin to
// each round (before, gpudra, example), for a before and after in one run.
package main

import (
	"context"
	"flag"
	"fmt"
	"math"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/gpudra/gpudra/bench/prepbench"
	"github.com/gpudra/gpudra/devcluster/chart"
)

func main() {
	var cfg prepbench.Config
	var pluginArgs, pluginEnv, devicesOverride, foreign, exampleBinary, beforeBinary string
	var rounds, round int
	var latencies string
	flag.StringVar(&cfg.PluginBinary, "plugin-binary", "bin/gpudra-kubelet-plugin", "gpudra-kubelet-plugin, as built by make build (or, with --foreign, that plugin)")
	flag.IntVar(&cfg.Claims, "claims", 200, "1-GPU claims, prepared and unprepared one after the other")
	flag.StringVar(&cfg.Backend, "backend", "sim", "gpudra plugin's backend: sim (--sim-machine) or nvml (the node's GPUs, --driver-root)")
	flag.StringVar(&cfg.DriverRoot, "driver-root", "/", "where the NVIDIA driver is installed, for --backend=nvml")
	flag.StringVar(&cfg.Machine, "sim-machine", "dgx-h100-nomig", "the plugin's simulated machine")
	flag.IntVar(&cfg.Devices, "devices", 8, "claims go round-robin over device indexes 0..<devices-1>")
	flag.StringVar(&cfg.DeviceFormat, "device-format", "gpu-%d", "a claim's device name from its index (e.g. gpu-%d-mig-3g-40gb-4 with --sim-machine=dgx-h100: a MIG device created at prepare)")
	flag.StringVar(&devicesOverride, "devices-override", "", "comma-separated device names the claims go round-robin over, instead of --device-format and --devices")
	flag.Float64Var(&cfg.ClientQPS, "kube-api-qps", 0, "the plugin's API client QPS (both plugins' --kube-api-qps); 0: the plugin's default")
	flag.IntVar(&cfg.ClientBurst, "kube-api-burst", 0, "the plugin's API client burst (--kube-api-burst); 0: the plugin's default")
	flag.StringVar(&pluginArgs, "plugin-args", "", "space-separated flags added to the plugin's (e.g. --kube-api-qps=1000)")
	flag.StringVar(&pluginEnv, "plugin-env", "", "space-separated NAME=value added to the plugin's environment (e.g. GODEBUG=gctrace=1)")
	flag.StringVar(&foreign, "foreign", "", "run --plugin-binary as another driver's plugin: dra-example-driver")
	flag.StringVar(&exampleBinary, "example-binary", "", "the DRA example driver's dra-example-kubeletplugin: compare it with gpudra's, interleaved")
	flag.StringVar(&beforeBinary, "before-binary", "", "with --example-binary: another build of gpudra's plugin (the one before a change), run first in each round")
	flag.IntVar(&rounds, "rounds", 1, "with --example-binary: gpudra/example pairs (or before/gpudra/example triples), interleaved")
	flag.IntVar(&round, "round", 1, "without --example-binary: the round number --latencies records")
	flag.StringVar(&latencies, "latencies", "", "append every claim's latencies to this CSV file (plugin,round,claim,prepare_us,unprepare_us,claimread_us)")
	flag.BoolVar(&cfg.Paced, "paced", false, "the benchmark's own requests through the cluster's admin client (100 QPS, burst 200), as before issue 34: about 100 prepares a second instead of back to back")
	flag.StringVar(&cfg.Dir, "dir", "", "where the cluster and the plugin keep their files (kept); empty: a temporary directory, removed")
	chartOpts := chart.Default(".")
	flag.StringVar(&chartOpts.Dir, "chart", chartOpts.Dir, "the chart whose ServiceAccount and RBAC the plugin runs with")
	flag.StringVar(&chartOpts.Helm, "helm", chartOpts.Helm, "helm, to render the chart (make helm)")
	flag.Parse()
	cfg.Chart = chartOpts
	cfg.PluginArgs = strings.Fields(pluginArgs)
	cfg.PluginEnv = strings.Fields(pluginEnv)
	if devicesOverride != "" {
		cfg.DevicesOverride = strings.Split(devicesOverride, ",")
	}
	if cfg.Backend == "sim" {
		cfg.Backend = "" // the default; a Foreign plugin takes none
	}
	switch foreign {
	case "":
	case "dra-example-driver":
		cfg.Foreign = prepbench.ExampleDriver()
	default:
		fail(fmt.Errorf("--foreign %q: want dra-example-driver", foreign))
	}
	ctx := context.Background()
	if exampleBinary == "" {
		res, err := prepbench.Run(ctx, cfg)
		if err != nil {
			fail(err)
		}
		name := "gpudra"
		if cfg.Foreign != nil {
			name = cfg.Foreign.Name
		}
		writeLatencies(latencies, name, round, res)
		fmt.Printf("claim read (the API server's share) p50=%.2f p99=%.2f ms; plugin memory %s\n",
			ms(prepbench.Percentile(res.ClaimRead, 0.5)), ms(prepbench.Percentile(res.ClaimRead, 0.99)), res.Memory)
		fmt.Println(res.Line())
		return
	}
	if cfg.Foreign != nil {
		fail(fmt.Errorf("--example-binary compares with gpudra's plugin (--plugin-binary): no --foreign"))
	}
	example := cfg
	example.PluginBinary, example.Backend, example.Foreign = exampleBinary, "", prepbench.ExampleDriver()
	type run struct {
		name string
		cfg  prepbench.Config
	}
	order := []run{{"gpudra", cfg}, {"example", example}}
	if beforeBinary != "" {
		before := cfg
		before.PluginBinary = beforeBinary
		order = append([]run{{"before", before}}, order...)
	}
	byPlugin := map[string][]prepbench.Result{}
	for r := 1; r <= rounds; r++ {
		for _, run := range order {
			if cfg.Dir != "" {
				run.cfg.Dir = fmt.Sprintf("%s/%s-%d", cfg.Dir, run.name, r)
			}
			res, err := prepbench.Run(ctx, run.cfg)
			if err != nil {
				fail(fmt.Errorf("%s, round %d: %w", run.name, r, err))
			}
			name := run.name
			if run.cfg.Foreign != nil {
				name = run.cfg.Foreign.Name
			}
			writeLatencies(latencies, name, r, res)
			byPlugin[run.name] = append(byPlugin[run.name], res)
			fmt.Printf("round %d %-7s %s claimread-p50=%.2f\n", r, run.name, res.Line(), ms(prepbench.Percentile(res.ClaimRead, 0.5)))
		}
	}
	if beforeBinary != "" {
		fmt.Println("before: " + compare(byPlugin["before"], byPlugin["example"]))
	}
	fmt.Println(compare(byPlugin["gpudra"], byPlugin["example"]))
}

// compare is the last line of an interleaved run: each plugin's medians
// over the rounds, and gpudra's p99 and max over the example's.
func compare(g, e []prepbench.Result) string {
	med := func(rs []prepbench.Result, f func(prepbench.Result) float64) float64 {
		v := make([]float64, len(rs))
		for i, r := range rs {
			v[i] = f(r)
		}
		sort.Float64s(v)
		if len(v)%2 == 1 {
			return v[len(v)/2]
		}
		return (v[len(v)/2-1] + v[len(v)/2]) / 2
	}
	p := func(q float64) func(prepbench.Result) float64 {
		return func(r prepbench.Result) float64 { return ms(prepbench.Percentile(r.Prepare, q)) }
	}
	rss := func(r prepbench.Result) float64 { return float64(r.PeakRSS) / (1 << 20) }
	line := func(rs []prepbench.Result) string {
		return fmt.Sprintf("p50=%.2f p90=%.2f p99=%.2f max=%.2f rss=%.1f", med(rs, p(0.5)), med(rs, p(0.9)), med(rs, p(0.99)), med(rs, p(1)), med(rs, rss))
	}
	// Round by round: each run against the example's run next to it.
	logSum := 0.0
	for i := range g {
		logSum += math.Log(p(0.99)(g[i]) / p(0.99)(e[i]))
	}
	all := func(rs []prepbench.Result) float64 {
		var lat []time.Duration
		for _, r := range rs {
			lat = append(lat, r.Prepare...)
		}
		return ms(prepbench.Percentile(lat, 0.99))
	}
	return fmt.Sprintf("medians of %d rounds, prepare ms: gpudra %s; example %s; gpudra/example p99=%.2fx max=%.2fx; p99 round by round (geometric mean)=%.2fx; all prepares p99 %.2f/%.2f=%.2fx", len(g),
		line(g), line(e), med(g, p(0.99))/med(e, p(0.99)), med(g, p(1))/med(e, p(1)), math.Exp(logSum/float64(len(g))), all(g), all(e), all(g)/all(e))
}

// writeLatencies appends a run's latencies to the CSV file at path (none
// when path is empty).
func writeLatencies(path, name string, round int, res prepbench.Result) {
	if path == "" {
		return
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		fail(err)
	}
	defer f.Close()
	for i := range res.Prepare {
		fmt.Fprintf(f, "%s,%d,%d,%d,%d,%d\n", name, round, i, res.Prepare[i].Microseconds(), res.Unprepare[i].Microseconds(), res.ClaimRead[i].Microseconds())
	}
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func fail(err error) {
	fmt.Fprintln(os.Stderr, "bench-prepare:", err)
	os.Exit(1)
}
