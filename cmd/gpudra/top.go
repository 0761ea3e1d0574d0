package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpudra/gpudra/pkg/dashboard"
	"github.com/gpudra/gpudra/pkg/kubeclient"
	"github.com/gpudra/gpudra/pkg/local"
	"github.com/gpudra/gpudra/pkg/metrics"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/top"
)

// topFlags are gpudra top's.
type topFlags struct {
	backend  backendFlags
	endpoint string
	// tokenFile and insecure are for --endpoint: the plugin's /metrics
	// takes a bearer token RBAC lets get /metrics, over HTTPS with a
	// certificate nobody signed.
	tokenFile string
	insecure  bool
	interval  time.Duration
	once      bool
	output    string
	stateDir  string
	procRoot  string
	// node reads that node's kubelet plugin through the API server's
	// pods proxy, with the kubeconfig's credentials; pluginNamespace is
	// where its pod is (""; found by the chart's labels in any namespace).
	node, kubeconfig, kubeContext, pluginNamespace string
}

func newTopCommand() *cobra.Command {
	var f topFlags
	cmd := &cobra.Command{
		Use:   "top",
		Short: "Show one node's GPUs and MIG devices, who holds each, their utilization, memory, power and processes, refreshing",
		Long: `top shows one node's GPUs and MIG devices: the claim and pods (or the gpudra local allocation and its
user) holding each, utilization, SM activity, memory used and total, power, temperature, and what runs on
each. It reads a node's kubelet plugin through the API server's pods proxy with your kubeconfig
(--node: no port-forward; you need to get pods/proxy where the plugin runs), a kubelet plugin's
/metrics at a URL (--endpoint), or this machine directly: the GPU backend's telemetry and gpudra
local's state (read only). A reading that could not be told shows as "-", never 0.
-o json writes one JSON object per refresh, one per line.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(f.output, "table", "json"); err != nil {
				return err
			}
			if f.interval <= 0 {
				return fmt.Errorf("--interval %s: want more than 0", f.interval)
			}
			src, err := f.source(cmd.Context())
			if err != nil {
				return err
			}
			defer src.close()
			return runTop(cmd.Context(), cmd.OutOrStdout(), src, f)
		},
	}
	f.backend.register(cmd.Flags())
	cmd.Flags().StringVar(&f.node, "node", "", "a cluster node: read its kubelet plugin's /metrics through the API server's pods proxy, with your kubeconfig")
	cmd.Flags().StringVar(&f.kubeconfig, "kubeconfig", "", "with --node: path to the kubeconfig file; default: $KUBECONFIG, ~/.kube/config or in-cluster")
	cmd.Flags().StringVar(&f.kubeContext, "context", "", "with --node: kubeconfig context to use")
	cmd.Flags().StringVar(&f.pluginNamespace, "plugin-namespace", "", "with --node: the namespace of gpudra's kubelet plugin pods; default: found by the chart's labels in any namespace")
	cmd.Flags().StringVar(&f.endpoint, "endpoint", "", "a kubelet plugin's metrics URL (https://<plugin pod IP>:9477/metrics); empty: this machine, through --backend")
	cmd.Flags().StringVar(&f.tokenFile, "token-file", "", "with --endpoint: a file holding the bearer token sent to the plugin, of an identity RBAC lets get /metrics (the chart's <release>-metrics-reader ClusterRole), e.g. from kubectl create token")
	cmd.Flags().BoolVar(&f.insecure, "insecure-skip-tls-verify", false, "with --endpoint https://: accept the plugin's certificate unverified (it makes its own at start, signed by nobody)")
	cmd.Flags().DurationVar(&f.interval, "interval", 2*time.Second, "time between refreshes")
	cmd.Flags().BoolVar(&f.once, "once", false, "show one refresh and exit")
	cmd.Flags().StringVarP(&f.output, "output", "o", "table", "output format: table, or json (one object per refresh and line)")
	cmd.Flags().StringVar(&f.stateDir, "state-dir", local.DefaultStateDir, "gpudra local's state, read only (without --endpoint)")
	cmd.Flags().StringVar(&f.procRoot, "proc-root", "/proc", "where the processes' owners are read (without --endpoint)")
	return cmd
}

// topSource reads one snapshot per refresh.
type topSource interface {
	read(ctx context.Context) (*top.Snapshot, error)
	close()
}

func (f *topFlags) source(ctx context.Context) (topSource, error) {
	if f.node == "" && (f.kubeconfig != "" || f.kubeContext != "" || f.pluginNamespace != "") {
		return nil, errors.New("--kubeconfig, --context and --plugin-namespace are for --node")
	}
	if f.node != "" {
		if f.endpoint != "" {
			return nil, errors.New("--node and --endpoint: give one")
		}
		rc, _, err := loadKubeconfig(f.kubeconfig, f.kubeContext)
		if err != nil {
			return nil, err
		}
		// The plugin reviews the user's own token, which the proxy does
		// not forward: it goes in a header of its own, as the dashboard
		// sends it.
		client, err := kubeclient.NewForConfig(metrics.WithProxiedBearerToken(rc))
		if err != nil {
			return nil, fmt.Errorf("API client: %w", err)
		}
		return &nodeSource{node: f.node, plugins: &dashboard.PluginProxyUsage{Client: client, Namespace: f.pluginNamespace}}, nil
	}
	if f.endpoint != "" {
		src := &endpointSource{url: f.endpoint, client: &http.Client{Timeout: max(f.interval, time.Second)}}
		if f.tokenFile != "" {
			b, err := os.ReadFile(f.tokenFile)
			if err != nil {
				return nil, fmt.Errorf("--token-file: %w", err)
			}
			if src.token = strings.TrimSpace(string(b)); src.token == "" {
				return nil, fmt.Errorf("--token-file %s: empty", f.tokenFile)
			}
		}
		if f.insecure {
			src.client.Transport = &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}} //nolint:gosec // asked for: the plugin's certificate is its own
		}
		// A refresh never waits longer than the interval for a plugin.
		return src, nil
	}
	backend, err := f.backend.open(ctx)
	if err != nil {
		return nil, err
	}
	reader, ok := backend.(nvdevice.TelemetryReader)
	if !ok {
		_ = backend.Close()
		return nil, fmt.Errorf("--backend %s reads no telemetry", f.backend.backend)
	}
	return &machineSource{reader: reader, closer: backend.Close, node: f.backend.nodeName, name: f.backend.backend,
		stateDir: f.stateDir, userOf: top.ProcUser(f.procRoot)}, nil
}

// endpointSource scrapes a kubelet plugin.
type endpointSource struct {
	url    string
	token  string
	client *http.Client
}

func (e *endpointSource) read(ctx context.Context) (*top.Snapshot, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.url, nil)
	if err != nil {
		return nil, fmt.Errorf("--endpoint %s: %w", e.url, err)
	}
	// The text format: expfmt parses it, and a plugin serves it to any client.
	req.Header.Set("Accept", "text/plain;version=0.0.4")
	if e.token != "" {
		req.Header.Set("Authorization", "Bearer "+e.token)
	}
	resp, err := e.client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("scrape %s: %w", e.url, err)
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusUnauthorized, http.StatusForbidden:
		return nil, fmt.Errorf("scrape %s: %s: the plugin serves /metrics to a bearer token (--token-file) of an identity RBAC lets get /metrics", e.url, resp.Status)
	default:
		return nil, fmt.Errorf("scrape %s: %s", e.url, resp.Status)
	}
	fams, err := top.ParseMetrics(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("scrape %s: %w", e.url, err)
	}
	return top.FromMetrics(fams, e.url, time.Now()), nil
}

func (e *endpointSource) close() {}

// nodeSource reads a node's kubelet plugin through the API server's pods
// proxy, as the dashboard reads every node's.
type nodeSource struct {
	node    string
	plugins *dashboard.PluginProxyUsage
}

func (n *nodeSource) read(ctx context.Context) (*top.Snapshot, error) {
	return n.plugins.ReadNode(ctx, n.node)
}

func (n *nodeSource) close() {}

// machineSource reads this machine: one telemetry read of the backend per
// refresh, and gpudra local's state file.
type machineSource struct {
	reader   nvdevice.TelemetryReader
	closer   func() error
	node     string
	name     string
	stateDir string
	userOf   func(pid int) string
}

func (m *machineSource) read(ctx context.Context) (*top.Snapshot, error) {
	samples, err := m.reader.Telemetry(ctx)
	if err != nil {
		return nil, fmt.Errorf("read the GPUs' telemetry: %w", err)
	}
	// gpudra local's state is extra: without it the devices still show,
	// with a note, and no holder (not "free").
	state, serr := top.ReadLocalState(m.stateDir)
	s := top.FromMachine(samples, m.node, m.name, state, m.userOf, time.Now())
	if serr != nil {
		s.Notes = append(s.Notes, serr.Error())
	}
	return s, nil
}

func (m *machineSource) close() { _ = m.closer() }

// runTop reads and shows a snapshot every interval until ctx is done
// (once: one). While refreshing, a failed read is shown and tried again
// at the next refresh: a plugin restarting is no reason to exit.
func runTop(ctx context.Context, w io.Writer, src topSource, f topFlags) error {
	clear := f.output == "table" && !f.once && isTerminal(w)
	for {
		s, err := src.read(ctx)
		switch {
		case err != nil && (f.once || ctx.Err() != nil):
			if ctx.Err() != nil {
				return nil
			}
			return err
		case err != nil:
			fmt.Fprintf(w, "%s: %v\n", time.Now().Format(time.TimeOnly), err)
		default:
			if clear {
				fmt.Fprint(w, "\x1b[H\x1b[2J") // home, clear: redraw in place
			}
			if f.output == "json" {
				err = top.JSON(w, s)
			} else {
				err = top.Table(w, s)
			}
			if err != nil {
				return err
			}
		}
		if f.once {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(f.interval):
		}
	}
}

// isTerminal says whether w is a terminal (redrawn in place), not a file
// or a pipe (appended to).
func isTerminal(w io.Writer) bool {
	file, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := file.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
