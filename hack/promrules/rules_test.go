package promrules

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/common/model"
	"github.com/prometheus/common/promslog"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"
)

// parseRules parses the rule file as `promtool check rules` does:
// rulefmt's strict parse (unknown fields refused) and validation, which
// parses every expression and template.
func parseRules(t testing.TB) *rulefmt.RuleGroups {
	t.Helper()
	rgs, errs := rulefmt.ParseFile(rulesFile, false, model.UTF8Validation, parser.NewParser(parser.Options{}), promslog.NewNopLogger())
	require.Empty(t, errs, "promtool check rules would refuse %s", rulesFile)
	return rgs
}

func TestRulesCheck(t *testing.T) {
	rgs := parseRules(t)
	p := parser.NewParser(parser.Options{})
	var alerts, records []string
	for _, g := range rgs.Groups {
		for _, r := range g.Rules {
			_, err := p.ParseExpr(r.Expr)
			require.NoError(t, err, "rule %s%s", r.Alert, r.Record)
			if r.Record != "" {
				records = append(records, r.Record)
				assert.Regexp(t, `^[a-z_]+:gpudra_[a-z_]+:[a-z_]+$`, r.Record, "recording rules are named level:metric:operation")
				continue
			}
			alerts = append(alerts, r.Alert)
			assert.Regexp(t, `^Gpudra[A-Za-z]+$`, r.Alert)
			assert.Contains(t, []string{"info", "warning", "critical"}, r.Labels["severity"], "alert %s: severity", r.Alert)
			assert.NotEmpty(t, r.Annotations["summary"], "alert %s: summary", r.Alert)
			assert.NotEmpty(t, r.Annotations["description"], "alert %s: description", r.Alert)
		}
	}
	assert.Len(t, alerts, len(slices.Compact(slices.Sorted(slices.Values(alerts)))), "alert names are unique")
	assert.Len(t, records, len(slices.Compact(slices.Sorted(slices.Values(records)))), "recording rule names are unique")

	// docs/metrics.md says what each one means and what to do.
	doc := string(readFile(t, metricsDoc))
	for _, name := range append(alerts, records...) {
		assert.Contains(t, doc, "`"+name+"`", "docs/metrics.md documents %s", name)
	}
}

// helm renders the chart with values; it needs HELM (make test-rules sets
// it) or bin/helm.
func helm(t *testing.T, args ...string) []map[string]any {
	t.Helper()
	bin := os.Getenv("HELM")
	if bin == "" {
		bin = filepath.Join("..", "..", "bin", "helm")
	}
	if _, err := os.Stat(bin); err != nil {
		t.Skipf("no helm (set HELM, or make helm): %v", err)
	}
	cmd := exec.Command(bin, append([]string{"template", "gpudra", chartDir, "--namespace", "gpudra", "--kube-version", "1.37.1"}, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(t, err, "helm template: %s", stderr.String())
	var docs []map[string]any
	for _, d := range regexp.MustCompile(`(?m)^---\s*$`).Split(string(out), -1) {
		var obj map[string]any
		require.NoError(t, yaml.Unmarshal([]byte(d), &obj))
		if obj != nil {
			docs = append(docs, obj)
		}
	}
	return docs
}

func find(docs []map[string]any, kind string) []map[string]any {
	var out []map[string]any
	for _, d := range docs {
		if d["kind"] == kind {
			out = append(out, d)
		}
	}
	return out
}

func TestChartRendersTheFiles(t *testing.T) {
	var fileGroups map[string]any
	require.NoError(t, yaml.Unmarshal(readFile(t, rulesFile), &fileGroups))
	dashboard := strings.TrimRight(string(readFile(t, dashboardFile)), "\n")

	t.Run("off by default", func(t *testing.T) {
		docs := helm(t)
		assert.Empty(t, find(docs, "PrometheusRule"))
		for _, cm := range find(docs, "ConfigMap") {
			assert.NotContains(t, cm["data"], "gpudra-gpus.json")
		}
	})
	t.Run("on", func(t *testing.T) {
		docs := helm(t, "--set", "metrics.prometheusRule.enabled=true", "--set", "metrics.prometheusRule.labels.release=kps",
			"--set", "metrics.grafanaDashboard.enabled=true", "--set", "metrics.serviceMonitor.enabled=true")
		prs := find(docs, "PrometheusRule")
		require.Len(t, prs, 1)
		assert.Equal(t, "monitoring.coreos.com/v1", prs[0]["apiVersion"])
		assert.Equal(t, "kps", prs[0]["metadata"].(map[string]any)["labels"].(map[string]any)["release"])
		assert.Equal(t, fileGroups, prs[0]["spec"], "the PrometheusRule's spec is the rule file's groups")

		var dash []map[string]any
		for _, cm := range find(docs, "ConfigMap") {
			if _, ok := cm["data"].(map[string]any)["gpudra-gpus.json"]; ok {
				dash = append(dash, cm)
			}
		}
		require.Len(t, dash, 1)
		meta := dash[0]["metadata"].(map[string]any)
		assert.Equal(t, "gpudra", meta["namespace"])
		assert.Equal(t, "1", meta["labels"].(map[string]any)["grafana_dashboard"], "kube-prometheus-stack's sidecar label")
		assert.Equal(t, dashboard, dash[0]["data"].(map[string]any)["gpudra-gpus.json"])
		assert.True(t, json.Valid([]byte(dashboard)))

		sms := find(docs, "ServiceMonitor")
		require.NotEmpty(t, sms)
		for _, sm := range sms {
			if sm["metadata"].(map[string]any)["name"] != "gpudra-kubelet-plugin" {
				continue
			}
			ep := sm["spec"].(map[string]any)["endpoints"].([]any)[0].(map[string]any)
			assert.Equal(t, true, ep["honorLabels"], "the per-pod series keep their namespace, pod and container")
		}
	})
	t.Run("dashboard label and namespace", func(t *testing.T) {
		docs := helm(t, "--set", "metrics.grafanaDashboard.enabled=true", "--set", "metrics.grafanaDashboard.namespace=monitoring",
			"--set", "metrics.grafanaDashboard.label=dash", "--set", "metrics.grafanaDashboard.labelValue=yes")
		var found bool
		for _, cm := range find(docs, "ConfigMap") {
			meta := cm["metadata"].(map[string]any)
			if meta["namespace"] == "monitoring" {
				found = true
				assert.Equal(t, "yes", meta["labels"].(map[string]any)["dash"])
			}
		}
		assert.True(t, found, "the dashboard ConfigMap in the namespace given")
	})
}
