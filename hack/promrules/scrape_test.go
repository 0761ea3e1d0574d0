package promrules

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/promslog"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/value"
	"github.com/prometheus/prometheus/promql"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/prometheus/prometheus/rules"
	"github.com/prometheus/prometheus/util/teststorage"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

// Where the chart keeps the files under test.
var (
	chartDir      = filepath.Join("..", "..", "deployments", "helm", "gpudra")
	rulesFile     = filepath.Join(chartDir, "files", "prometheus-rules.yaml")
	dashboardFile = filepath.Join(chartDir, "files", "grafana-dashboard.json")
	metricsDoc    = filepath.Join("..", "..", "docs", "metrics.md")
)

// scrapeInterval is the chart's ServiceMonitor interval, and the rule
// evaluation interval of the tests.
const scrapeInterval = 30 * time.Second

// base is when every timeline starts.
var base = time.Unix(1_800_000_000, 0)

// sample is one scraped series' value.
type sample struct {
	lset labels.Labels
	v    float64
}

// targetLabels are what Prometheus, through the chart's ServiceMonitor,
// adds to a plugin pod's series: the target's own (job, instance, the
// plugin pod's namespace, pod and container) and the node relabeling.
func targetLabels(node, job string) map[string]string {
	return map[string]string{
		"job": job, "instance": "10.0.0." + strconv.Itoa(len(node)) + ":9477", "endpoint": "metrics",
		"service": job, "namespace": "gpudra", "pod": job + "-" + node, "container": "plugin", "node": node,
	}
}

// scrape gathers g as Prometheus would store it: one series per counter,
// gauge and histogram bucket, the target's labels added under
// honor_labels (the series' own labels win, as the ServiceMonitor's
// honorLabels: true says).
func scrape(t testing.TB, g prometheus.Gatherer, target map[string]string) []sample {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	var out []sample
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			own := map[string]string{}
			for _, lp := range m.GetLabel() {
				own[lp.GetName()] = lp.GetValue()
			}
			add := func(name string, v float64, extra ...string) {
				b := labels.NewBuilder(labels.EmptyLabels())
				for k, v := range target {
					b.Set(k, v)
				}
				for k, v := range own {
					b.Set(k, v)
				}
				for i := 0; i+1 < len(extra); i += 2 {
					b.Set(extra[i], extra[i+1])
				}
				b.Set(labels.MetricName, name)
				out = append(out, sample{b.Labels(), v})
			}
			switch mf.GetType() {
			case dto.MetricType_COUNTER:
				add(mf.GetName(), m.GetCounter().GetValue())
			case dto.MetricType_GAUGE:
				add(mf.GetName(), m.GetGauge().GetValue())
			case dto.MetricType_UNTYPED:
				add(mf.GetName(), m.GetUntyped().GetValue())
			case dto.MetricType_HISTOGRAM:
				h := m.GetHistogram()
				for _, b := range h.GetBucket() {
					add(mf.GetName()+"_bucket", float64(b.GetCumulativeCount()), "le", formatLe(b.GetUpperBound()))
				}
				add(mf.GetName()+"_bucket", float64(h.GetSampleCount()), "le", "+Inf")
				add(mf.GetName()+"_sum", h.GetSampleSum())
				add(mf.GetName()+"_count", float64(h.GetSampleCount()))
			case dto.MetricType_SUMMARY:
				s := m.GetSummary()
				add(mf.GetName()+"_sum", s.GetSampleSum())
				add(mf.GetName()+"_count", float64(s.GetSampleCount()))
			}
		}
	}
	return out
}

func formatLe(f float64) string {
	if math.IsInf(f, 1) {
		return "+Inf"
	}
	return strconv.FormatFloat(f, 'g', -1, 64)
}

// timeline is what one Prometheus scraped, target by target: every
// scrape's samples at its time.
type timeline struct {
	scrapes []scrapeAt
}

type scrapeAt struct {
	at      time.Duration // since base
	target  string        // the target's job/instance, for staleness
	samples []sample
}

func (tl *timeline) add(at time.Duration, target string, s []sample) {
	tl.scrapes = append(tl.scrapes, scrapeAt{at: at, target: target, samples: s})
}

// load appends the timeline to st as scrapes would: a series a target
// stops exposing gets a staleness marker at the next scrape.
func (tl *timeline) load(t testing.TB, st *teststorage.TestStorage) {
	t.Helper()
	prev := map[string]map[string]labels.Labels{} // target -> series
	app := st.Appender(context.Background())
	for _, sc := range tl.scrapes {
		ts := base.Add(sc.at).UnixMilli()
		now := map[string]labels.Labels{}
		for _, s := range sc.samples {
			now[s.lset.String()] = s.lset
			_, err := app.Append(0, s.lset, ts, s.v)
			require.NoError(t, err, "append %s", s.lset)
		}
		for k, l := range prev[sc.target] {
			if _, ok := now[k]; !ok {
				_, err := app.Append(0, l, ts, math.Float64frombits(value.StaleNaN))
				require.NoError(t, err)
			}
		}
		prev[sc.target] = now
	}
	require.NoError(t, app.Commit())
}

// evaluation is the outcome of evaluating the rule file over a timeline.
type evaluation struct {
	// fired: every alert that was firing at some evaluation, keyed by
	// alertKey.
	fired map[string]bool
	// at returns an instant query's result at a time of the timeline.
	query func(expr string, at time.Duration) promql.Vector
}

// evaluate runs Prometheus's rule manager over the timeline, evaluating
// every group in file order every scrape interval from the first scrape
// to end, as a Prometheus running all along would.
func evaluate(t testing.TB, tl *timeline, end time.Duration) evaluation {
	t.Helper()
	st := teststorage.New(t)
	tl.load(t, st)
	ng := promql.NewEngine(promql.EngineOpts{
		MaxSamples: 50_000_000, Timeout: time.Minute, LookbackDelta: 5 * time.Minute,
		NoStepSubqueryIntervalFn: func(int64) int64 { return scrapeInterval.Milliseconds() },
		Parser:                   parser.NewParser(parser.Options{}),
	})
	t.Cleanup(func() { _ = ng.Close() })
	m := rules.NewManager(&rules.ManagerOptions{
		QueryFunc:    rules.EngineQueryFunc(ng, st),
		AppendableV2: st,
		Context:      context.Background(),
		NotifyFunc:   func(context.Context, string, ...*rules.Alert) {},
		Logger:       promslog.NewNopLogger(),
	})
	groupsByName, errs := m.LoadGroups(scrapeInterval, labels.EmptyLabels(), "", nil, false, rulesFile)
	require.Empty(t, errs)
	order := groupOrder(t)
	groups := make([]*rules.Group, 0, len(groupsByName))
	for _, g := range groupsByName {
		groups = append(groups, g)
	}
	sort.Slice(groups, func(i, j int) bool { return order[groups[i].Name()] < order[groups[j].Name()] })

	ev := evaluation{fired: map[string]bool{}}
	ctx := context.Background()
	for at := time.Duration(0); at <= end; at += scrapeInterval {
		ts := base.Add(at)
		for _, g := range groups {
			g.Eval(ctx, ts)
			for _, r := range g.Rules() {
				require.NoError(t, r.LastError(), "rule %s at %s", r.Name(), at)
			}
		}
		for _, g := range groups {
			for _, ar := range g.AlertingRules() {
				for _, a := range ar.ActiveAlerts() {
					if a.State == rules.StateFiring {
						ev.fired[alertKey(a.Labels)] = true
					}
				}
			}
		}
	}
	ev.query = func(expr string, at time.Duration) promql.Vector {
		q, err := ng.NewInstantQuery(ctx, st, nil, expr, base.Add(at))
		require.NoError(t, err, expr)
		defer q.Close()
		res := q.Exec(ctx)
		require.NoError(t, res.Err, expr)
		v, err := res.Vector()
		require.NoError(t, err, expr)
		return v
	}
	return ev
}

// alertKey names a firing alert by its name and labels, less its
// severity and the GPU's UUID (the device and node name it).
func alertKey(l labels.Labels) string {
	var parts []string
	name := ""
	l.Range(func(lb labels.Label) {
		switch lb.Name {
		case labels.AlertName:
			name = lb.Value
		case "severity", "gpu":
		default:
			parts = append(parts, fmt.Sprintf("%s=%q", lb.Name, lb.Value))
		}
	})
	return name + "{" + strings.Join(parts, ",") + "}"
}

// groupOrder is each group's position in the rule file.
func groupOrder(t testing.TB) map[string]int {
	t.Helper()
	rgs := parseRules(t)
	order := map[string]int{}
	for i, g := range rgs.Groups {
		order[g.Name] = i
	}
	return order
}

// reader is the simulator's telemetry with what the simulator cannot make
// happen: a failed read, and per-GPU edits of a sample (a thermal throttle
// reason), applied to what the simulator read. Load, processes, GPM and
// ECC errors are the simulator's own (StartProcess, InjectECC); a read
// that hangs is the simulator's telemetry hook.
type reader struct {
	m *sim.Machine
	// hung has a value each time a read starts to hang; release ends
	// every hang (at the test's end).
	hung, release chan struct{}

	mu      sync.Mutex
	fail    bool
	hanging bool
	edits   map[string]func(*nvdevice.TelemetrySample) // by GPU UUID
}

func newReader(t *testing.T, m *sim.Machine) *reader {
	r := &reader{m: m, hung: make(chan struct{}, 1), release: make(chan struct{})}
	t.Cleanup(func() { close(r.release) })
	m.SetTelemetryHook(func(string) {
		r.mu.Lock()
		hanging := r.hanging
		r.mu.Unlock()
		if hanging {
			r.hung <- struct{}{}
			<-r.release
		}
	})
	return r
}

func (r *reader) Telemetry(ctx context.Context) ([]nvdevice.TelemetrySample, error) {
	r.mu.Lock()
	fail := r.fail
	r.mu.Unlock()
	if fail {
		return nil, errors.New("NVML: driver not loaded (test)")
	}
	s, err := r.m.Telemetry(ctx)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for i := range s {
		if e := r.edits[s[i].UUID]; e != nil {
			e(&s[i])
		}
	}
	return s, nil
}

func (r *reader) set(fail bool, uuid string, edit func(*nvdevice.TelemetrySample)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.fail = fail
	if uuid != "" {
		if r.edits == nil {
			r.edits = map[string]func(*nvdevice.TelemetrySample){}
		}
		r.edits[uuid] = edit
	}
}

// hang makes the next read hang in the driver, on the first GPU it reads.
func (r *reader) hang() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.hanging = true
}

// sumOf is the sum of a metric's series in g.
func sumOf(t testing.TB, g prometheus.Gatherer, name string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	total := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			total += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return total
}

func readFile(t testing.TB, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	return b
}
