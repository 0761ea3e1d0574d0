package promrules

import (
	"context"
	"encoding/json"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/runtime"
	dynfake "k8s.io/client-go/dynamic/fake"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/gpudra/gpudra/pkg/controller/gang"
	"github.com/gpudra/gpudra/pkg/controller/grove"
	"github.com/gpudra/gpudra/pkg/deviceplugin"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/plugin"
	"github.com/gpudra/gpudra/pkg/telemetry"
	"github.com/gpudra/gpudra/pkg/webhook"
)

var (
	fqName         = regexp.MustCompile(`fqName: "([^"]+)"`)
	variableLabels = regexp.MustCompile(`variableLabels: \{([^}]*)\}`)
)

// controllerRegistry is the controller's registry: the gang and Grove
// controllers' and the webhook's metrics.
func controllerRegistry(t *testing.T) *prometheus.Registry {
	t.Helper()
	ctl := prometheus.NewRegistry()
	_, err := gang.New(gang.Options{Client: fake.NewClientset(), Dynamic: dynfake.NewSimpleDynamicClient(runtime.NewScheme()), Registerer: ctl})
	require.NoError(t, err)
	_, err = grove.New(grove.Options{Client: fake.NewClientset(), Registerer: ctl})
	require.NoError(t, err)
	webhook.NewHandler(ctl)
	return ctl
}

// describe is the label names of every metric c describes, by name.
func describe(t *testing.T, c prometheus.Collector) map[string][]string {
	t.Helper()
	ch := make(chan *prometheus.Desc, 1000)
	c.Describe(ch)
	close(ch)
	out := map[string][]string{}
	for d := range ch {
		sm := fqName.FindStringSubmatch(d.String())
		require.NotNil(t, sm, d.String())
		vl := variableLabels.FindStringSubmatch(d.String())
		require.NotNil(t, vl, d.String())
		out[sm[1]] = nil
		if vl[1] != "" {
			out[sm[1]] = strings.Split(vl[1], ",")
		}
	}
	return out
}

// controllerLabels is the label names of the controller's metrics, by
// name.
func controllerLabels(t *testing.T) map[string][]string {
	return describe(t, controllerRegistry(t))
}

// exported are the names of every metric the real collectors describe:
// the kubelet plugin's in both modes (its registry, the device telemetry
// and the health metrics) and the controller's (the gang and Grove
// controllers, the webhook).
func exported(t *testing.T) map[string]bool {
	t.Helper()
	m, err := sim.NewBuiltin("dgx-h100", "n1")
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Close() })
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)

	names := map[string]bool{}
	for _, c := range []prometheus.Collector{
		plugin.NewMetrics().Registry, deviceplugin.NewMetrics().Registry,
		telemetry.NewCollector(m, "n1", 0), telemetry.NewHealthMetrics("n1", inv.GPUs), controllerRegistry(t),
	} {
		for n := range describe(t, c) {
			names[n] = true
		}
	}
	// A histogram is stored as its series.
	for n := range names {
		for _, suffix := range []string{"_bucket", "_sum", "_count"} {
			names[n+suffix] = true
		}
	}
	return names
}

// selected are the metric names an expression selects.
func selected(t *testing.T, expr string) []string {
	t.Helper()
	e, err := parser.NewParser(parser.Options{}).ParseExpr(expr)
	require.NoError(t, err, expr)
	var out []string
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		if vs, ok := n.(*parser.VectorSelector); ok {
			name := vs.Name
			for _, m := range vs.LabelMatchers {
				if m.Name == labels.MetricName && m.Type == labels.MatchEqual {
					name = m.Value
				}
			}
			require.NotEmpty(t, name, "%s: select by metric name", expr)
			out = append(out, name)
		}
		return nil
	})
	return out
}

// dashboardQueries are the PromQL of every panel target and every query
// variable (label_values(metric, label) selects metric).
func dashboardQueries(t *testing.T) []string {
	t.Helper()
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
		Templating struct {
			List []struct {
				Type       string `json:"type"`
				Definition string `json:"definition"`
			} `json:"list"`
		} `json:"templating"`
	}
	require.NoError(t, json.Unmarshal(readFile(t, dashboardFile), &dash))
	var out []string
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			require.NotEmpty(t, tg.Expr, "panel %q", p.Title)
			out = append(out, tg.Expr)
		}
	}
	lv := regexp.MustCompile(`^label_values\(([a-zA-Z_:][a-zA-Z0-9_:]*), *[a-z_]+\)$`)
	for _, v := range dash.Templating.List {
		if v.Type != "query" {
			continue
		}
		sm := lv.FindStringSubmatch(v.Definition)
		require.NotNil(t, sm, "variable query %q", v.Definition)
		out = append(out, sm[1])
	}
	return out
}

func TestEveryMetricIsExported(t *testing.T) {
	names := exported(t)
	rgs := parseRules(t)
	for _, g := range rgs.Groups {
		for _, r := range g.Rules {
			if r.Record != "" {
				names[r.Record] = true // the dashboard and later rules may use it
			}
		}
	}
	names["ALERTS"] = true // Prometheus's own

	var exprs []string
	for _, g := range rgs.Groups {
		for _, r := range g.Rules {
			exprs = append(exprs, r.Expr)
		}
	}
	dq := dashboardQueries(t)
	require.GreaterOrEqual(t, len(dq), 20, "the dashboard's queries were read")
	for _, e := range append(exprs, dq...) {
		for _, n := range selected(t, e) {
			assert.True(t, names[n], "%s is not exported by any gpudra collector (in %q)", n, e)
		}
	}
	// The check can fail: a name no collector has is found.
	assert.False(t, names["gpudra_gpu_no_such_metric"])
	assert.True(t, slices.Contains(selected(t, `rate(gpudra_gpu_no_such_metric[5m])`), "gpudra_gpu_no_such_metric"))
}
