package promrules

import (
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// scrapesDirEnv names the directory where devcluster's e2e suite keeps what
// its nodes really exported (devcluster/e2e, keepScrapes): make test-e2e sets
// it, then runs TestXIDAlertOverDevclusterScrapes over those files.
const scrapesDirEnv = "GPUDRA_SCRAPES_DIR"

// gatheredText is a kept scrape in Prometheus' text format, as a Gatherer.
type gatheredText []*dto.MetricFamily

func (g gatheredText) Gather() ([]*dto.MetricFamily, error) { return g, nil }

var _ prometheus.Gatherer = gatheredText(nil)

// keptScrape reads one kept scrape, <test>-<when>-<node>.prom: its node
// and its families.
func keptScrape(t *testing.T, path, when string) (string, gatheredText) {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(f)
	require.NoError(t, err, path)
	var out gatheredText
	for _, name := range sortedNames(mfs) {
		out = append(out, mfs[name])
	}
	_, node, ok := strings.Cut(strings.TrimSuffix(filepath.Base(path), ".prom"), "-"+when+"-")
	require.True(t, ok, "%s: want <test>-%s-<node>.prom", path, when)
	return node, out
}

func sortedNames(m map[string]*dto.MetricFamily) []string {
	var names []string
	for n := range m {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// TestXIDAlertOverDevclusterScrapes evaluates the shipped rules over what a
// devcluster node really exported in the e2e suite (TestTelemetryPerPod):
// its scrape before an XID was injected on the GPU a running pod holds, for
// 15 minutes, then its scrape after, for 10. GpudraXIDOnGPUInUse must fire
// for that GPU's device; over the "before" scrape alone, nothing fires. It
// runs where GPUDRA_SCRAPES_DIR is set (make test-e2e sets it), and then the
// scrapes must be there.
func TestXIDAlertOverDevclusterScrapes(t *testing.T) {
	dir := os.Getenv(scrapesDirEnv)
	if dir == "" {
		t.Skip(scrapesDirEnv + " is not set: make test-e2e runs this over the e2e suite's scrapes")
	}
	before, err := filepath.Glob(filepath.Join(dir, "TestTelemetryPerPod-before-xid-*.prom"))
	require.NoError(t, err)
	require.Len(t, before, 1, "the e2e suite's scrape before the XID in %s", dir)
	node, beforeScrape := keptScrape(t, before[0], "before-xid")
	afterNode, afterScrape := keptScrape(t, strings.Replace(before[0], "-before-xid-", "-after-xid-", 1), "after-xid")
	require.Equal(t, node, afterNode)

	// The device the XID was injected on: its counter grew between the two.
	xidDevice := ""
	count := func(g gatheredText) map[string]float64 {
		m := map[string]float64{}
		for _, mf := range g {
			if mf.GetName() != "gpudra_gpu_xid_errors_total" {
				continue
			}
			for _, s := range mf.GetMetric() {
				l := map[string]string{}
				for _, lp := range s.GetLabel() {
					l[lp.GetName()] = lp.GetValue()
				}
				m[l["dra_device_name"]+"/"+l["xid"]] += s.GetCounter().GetValue()
			}
		}
		return m
	}
	b, a := count(beforeScrape), count(afterScrape)
	xid := ""
	for k, v := range a {
		if v > b[k] {
			require.Empty(t, xidDevice, "one XID injected")
			xidDevice, xid, _ = strings.Cut(k, "/")
		}
	}
	require.NotEmpty(t, xidDevice, "the after scrape counts an XID the before scrape does not")

	target := targetLabels(node, "gpudra-kubelet-plugin")
	timeline := func(after gatheredText) *timeline {
		tl := &timeline{}
		for at := time.Duration(0); at < 15*time.Minute; at += scrapeInterval {
			tl.add(at, node, scrape(t, beforeScrape, target))
		}
		for at := 15 * time.Minute; at <= 25*time.Minute; at += scrapeInterval {
			tl.add(at, node, scrape(t, after, target))
		}
		return tl
	}
	fired := evaluate(t, timeline(afterScrape), 25*time.Minute).fired
	want := `GpudraXIDOnGPUInUse{dra_device_name="` + xidDevice + `",node="` + node + `",xid="` + xid + `"}`
	assert.True(t, fired[want], "want %s; fired: %v", want, keysOf(fired))

	quiet := evaluate(t, timeline(beforeScrape), 25*time.Minute).fired
	for k := range quiet {
		assert.False(t, strings.HasPrefix(k, "GpudraXID"), "no XID, no XID alert: %s fired", k)
	}
}

func keysOf(m map[string]bool) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
