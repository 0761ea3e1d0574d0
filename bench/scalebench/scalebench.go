// Package scalebench measures what gpudra costs a cluster as it grows
// (issue 26, make bench-scale): devcluster's real control plane (etcd,
// kube-apiserver, kube-scheduler, the ResourceClaim controller) with
// hundreds to a thousand simulated DGX H100 nodes that are only API objects,
// a Node and the ResourceSlices the kubelet plugin would publish for it
// (pkg/slicebuilder over a simulated machine), written by the harness: no
// kubelet and no plugin process runs, so what is measured is the cluster
// side. Pods are bound by kube-scheduler and never run. gpudra-controller
// runs as the shipped binary, a process of its own, as the chart's
// ServiceAccount, with gangs on.
//
// Each node mix (what every node publishes) gets one control plane, grown
// from the smallest node count to the largest; at each point the workloads
// (1-GPU claims, MIG claims, NVLink pairs, a prioritized list, then gangs
// of 8 pods x 8 GPUs) are added on top of what earlier points left
// allocated, as on a cluster that grows while busy.
package scalebench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/devcluster/chart"
)

// Node mixes: what every node of the cluster publishes (8 H100s each).
const (
	// MixPlain is the baseline a driver without partitions publishes:
	// 8 GPUs with one attribute, no counters.
	MixPlain = "plain"
	// MixMigOff is gpudra on a DGX H100 with MIG off.
	MixMigOff = "migoff"
	// MixMigDefault is gpudra on a DGX H100 in MIG mode with the kubelet
	// plugin's default --mig-devices, read from the plugin binary.
	MixMigDefault = "migmode-default"
	// MixMigAll is gpudra on a DGX H100 in MIG mode with --mig-devices=all.
	MixMigAll = "migmode-all"
)

// MixNone as the only mix runs no cluster: the gang planning step alone.
const MixNone = "none"

// AllMixes are the mixes in the order the sweep runs them.
var AllMixes = []string{MixPlain, MixMigOff, MixMigDefault, MixMigAll}

// Config of one sweep.
type Config struct {
	// Nodes are the node counts, run in increasing order on one control
	// plane per mix.
	Nodes []int
	// Mixes to run (AllMixes).
	Mixes []string
	// Pods is the number of pods of each workload at each point, lowered
	// where the point's free GPUs could not hold them (at most 70% of
	// them used, so that fragmentation never leaves a pod unschedulable).
	Pods int
	// Gangs of GangSize pods with GangGPUs whole GPUs each run after the
	// other workloads, while those stay allocated, on nodes of their own
	// (at most half the point's new nodes).
	Gangs, GangSize, GangGPUs int
	// IdleWindow is how long the controller's (and the control plane's)
	// CPU is measured once the point's pods are bound. The controller
	// counts devices per class at most every 15 s: a window of 15 s or
	// more sees one count.
	IdleWindow time.Duration
	// BoundTimeout is how long one workload may take to be bound before
	// the point goes on without its remaining pods.
	BoundTimeout time.Duration
	// ControllerBinary is gpudra-controller as built by make build.
	ControllerBinary string
	// PluginBinary is gpudra-kubelet-plugin: its --mig-devices default is
	// what MixMigDefault publishes.
	PluginBinary string
	// MigDefault, when set, is used instead of asking PluginBinary.
	MigDefault string
	// Chart gives the cluster its identities and the DeviceClasses.
	Chart chart.Options
	// ControlPlaneQPS tunes the scheduler's and the controllers' client
	// limits (devcluster.Options); zero: the shipped limits.
	ControlPlaneQPS float32
	// GangPlanNodes and GangPlanClaims size the gang planning step (the
	// planner as the controller runs it, timed directly, GangPlan): a
	// 64-GPU gang over that many migmode-all nodes with that many claims
	// allocated; GangPlanNodes < 0 skips it.
	GangPlanNodes, GangPlanClaims int
	// Dir holds the clusters' files; empty: a temporary directory.
	Dir string
	// Out, CSV and Plot are written at the end (Markdown, CSV, PNG);
	// empty: not written.
	Out, CSV, Plot string
	// Stdout receives the tables as points complete and the summary line;
	// nil: os.Stdout.
	Stdout io.Writer
}

// Defaults fills what is unset: the full sweep.
func (c *Config) Defaults() {
	if len(c.Nodes) == 0 {
		c.Nodes = []int{100, 300, 1000}
	}
	if len(c.Mixes) == 0 {
		c.Mixes = AllMixes
	}
	if c.Pods == 0 {
		c.Pods = 100
	}
	if c.Gangs == 0 {
		c.Gangs = 8
	}
	if c.GangSize == 0 {
		c.GangSize = 8
	}
	if c.GangGPUs == 0 {
		c.GangGPUs = 8
	}
	if c.IdleWindow == 0 {
		c.IdleWindow = 15 * time.Second
	}
	if c.BoundTimeout == 0 {
		c.BoundTimeout = 3 * time.Minute
	}
	if c.GangPlanNodes == 0 {
		c.GangPlanNodes = 1000
	}
	if c.GangPlanClaims == 0 {
		c.GangPlanClaims = 10000
	}
	if c.Stdout == nil {
		c.Stdout = os.Stdout
	}
}

// DefaultPlot is the committed plot (docs/benchmarks.md shows it), which a
// sweep writes unless told otherwise.
const DefaultPlot = "docs/bench-scale.png"

// PlotPath is where a run draws its plot: the --plot flag's value where
// given, else nowhere for a quick run (its 50 nodes would replace the
// committed sweep's plot: issue 50), else DefaultPlot.
func PlotPath(flagValue string, quick bool) string {
	switch {
	case flagValue != "":
		return flagValue
	case quick:
		return ""
	default:
		return DefaultPlot
	}
}

// Quick makes the configuration the short run (BENCH_SCALE=quick, the
// e2e test): 50 nodes, MIG off and MIG mode with the plugin's default, a
// few pods per workload. Fields set explicitly beforehand are kept.
func (c *Config) Quick() {
	if len(c.Nodes) == 0 {
		c.Nodes = []int{50}
	}
	if len(c.Mixes) == 0 {
		c.Mixes = []string{MixMigOff, MixMigDefault}
	}
	if c.Pods == 0 {
		c.Pods = 20
	}
	if c.IdleWindow == 0 {
		c.IdleWindow = 5 * time.Second
	}
	if c.GangPlanNodes == 0 {
		c.GangPlanNodes = -1
	}
	c.Defaults()
}

func (c *Config) validate() error {
	var errs []error
	for _, m := range c.Mixes {
		if !slices.Contains(AllMixes, m) && m != MixNone {
			errs = append(errs, fmt.Errorf("unknown mix %q: want %s", m, strings.Join(AllMixes, ", ")))
		}
	}
	for _, n := range c.Nodes {
		if n <= 0 {
			errs = append(errs, fmt.Errorf("node count %d: must be positive", n))
		}
	}
	if c.Pods <= 0 || c.GangSize <= 0 || c.GangGPUs <= 0 || c.Gangs < 0 {
		errs = append(errs, errors.New("pods, gang size and GPUs per gang pod must be positive"))
	}
	if c.ControllerBinary == "" {
		errs = append(errs, errors.New("ControllerBinary (bin/gpudra-controller) is required"))
	}
	return errors.Join(errs...)
}

// Result are the points of a sweep, in the order they ran.
type Result struct {
	Points []Point
	// GangPlan is the gang planning step; nil when skipped.
	GangPlan *GangPlanResult
	// Elapsed is the whole sweep.
	Elapsed time.Duration
}

// Run runs the sweep: for each mix a control plane, grown through the node
// counts. The Markdown tables are printed as points complete; the files
// and the summary line are written at the end, also after a failure, with
// the points that completed.
func Run(ctx context.Context, cfg Config) (res Result, err error) {
	cfg.Defaults()
	if err := cfg.validate(); err != nil {
		return res, err
	}
	logger := klog.FromContext(ctx)
	start := time.Now()
	nodes := append([]int(nil), cfg.Nodes...)
	slices.Sort(nodes)
	cfg.Nodes = slices.Compact(nodes)
	dir := cfg.Dir
	if dir == "" {
		d, err := os.MkdirTemp("", "scaleb")
		if err != nil {
			return res, err
		}
		if os.Getenv("SCALEBENCH_KEEP") == "" {
			defer os.RemoveAll(d)
		}
		dir = d
	}
	migDefault := cfg.MigDefault
	if migDefault == "" && slices.Contains(cfg.Mixes, MixMigDefault) {
		if migDefault, err = PluginMigDefault(ctx, cfg.PluginBinary); err != nil {
			return res, err
		}
	}
	clients := "as shipped"
	if cfg.ControlPlaneQPS > 0 {
		clients = fmt.Sprintf("%g QPS", cfg.ControlPlaneQPS)
	}
	fmt.Fprintf(cfg.Stdout, "# bench-scale: nodes %v, mixes %s, %d pods per workload, %d gangs of %dx%d GPUs, scheduler and controller clients %s (plugin's default --mig-devices: %q)\n\n",
		cfg.Nodes, strings.Join(cfg.Mixes, ","), cfg.Pods, cfg.Gangs, cfg.GangSize, cfg.GangGPUs, clients, migDefault)
	defer func() {
		res.Elapsed = time.Since(start)
		if werr := writeOutputs(cfg, res); werr != nil {
			err = errors.Join(err, werr)
		}
	}()
	for i, name := range cfg.Mixes {
		if name == MixNone {
			continue
		}
		m, err := newMix(name, migDefault)
		if err != nil {
			return res, err
		}
		logger.Info("Mix", "mix", name, "migPolicy", m.policyString())
		points, err := runMix(ctx, cfg, m, filepath.Join(dir, fmt.Sprintf("m%d", i)))
		res.Points = append(res.Points, points...)
		if err != nil {
			return res, fmt.Errorf("mix %s: %w", name, err)
		}
	}
	if cfg.GangPlanNodes > 0 {
		classes, err := chartClasses(ctx, cfg.Chart, dir)
		if err != nil {
			return res, err
		}
		g, err := GangPlan(ctx, classes, cfg.GangPlanNodes, cfg.GangPlanClaims, cfg.GangSize, cfg.GangGPUs, 3)
		if err != nil {
			return res, fmt.Errorf("gang planning: %w", err)
		}
		res.GangPlan = &g
		printGangPlan(cfg.Stdout, res.GangPlan)
	}
	return res, nil
}
