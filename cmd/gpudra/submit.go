package main

import (
	"context"
	"slices"
	"strings"

	"k8s.io/client-go/rest"

	"github.com/gpudra/gpudra/pkg/dashboard"
	"github.com/gpudra/gpudra/pkg/kubeclient"
	"github.com/gpudra/gpudra/pkg/metrics"
	submitcli "github.com/gpudra/gpudra/pkg/submit/cli"
)

// pluginUsage reads devices' utilization for gpudra jobs as the dashboard
// does: each node's plugin /metrics through the API server's pods proxy,
// with the user's own token reviewed by the plugin.
func pluginUsage(rc *rest.Config) submitcli.UsageFunc {
	return func(ctx context.Context, pluginNamespace string, devices []string) (map[string]float64, []string) {
		client, err := kubeclient.NewForConfig(metrics.WithProxiedBearerToken(rest.CopyConfig(rc)))
		if err != nil {
			return nil, []string{"usage: " + err.Error()}
		}
		var nodes []string
		for _, d := range devices {
			if node, _, ok := strings.Cut(d, "/"); ok && !slices.Contains(nodes, node) {
				nodes = append(nodes, node)
			}
		}
		snaps, notes := (&dashboard.PluginProxyUsage{Client: client, Namespace: pluginNamespace}).Read(ctx, nodes)
		out := map[string]float64{}
		for node, snap := range snaps {
			for _, d := range snap.Devices {
				if d.Utilization != nil {
					out[node+"/"+d.Name] = *d.Utilization
				}
			}
		}
		return out, notes
	}
}
