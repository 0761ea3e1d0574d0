package dashboardbench

import (
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/gpudra/gpudra/pkg/dashboard"
)

// Result is one benchmark run's figures.
type Result struct {
	Nodes, GPUs, Claims int
	// CPUs is runtime.NumCPU of the machine that ran it.
	CPUs  int
	Setup struct {
		// Cluster: the control plane and the chart's DeviceClasses;
		// Fleet: the nodes and slices; Claims: pods, claims and their
		// allocations; Synced: from RunCluster's start to /api/view
		// showing every node and allocation.
		Cluster, Fleet, Claims, Synced time.Duration
	}
	// Summary is the dashboard's once synced.
	Summary dashboard.Summary
	// ViewPlain and ViewGzip are /api/view's body, as served.
	ViewPlain, ViewGzip int
	Paints              []PaintRun
	Updates             []UpdateRun
	// Heap is the process's live heap (after GC) with the dashboard
	// serving, less before it started: the control plane shares the
	// process, so this is the dashboard's, give or take the control
	// plane's own drift.
	Heap uint64
	// Build is dashboard.Build over the same objects, Encode the JSON
	// and gzip the server does once per revision (medians of 5, here).
	Build, Encode time.Duration
	// ViewFetchText and ViewParse are, in a page, fetching /api/view to
	// a string (gzip, warm) and JSON.parse of it: medians of 3, ms.
	ViewFetchText, ViewParse float64
}

// PaintRun is one fresh tab's load.
type PaintRun struct {
	pageTimings
	// Cold: the load's /api/view was the revision's first request, so
	// the server encoded it then.
	Cold bool
}

// UpdateRun is one claim allocated then deleted under a tab searching for
// it.
type UpdateRun struct {
	// Appear: from UpdateStatus returning to the holder in the DOM; Gone:
	// from Delete returning to the holder gone; Revision: from
	// UpdateStatus returning to the server's revision event.
	Appear, Gone, Revision time.Duration
	// Seen: the holder was drawn on the GPU it was allocated.
	Seen bool
}

// FirstPaint is the first paint of the runs that pick (all: nil), in
// milliseconds.
func (r Result) FirstPaint(pick func(PaintRun) bool) []float64 {
	var out []float64
	for _, p := range r.Paints {
		if pick == nil || pick(p) {
			out = append(out, p.FirstPaint)
		}
	}
	return out
}

// MaxCards is the most GPU cards any load had in the DOM at first paint.
func (r Result) MaxCards() int {
	n := 0
	for _, p := range r.Paints {
		n = max(n, p.Cards)
	}
	return n
}

// Markdown writes the results.
func (r Result) Markdown(w io.Writer) {
	fmt.Fprintf(w, "## gpudra dashboard: %d nodes x 8 GPUs (%d GPUs, %d held by claims of bound pods in %d namespaces), %d CPUs\n\n",
		r.Nodes, r.GPUs, r.Claims, len(Namespaces), r.CPUs)
	fmt.Fprintf(w, "Setup: control plane %s, nodes and slices %s, pods and claims %s; the dashboard showed them all %s after it started.\n\n",
		secs(r.Setup.Cluster), secs(r.Setup.Fleet), secs(r.Setup.Claims), secs(r.Setup.Synced))
	fmt.Fprintln(w, "| measure | median | max | runs |")
	fmt.Fprintln(w, "| --- | --- | --- | --- |")
	row := func(name string, vals []float64) {
		if len(vals) == 0 {
			return
		}
		fmt.Fprintf(w, "| %s | %.0f ms | %.0f ms | %d |\n", name, medianF(vals), slices.Max(vals), len(vals))
	}
	row("first paint, every run", r.FirstPaint(nil))
	row("first paint, warm (revision encoded already)", r.FirstPaint(func(p PaintRun) bool { return !p.Cold }))
	row("first paint, cold (the revision's first request)", r.FirstPaint(func(p PaintRun) bool { return p.Cold }))
	row("claim allocated: holder in the DOM", durs(r.Updates, func(u UpdateRun) time.Duration { return u.Appear }))
	row("claim allocated: server's revision event", durs(r.Updates, func(u UpdateRun) time.Duration { return u.Revision }))
	row("claim deleted: holder gone from the DOM", durs(r.Updates, func(u UpdateRun) time.Duration { return u.Gone }))
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| fact | value |")
	fmt.Fprintln(w, "| --- | --- |")
	fmt.Fprintf(w, "| /api/view body | %.1f MiB plain, %.0f KiB gzipped (as served) |\n", float64(r.ViewPlain)/(1<<20), float64(r.ViewGzip)/(1<<10))
	fmt.Fprintf(w, "| GPU cards in the DOM at first paint | %d at most (of %d GPUs) |\n", r.MaxCards(), r.GPUs)
	fmt.Fprintf(w, "| dashboard summary once synced | %d nodes, %d GPUs, %d allocated |\n", r.Summary.Nodes, r.Summary.GPUs, r.Summary.Allocated)
	fmt.Fprintf(w, "| dashboard.Build over the same objects | %s |\n", msStr(r.Build))
	fmt.Fprintf(w, "| the server's encode of one revision (JSON + gzip) | %s |\n", msStr(r.Encode))
	fmt.Fprintf(w, "| in a page: fetch /api/view to a string, then JSON.parse it (warm, medians of 3) | %.0f ms, then %.0f ms |\n", r.ViewFetchText, r.ViewParse)
	fmt.Fprintf(w, "| dashboard's live heap (process heap after GC, serving, less before it started) | %.0f MiB |\n", float64(r.Heap)/(1<<20))
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Where each load's time goes (ms from navigation start, Chrome's navigation and resource timings):")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| run | revision | document | app.js | DOMContentLoaded | /api/view asked | first byte | last byte | first paint | after the body (parse + draw) | frame painted | long tasks (start+ms) | cards |")
	fmt.Fprintln(w, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
	for i, p := range r.Paints {
		kind := "warm"
		if p.Cold {
			kind = "cold"
		}
		var long []string
		for _, t := range p.LongTasks {
			long = append(long, fmt.Sprintf("%.0f+%.0f", t[0], t[1]))
		}
		fmt.Fprintf(w, "| %d %s | %d | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | **%.0f** | %.0f | %.0f | %s | %d |\n", i+1, kind, p.Revision,
			p.DocEnd, p.ScriptEnd, p.DOMContentLoaded, p.ViewStart, p.ViewFirstByte, p.ViewEnd, p.FirstPaint, p.FirstPaint-p.ViewEnd, p.Painted,
			strings.Join(long, ", "), p.Cards)
	}
	fmt.Fprintln(w)
	if len(r.Updates) > 0 {
		var parts []string
		for _, u := range r.Updates {
			parts = append(parts, fmt.Sprintf("%d/%d/%d", u.Revision.Milliseconds(), u.Appear.Milliseconds(), u.Gone.Milliseconds()))
		}
		fmt.Fprintf(w, "Updates, each run (revision event / holder drawn / holder gone, ms): %s. The source waits 200 ms (its debounce) before each rebuild.\n\n", strings.Join(parts, ", "))
	}
}

// Line is a one-line summary.
func (r Result) Line() string {
	return fmt.Sprintf("dashboard nodes=%d first_paint_median_ms=%.0f first_paint_max_ms=%.0f cold_ms=%.0f update_median_ms=%.0f view_gzip_kib=%.0f cards=%d",
		r.Nodes, medianF(r.FirstPaint(nil)), maxF(r.FirstPaint(nil)), maxF(r.FirstPaint(func(p PaintRun) bool { return p.Cold })),
		medianF(durs(r.Updates, func(u UpdateRun) time.Duration { return u.Appear })), float64(r.ViewGzip)/(1<<10), r.MaxCards())
}

func durs(us []UpdateRun, f func(UpdateRun) time.Duration) []float64 {
	var out []float64
	for _, u := range us {
		out = append(out, float64(f(u))/float64(time.Millisecond))
	}
	return out
}

func medianF(vals []float64) float64 {
	if len(vals) == 0 {
		return 0
	}
	s := slices.Clone(vals)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func maxF(vals []float64) float64 {
	if len(vals) == 0 {
		return 0
	}
	return slices.Max(vals)
}

func secs(d time.Duration) string { return fmt.Sprintf("%.1f s", d.Seconds()) }

func msStr(d time.Duration) string {
	return fmt.Sprintf("%.1f ms", float64(d)/float64(time.Millisecond))
}
