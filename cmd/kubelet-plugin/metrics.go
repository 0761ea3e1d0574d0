package main

import (
	"context"
	"crypto/tls"
	"net/http"

	"github.com/gpudra/gpudra/pkg/kubeclient"
	"github.com/gpudra/gpudra/pkg/metrics"
)

// healthPath is the probes' path: open to anyone (the kubelet probes
// without credentials), while the rest of the metrics server is not.
const healthPath = "/healthz"

// metricsServer is the server of /metrics and /healthz on
// --metrics-address: /metrics names the claims, pods and containers on the
// node's GPUs, so only those RBAC allows read it (--metrics-auth), over
// HTTPS (--metrics-tls), as the chart's ServiceMonitor scrapes it. What it
// needs (an API client, a certificate) is made before it serves, so that a
// failure is the plugin's start's.
func metricsServer(f *options, h http.Handler) (func(ctx context.Context) error, error) {
	if f.metricsAuth {
		cfg, err := kubeclient.RESTConfig(f.kubeconfig)
		if err != nil {
			return nil, err
		}
		auth, err := metrics.NewKubernetesAuth(cfg)
		if err != nil {
			return nil, err
		}
		h = auth.Protect(h, healthPath)
	}
	var tlsConfig *tls.Config
	if f.metricsTLS {
		var err error
		if tlsConfig, err = metrics.SelfSignedTLS(f.nodeName); err != nil {
			return nil, err
		}
	}
	return func(ctx context.Context) error { return metrics.ServeTLS(ctx, f.metricsAddr, h, tlsConfig) }, nil
}
