package main

import (
	"fmt"
	"net/url"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/gpudra/gpudra/pkg/dashboard"
	"github.com/gpudra/gpudra/pkg/local"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/top"
)

// DefaultDashboardAddress is where gpudra dashboard listens: this machine
// only, as kubectl proxy does; --address binds elsewhere.
const DefaultDashboardAddress = "127.0.0.1:8477"

func newDashboardCommand() *cobra.Command {
	var kubeconfig, kubeContext, namespace, address, prometheus, pluginNamespace string
	var allNamespaces bool
	var usageInterval time.Duration
	cmd := &cobra.Command{
		Use:   "dashboard",
		Short: "Serve a read-only web page of the cluster's GPUs: who holds which, live usage, queues, allocation over time",
		Long: `dashboard serves a read-only web page of the cluster's GPUs (docs/dashboard.md): nodes by NVLink
domain, each GPU with its MIG layout and its holders (claim, pods, namespace), live usage, the queues
with positions and reasons, and the devices allocated per namespace over time.

It reads the cluster with your own kubeconfig: the page shows what your RBAC lets you read, and says
what it may not read. Informers on this process feed it, so that any number of open pages cost the
API server one watch per resource. Usage comes from the plugins' own /metrics through the API
server's pods proxy (the plugin pods found by the chart's labels in any namespace, or in
--plugin-namespace; needs pods/proxy there), or from --prometheus. Nothing is
written to the cluster; the page takes only GET requests, and listens on 127.0.0.1 unless --address
says otherwise.

The page reads with your credentials, so it is yours alone: the URL printed on standard error
carries a random token (http://127.0.0.1:8477/?token=...), new each start, that the page keeps in
a cookie; requests without it get 401 (scripts: "Authorization: Bearer <token>").`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			rules := clientcmd.NewDefaultClientConfigLoadingRules()
			rules.ExplicitPath = kubeconfig
			cc := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{CurrentContext: kubeContext})
			rc, err := cc.ClientConfig()
			if err != nil {
				return fmt.Errorf("kubeconfig: %w", err)
			}
			ctxNS, _, err := cc.Namespace()
			if err != nil {
				return fmt.Errorf("kubeconfig: %w", err)
			}
			contextName := kubeContext
			if raw, err := cc.RawConfig(); err == nil && contextName == "" {
				contextName = raw.CurrentContext
			}
			ns := namespace
			if allNamespaces {
				ns = ""
			}
			if prometheus != "" {
				if u, err := url.Parse(prometheus); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
					return fmt.Errorf("--prometheus %q: want an http or https URL", prometheus)
				}
			}
			return dashboard.RunCluster(cmd.Context(), dashboard.ClusterRunConfig{
				ServeConfig: dashboard.ServeConfig{Address: address, Title: "gpudra: " + contextName, Listening: listening(cmd)},
				RESTConfig:  rc, Context: contextName, Namespace: ns, FallbackNamespace: ctxNS,
				Prometheus: prometheus, PluginNamespace: pluginNamespace, UsageInterval: usageInterval,
			})
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&kubeconfig, "kubeconfig", "", "path to the kubeconfig file; default: $KUBECONFIG, ~/.kube/config or in-cluster")
	fs.StringVar(&kubeContext, "context", "", "kubeconfig context to use")
	fs.StringVarP(&namespace, "namespace", "n", "", "show only this namespace's claims, pods and reservations; default: all those you may list (else the context's)")
	fs.BoolVarP(&allNamespaces, "all-namespaces", "A", false, "all namespaces (the default; overrides --namespace)")
	fs.StringVar(&address, "address", DefaultDashboardAddress, "host:port to serve the page on (port 0: any free port)")
	fs.StringVar(&prometheus, "prometheus", "", "a Prometheus that scrapes the gpudra plugins (http://prometheus:9090): usage and allocation over time from it")
	fs.StringVar(&pluginNamespace, "plugin-namespace", "", "the namespace of gpudra's kubelet plugin pods, whose /metrics are read through the API server's proxy (without --prometheus); default: found by the chart's labels in any namespace (where you may list pods in every namespace)")
	fs.DurationVar(&usageInterval, "usage-interval", 5*time.Second, "time between usage reads")
	return cmd
}

func newLocalDashboardCommand() *cobra.Command {
	var f topFlags
	var address string
	cmd := &cobra.Command{
		Use:   "dashboard",
		Short: "Serve a read-only web page of this machine's GPUs: gpudra local's holders and waiters, live usage",
		Long: `dashboard serves the web page of gpudra dashboard for this machine (docs/dashboard.md): its GPUs and MIG
devices, gpudra local's allocations (user, name, process) and waiters with their positions, live usage
through the GPU backend, and the devices held per user since the page's server started. It reads the
local state and never changes it; it listens on 127.0.0.1 unless --address says otherwise, and, as
gpudra dashboard, serves only requests with the token of the URL it prints on standard error.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if f.interval <= 0 {
				return fmt.Errorf("--interval %s: want more than 0", f.interval)
			}
			backend, err := f.backend.open(cmd.Context())
			if err != nil {
				return err
			}
			defer backend.Close()
			reader, ok := backend.(nvdevice.TelemetryReader)
			if !ok {
				return fmt.Errorf("--backend %s reads no telemetry", f.backend.backend)
			}
			return dashboard.RunLocal(cmd.Context(), dashboard.LocalRunConfig{
				ServeConfig: dashboard.ServeConfig{Address: address, Title: "gpudra local: " + f.backend.nodeName, Listening: listening(cmd)},
				LocalConfig: dashboard.LocalConfig{Telemetry: reader, Node: f.backend.nodeName, Backend: f.backend.backend,
					StateDir: f.stateDir, UserOf: top.ProcUser(f.procRoot), Interval: f.interval},
			})
		},
	}
	f.backend.register(cmd.Flags())
	cmd.Flags().StringVar(&address, "address", DefaultDashboardAddress, "host:port to serve the page on (port 0: any free port)")
	cmd.Flags().DurationVar(&f.interval, "interval", 2*time.Second, "time between reads of the machine")
	cmd.Flags().StringVar(&f.stateDir, "state-dir", local.DefaultStateDir, "gpudra local's state, read only")
	cmd.Flags().StringVar(&f.procRoot, "proc-root", "/proc", "where the processes' owners are read")
	return cmd
}

// listening tells the user where the page is, on stderr (stdout stays
// free for scripts).
func listening(cmd *cobra.Command) func(string) {
	return func(u string) { fmt.Fprintf(cmd.ErrOrStderr(), "Serving the dashboard on %s (Ctrl-C to stop)\n", u) }
}
