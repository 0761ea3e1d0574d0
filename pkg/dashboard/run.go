package dashboard

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/kubeclient"
	"github.com/gpudra/gpudra/pkg/metrics"
)

// ServeConfig is where and how the page is served.
type ServeConfig struct {
	// Address is host:port to listen on (127.0.0.1:8477; port 0 picks one).
	Address string
	Title   string
	// Listening, when set, is told the page's URL, with its token (the
	// only place it is told), once the server listens.
	Listening func(url string)
}

// ClusterRunConfig is gpudra dashboard's: a ClusterSource on the user's
// own credentials, served.
type ClusterRunConfig struct {
	ServeConfig
	// RESTConfig is the user's (their kubeconfig): the page shows what
	// their RBAC lets them read, nothing more.
	RESTConfig *rest.Config
	// Context names the kubeconfig context, for the page's header.
	Context string
	// Namespace limits pods, claims and reservations ("": all);
	// FallbackNamespace is read where all is forbidden.
	Namespace, FallbackNamespace string
	// Prometheus, when set, is where usage and the allocation over time
	// are read; else the plugin pods are read through the API server's
	// pods proxy: PluginNamespace's, or ("") those found by the chart's
	// labels in any namespace; NoUsage: none.
	Prometheus      string
	PluginNamespace string
	NoUsage         bool
	UsageInterval   time.Duration
}

// RunCluster serves the dashboard of the cluster until ctx ends.
func RunCluster(ctx context.Context, cfg ClusterRunConfig) error {
	rc := rest.CopyConfig(cfg.RESTConfig)
	rc.UserAgent = "gpudra-dashboard"
	client, err := kubeclient.NewForConfig(rc)
	if err != nil {
		return fmt.Errorf("API client: %w", err)
	}
	dyn, err := dynamic.NewForConfig(rc)
	if err != nil {
		return fmt.Errorf("API client for gpudra's resources: %w", err)
	}
	sc := ClusterConfig{Client: client, Dynamic: dyn, Namespace: cfg.Namespace, FallbackNamespace: cfg.FallbackNamespace,
		Context: cfg.Context, UsageInterval: cfg.UsageInterval}
	switch {
	case cfg.Prometheus != "":
		prom := &PrometheusUsage{URL: cfg.Prometheus, HTTPClient: &http.Client{Timeout: 10 * time.Second}}
		sc.Usage, sc.Allocation = prom, prom
	case !cfg.NoUsage:
		// The plugins review the user's own token (their /metrics names
		// who runs what), which the API server's proxy does not forward.
		proxyClient, err := kubeclient.NewForConfig(metrics.WithProxiedBearerToken(rc))
		if err != nil {
			return fmt.Errorf("API client for the plugins' metrics: %w", err)
		}
		sc.Usage = &PluginProxyUsage{Client: proxyClient, Namespace: cfg.PluginNamespace}
	}
	src := NewClusterSource(sc)
	return serve(ctx, cfg.ServeConfig, src, src.Run)
}

// LocalRunConfig is gpudra local dashboard's.
type LocalRunConfig struct {
	ServeConfig
	LocalConfig
}

// RunLocal serves the dashboard of this machine until ctx ends.
func RunLocal(ctx context.Context, cfg LocalRunConfig) error {
	src := NewLocalSource(cfg.LocalConfig)
	return serve(ctx, cfg.ServeConfig, src, src.Run)
}

// serve listens, runs the source and serves its page until ctx ends or
// either fails.
func serve(ctx context.Context, cfg ServeConfig, src Source, run func(context.Context) error) error {
	logger := klog.FromContext(ctx)
	ln, err := net.Listen("tcp", cfg.Address)
	if err != nil {
		return fmt.Errorf("--address %s: %w", cfg.Address, err)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	handler := NewServer(src, ServerOptions{Addr: ln.Addr().String(), Title: cfg.Title})
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second,
		BaseContext: func(net.Listener) context.Context { return ctx }}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	ran := make(chan error, 1)
	go func() { ran <- run(ctx) }()
	base := "http://" + ln.Addr().String() + "/"
	// The log has the address, not the token: logs travel further than the
	// terminal.
	logger.V(2).Info("Serving the dashboard", "url", base)
	if cfg.Listening != nil {
		cfg.Listening(base + "?" + TokenParam + "=" + handler.Token())
	}
	var runErr error
	select {
	case <-ctx.Done():
	case err := <-served:
		runErr = fmt.Errorf("serving: %w", err)
	case err := <-ran:
		if err != nil && !errors.Is(err, context.Canceled) {
			runErr = err
		}
	}
	cancel()
	shutdownCtx, done := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer done()
	// Event streams never end by themselves: Close, after a grace.
	if err := srv.Shutdown(shutdownCtx); err != nil {
		_ = srv.Close()
	}
	return runErr
}
