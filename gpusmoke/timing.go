package gpusmoke

import (
	"context"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/gpudra/gpudra/bench/prepbench"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// TimingConfig times prepare and unprepare with make bench-prepare's
// harness: the plugin binary as shipped, as a process of its own, against
// a real API server, playing the kubelet over its DRA socket, one claim
// after the other.
type TimingConfig struct {
	// PluginBinary is gpudra-kubelet-plugin; empty: no timing.
	PluginBinary string
	// Claims is how many one-GPU claims each node prepares (default 50).
	Claims int
	// PluginArgs are added to the plugin's flags on both nodes.
	PluginArgs []string
}

// timingRun is one node's run in the timings table.
type timingRun struct {
	Node    string          `json:"node"`
	Backend string          `json:"backend"`
	Claims  int             `json:"claims"`
	Skipped string          `json:"skipped,omitempty"`
	Result  *prepbenchStats `json:"result,omitempty"`
}

// prepbenchStats are a run's percentiles in milliseconds.
type prepbenchStats struct {
	PrepareP50, PrepareP90, PrepareP99, PrepareMax         float64
	UnprepareP50, UnprepareP90, UnprepareP99, UnprepareMax float64
	PeakRSSMiB                                             float64
}

func stats(r prepbench.Result) *prepbenchStats {
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	return &prepbenchStats{
		PrepareP50: ms(prepbench.Percentile(r.Prepare, 0.5)), PrepareP90: ms(prepbench.Percentile(r.Prepare, 0.9)),
		PrepareP99: ms(prepbench.Percentile(r.Prepare, 0.99)), PrepareMax: ms(prepbench.Percentile(r.Prepare, 1)),
		UnprepareP50: ms(prepbench.Percentile(r.Unprepare, 0.5)), UnprepareP90: ms(prepbench.Percentile(r.Unprepare, 0.9)),
		UnprepareP99: ms(prepbench.Percentile(r.Unprepare, 0.99)), UnprepareMax: ms(prepbench.Percentile(r.Unprepare, 1)),
		PeakRSSMiB: float64(r.PeakRSS) / (1 << 20),
	}
}

// time runs the GPU node's whole GPUs (MIG off) and a simulated DGX H100's
// through the same harness, one after the other in this run, and prints
// both. A GPU in MIG mode is listed, not timed: timing its MIG devices
// would mean creating them.
func (s *session) time(ctx context.Context) error {
	claims := s.cfg.Timing.Claims
	if claims <= 0 {
		claims = 50
	}
	var whole []string
	var mig []string
	for i := range s.inv.GPUs {
		g := &s.inv.GPUs[i]
		if g.MIG.Enabled {
			mig = append(mig, fmt.Sprintf("%s (GPU %d, MIG mode: its MIG devices would be timed; gpu-smoke never creates one)", slicebuilder.GPUDeviceName(g), g.Index))
			continue
		}
		whole = append(whole, slicebuilder.GPUDeviceName(g))
	}
	base := prepbench.Config{PluginBinary: s.cfg.Timing.PluginBinary, Claims: claims, Chart: s.cfg.Chart, PluginArgs: s.cfg.Timing.PluginArgs}
	gpuRun := timingRun{Node: GPUNode, Claims: claims}
	gpuCfg := base
	gpuCfg.DevicesOverride = whole
	if s.gpu.backend != nil {
		gpuRun.Backend = "nvml"
		gpuCfg.Backend, gpuCfg.DriverRoot = "nvml", s.gpu.driverRoot
	} else {
		gpuRun.Backend = "sim " + s.gpu.simulated
		gpuCfg.Machine = s.gpu.simulated
	}
	simCfg := base
	simCfg.Machine, simCfg.Devices = "dgx-h100-nomig", 8
	simRun := timingRun{Node: simNode, Backend: "sim dgx-h100-nomig", Claims: claims}
	if len(whole) == 0 {
		gpuRun.Skipped = "no GPU with MIG off"
	} else {
		r, err := prepbench.Run(ctx, gpuCfg)
		if err != nil {
			return fmt.Errorf("node %s: %w", GPUNode, err)
		}
		gpuRun.Result = stats(r)
	}
	r, err := prepbench.Run(ctx, simCfg)
	if err != nil {
		return fmt.Errorf("node %s: %w", simNode, err)
	}
	simRun.Result = stats(r)
	runs := []timingRun{gpuRun, simRun}
	var b strings.Builder
	writeTimings(&b, runs)
	for _, m := range mig {
		fmt.Fprintf(&b, "not timed: %s\n", m)
	}
	fmt.Fprint(s.w, "\n== prepare and unprepare, "+fmt.Sprint(claims)+" one-GPU claims back to back per node (make bench-prepare's harness)\n"+b.String())
	if err := s.res.write("timings.txt", b.String()); err != nil {
		return err
	}
	return s.res.writeJSON("timings.json", runs)
}

func writeTimings(b *strings.Builder, runs []timingRun) {
	tw := tabwriter.NewWriter(b, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NODE\tBACKEND\tPREPARE P50\tP90\tP99\tMAX\tUNPREPARE P50\tP90\tP99\tMAX\tPLUGIN PEAK RSS")
	for _, r := range runs {
		if r.Result == nil {
			fmt.Fprintf(tw, "%s\t%s\tnot timed: %s\n", r.Node, r.Backend, r.Skipped)
			continue
		}
		x := r.Result
		fmt.Fprintf(tw, "%s\t%s\t%.2f ms\t%.2f\t%.2f\t%.2f\t%.2f ms\t%.2f\t%.2f\t%.2f\t%.1f MiB\n", r.Node, r.Backend,
			x.PrepareP50, x.PrepareP90, x.PrepareP99, x.PrepareMax, x.UnprepareP50, x.UnprepareP90, x.UnprepareP99, x.UnprepareMax, x.PeakRSSMiB)
	}
	_ = tw.Flush()
}
