package realnode

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/devcluster/realnode"
)

// pluginMetricsPort is the chart's kubeletPlugin.metrics.port.
const pluginMetricsPort = "9477"

// series is one sample of a scrape: its labels and value.
type series struct {
	labels map[string]string
	value  float64
}

// scrapePlugin reads the real node's plugin pod's /metrics at its pod IP,
// from the pod network (containerd's namespace), as Prometheus would.
func scrapePlugin(t *testing.T, c *devcluster.Cluster, n *realnode.Node) (map[string][]series, error) {
	t.Helper()
	ctx := context.Background()
	pod, err := c.Client.CoreV1().Pods(chart.PluginNamespace).Get(ctx, nodeagent.MetricsPodName(n.Name), metav1.GetOptions{})
	require.NoError(t, err)
	require.NotEmpty(t, pod.Status.PodIP, "the plugin pod has an address on the pod network")
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "https://"+net.JoinHostPort(pod.Status.PodIP, pluginMetricsPort)+"/metrics", nil)
	require.NoError(t, err)
	// The plugin serves HTTPS with its own certificate, and /metrics to a
	// token RBAC lets get it: the harness's (system:masters).
	req.Header.Set("Authorization", "Bearer "+c.RESTConfig.BearerToken)
	client := n.PodNetworkClient()
	client.Transport.(*http.Transport).TLSClientConfig = &tls.Config{InsecureSkipVerify: true} //nolint:gosec // the plugin's own certificate
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET /metrics: %s: %s", resp.Status, body)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(strings.NewReader(string(body)))
	if err != nil {
		return nil, err
	}
	out := map[string][]series{}
	for name, f := range families {
		for _, m := range f.GetMetric() {
			l := map[string]string{}
			for _, p := range m.GetLabel() {
				l[p.GetName()] = p.GetValue()
			}
			v := m.GetGauge().GetValue()
			if m.GetCounter() != nil {
				v = m.GetCounter().GetValue()
			}
			out[name] = append(out[name], series{labels: l, value: v})
		}
	}
	return out, nil
}
