package scalebench

import (
	"bytes"
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"time"
)

func mib(b uint64) float64 { return float64(b) / (1 << 20) }

func ms(d time.Duration) string {
	return strconv.FormatFloat(float64(d.Microseconds())/1000, 'f', 1, 64)
}

// printPoint writes one point's Markdown table.
func printPoint(w io.Writer, p Point) {
	fmt.Fprintf(w, "## %s, %d nodes (MIG policy %s): %d devices in %d slices, published in %s\n\n",
		p.Mix, p.Nodes, p.MigPolicy, p.Devices, p.Slices, p.Publish.Round(100*time.Millisecond))
	fmt.Fprintln(w, "| workload | pods | bound | pods/s | create-to-bound p50 ms | p99 ms | gang last create to all bound ms |")
	fmt.Fprintln(w, "| --- | --- | --- | --- | --- | --- | --- |")
	row := func(x Workload, gang string) {
		fmt.Fprintf(w, "| %s | %d | %d | %.1f | %s | %s | %s |\n", x.Name, x.Pods, x.Bound, x.PodsPerSec, ms(x.P(0.5)), ms(x.P(0.99)), gang)
	}
	for _, x := range p.Workloads {
		gang := "-"
		if isGang(x.Name) {
			gang = ms(x.GangLast)
		}
		row(x, gang)
	}
	row(p.General(), "-")
	fmt.Fprintln(w)
	round := "-"
	if p.RoundMean > 0 {
		round = ms(p.RoundMean)
	}
	fmt.Fprintln(w, "| control plane heap MiB | RSS MiB | peak RSS MiB | idle CPU % | etcd db MiB | controller idle CPU % | controller RSS MiB | peak RSS MiB | gang plans | plan mean ms | round mean ms |")
	fmt.Fprintln(w, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
	fmt.Fprintf(w, "| %.0f | %.0f | %.0f | %.1f | %.1f | %.1f | %.0f | %.0f | %d | %s | %s |\n\n",
		mib(p.CPHeap), mib(p.CPRSS), mib(p.CPPeak), p.CPIdleCPU, float64(p.EtcdDB)/(1<<20), p.CtrlIdleCPU, mib(p.CtrlRSS), mib(p.CtrlPeak), p.Plans, ms(p.PlanMean), round)
}

// summary is the table of every point, one row each.
func summary(w io.Writer, res Result) {
	fmt.Fprintf(w, "## Summary (%d points in %s)\n\n", len(res.Points), res.Elapsed.Round(time.Second))
	fmt.Fprintln(w, "| mix | nodes | devices | slices | publish s | pods | bound | pods/s | p50 ms | p99 ms | gangs bound | gang last ms | cp heap MiB | cp RSS MiB | etcd db MiB | ctrl idle CPU % | ctrl RSS MiB | ctrl peak MiB | plan mean ms |")
	fmt.Fprintln(w, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
	for _, p := range res.Points {
		g := p.General()
		gangs, gangLast := "-", "-"
		for _, x := range p.Workloads {
			if isGang(x.Name) {
				gangs, gangLast = fmt.Sprintf("%d/%d", x.Bound, x.Pods), ms(x.GangLast)
			}
		}
		fmt.Fprintf(w, "| %s | %d | %d | %d | %.1f | %d | %d | %.1f | %s | %s | %s | %s | %.0f | %.0f | %.1f | %.1f | %.0f | %.0f | %s |\n",
			p.Mix, p.Nodes, p.Devices, p.Slices, p.Publish.Seconds(), g.Pods, g.Bound, g.PodsPerSec, ms(g.P(0.5)), ms(g.P(0.99)),
			gangs, gangLast, mib(p.CPHeap), mib(p.CPRSS), float64(p.EtcdDB)/(1<<20), p.CtrlIdleCPU, mib(p.CtrlRSS), mib(p.CtrlPeak), ms(p.PlanMean))
	}
	fmt.Fprintln(w)
}

// Largest is the point the summary line is about: the most nodes, then
// the most devices.
func (r Result) Largest() (Point, bool) {
	var best Point
	found := false
	for _, p := range r.Points {
		if !found || p.Nodes > best.Nodes || p.Nodes == best.Nodes && p.Devices > best.Devices {
			best, found = p, true
		}
	}
	return best, found
}

// Line is the summary line make bench-scale prints last.
func (r Result) Line() string {
	p, ok := r.Largest()
	if !ok {
		return "scale nodes=0 devices=0 pods_per_s=0 bound_p99=0s controller_idle_cpu=0 controller_rss=0"
	}
	g := p.General()
	return fmt.Sprintf("scale nodes=%d devices=%d pods_per_s=%.1f bound_p99=%s controller_idle_cpu=%.1f controller_rss=%.0f",
		p.Nodes, p.Devices, g.PodsPerSec, g.P(0.99).Round(time.Millisecond), p.CtrlIdleCPU, mib(p.CtrlRSS))
}

// AllBound says whether every pod of every point was bound.
func (r Result) AllBound() error {
	var errs []error
	for _, p := range r.Points {
		for _, w := range p.Workloads {
			if w.Bound != w.Pods {
				errs = append(errs, fmt.Errorf("%s, %d nodes, %s: %d of %d pods bound", p.Mix, p.Nodes, w.Name, w.Bound, w.Pods))
			}
		}
	}
	return errors.Join(errs...)
}

// writeOutputs prints the summary and the last line, and writes the
// Markdown, the CSV and the plot.
func writeOutputs(cfg Config, res Result) error {
	var md bytes.Buffer
	clients := "as shipped"
	if cfg.ControlPlaneQPS > 0 {
		clients = fmt.Sprintf("%g QPS, burst %g", cfg.ControlPlaneQPS, 2*cfg.ControlPlaneQPS)
	}
	fmt.Fprintf(&md, "# bench-scale (nodes %v, mixes %v, %d pods per workload, scheduler and controller clients %s)\n\n", cfg.Nodes, cfg.Mixes, cfg.Pods, clients)
	for _, p := range res.Points {
		printPoint(&md, p)
	}
	printGangPlan(&md, res.GangPlan)
	summary(&md, res)
	fmt.Fprintln(&md, res.Line())
	summary(cfg.Stdout, res)
	var errs []error
	if cfg.Out != "" {
		errs = append(errs, writeFile(cfg.Out, md.Bytes()))
	}
	if cfg.CSV != "" {
		var b bytes.Buffer
		errs = append(errs, writeCSV(&b, res), writeFile(cfg.CSV, b.Bytes()))
	}
	if cfg.Plot != "" && len(res.Points) > 0 {
		var b bytes.Buffer
		errs = append(errs, Plot(&b, res.Points), writeFile(cfg.Plot, b.Bytes()))
	}
	fmt.Fprintln(cfg.Stdout, res.Line())
	return errors.Join(errs...)
}

func writeFile(path string, data []byte) error {
	if dir := filepath.Dir(path); dir != "" {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
	}
	return os.WriteFile(path, data, 0o644) //nolint:gosec // results to share
}

// writeCSV writes one row per workload of each point and one "all but
// gangs" row per point that also carries the point's figures.
func writeCSV(w io.Writer, res Result) error {
	c := csv.NewWriter(w)
	_ = c.Write([]string{"mix", "mig_policy", "nodes", "devices", "slices", "publish_s", "workload", "pods", "bound", "pods_per_s", "p50_ms", "p99_ms", "gang_last_ms",
		"cp_heap_mib", "cp_rss_mib", "cp_peak_mib", "cp_idle_cpu_pct", "etcd_db_mib", "ctrl_idle_cpu_pct", "ctrl_rss_mib", "ctrl_peak_mib", "gang_plans", "plan_mean_ms", "round_mean_ms"})
	f := func(v float64) string { return strconv.FormatFloat(v, 'f', 2, 64) }
	for _, p := range res.Points {
		base := []string{p.Mix, p.MigPolicy, strconv.Itoa(p.Nodes), strconv.Itoa(p.Devices), strconv.Itoa(p.Slices), f(p.Publish.Seconds())}
		for _, x := range append(append([]Workload(nil), p.Workloads...), p.General()) {
			row := append(append([]string(nil), base...), x.Name, strconv.Itoa(x.Pods), strconv.Itoa(x.Bound), f(x.PodsPerSec), ms(x.P(0.5)), ms(x.P(0.99)), ms(x.GangLast))
			if x.Name == "all but gangs" {
				row = append(row, f(mib(p.CPHeap)), f(mib(p.CPRSS)), f(mib(p.CPPeak)), f(p.CPIdleCPU), f(float64(p.EtcdDB)/(1<<20)),
					f(p.CtrlIdleCPU), f(mib(p.CtrlRSS)), f(mib(p.CtrlPeak)), strconv.Itoa(p.Plans), ms(p.PlanMean), ms(p.RoundMean))
			} else {
				row = append(row, "", "", "", "", "", "", "", "", "", "", "")
			}
			_ = c.Write(row)
		}
	}
	c.Flush()
	return c.Error()
}
