package e2e

import (
	"bytes"
	"context"
	"net"
	"os"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/devcluster/podnetwork"
	"github.com/gpudra/gpudra/pkg/top"
)

// TestPluginMetricsThroughTheAPIServerProxy: every node's plugin telemetry
// is reachable as a real plugin pod's is, through kube-apiserver's pods
// proxy to the pod's metrics port (how gpudra dashboard reads usage), and
// it is that node's: the GPUs of its slices.
func TestPluginMetricsThroughTheAPIServerProxy(t *testing.T) {
	ctx := context.Background()
	for _, node := range []string{"dgx-h100-0", nomigNode} {
		pod, err := cluster.Client.CoreV1().Pods(chart.PluginNamespace).Get(ctx, nodeagent.MetricsPodName(node), metav1.GetOptions{})
		require.NoError(t, err)
		require.NotEmpty(t, pod.Status.PodIP, "%s: the metrics pod has an IP", node)
		// On devcluster's pod network (root), not on an interface of the
		// machine, where every host of its network could read it; the
		// API server reaches it through its egress selector.
		// make test (GPUDRA_REQUIRE_REAL_NODE=1) requires it.
		if os.Getenv("GPUDRA_REQUIRE_REAL_NODE") == "1" {
			require.Equal(t, podnetwork.Address, cluster.PodNetworkAddress(), "make test runs devcluster with its pod network (root, nsenter, ip)")
		}
		if cluster.PodNetworkAddress() != "" {
			assert.Equal(t, podnetwork.Address, pod.Status.PodIP, "%s", node)
			addrs, err := net.InterfaceAddrs()
			require.NoError(t, err)
			for _, a := range addrs {
				ip, _, _ := net.ParseCIDR(a.String())
				assert.NotEqual(t, pod.Status.PodIP, ip.String(), "%s: the metrics pod's address is the machine's %s", node, a)
			}
		}
		port := pod.Spec.Containers[0].Ports[0]
		require.Equal(t, nodeagent.MetricsPort, port.Name)
		body, err := cluster.Client.CoreV1().Pods(chart.PluginNamespace).ProxyGet("http", pod.Name, strconv.Itoa(int(port.ContainerPort)), "/metrics", nil).DoRaw(ctx)
		require.NoError(t, err, "%s: /metrics through the API server's proxy", node)
		fams, err := top.ParseMetrics(bytes.NewReader(body))
		require.NoError(t, err)
		snap := top.FromMetrics(fams, "proxy", pod.CreationTimestamp.Time)
		assert.Equal(t, node, snap.Node)
		gpus := 0
		for _, d := range snap.Devices {
			if d.Profile == "" {
				gpus++
			}
		}
		assert.Equal(t, 8, gpus, "%s: its 8 GPUs", node)
	}
}
