// Package kueuemanager runs Kueue against a devcluster, as a cluster runs
// it: Kueue's own manager binary (v0.17's cmd/kueue as released, built
// from devcluster/kueue, a module of its own at Kueue's dependency
// versions) as its own process, as its own ServiceAccount under RBAC,
// against devcluster's API server, with the CRDs, RBAC, webhook Service and
// webhook configurations of Kueue's own Helm chart of that version. Its
// webhooks are reached as on a cluster: through their Service, whose
// endpoint devcluster routes to the process (Cluster.ServeService), with
// the certificates Kueue makes and injects itself (docs/queues.md).
package kueuemanager

import (
	"bytes"
	"context"
	_ "embed"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/klog/v2"
	"sigs.k8s.io/yaml"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/engine"
	"github.com/gpudra/gpudra/pkg/kueue"
	"github.com/gpudra/gpudra/pkg/plugin/checkpoint"
)

// BinaryEnv names the environment variable that points at Kueue's
// manager binary (make kueue builds bin/kueue/kueue-manager).
const BinaryEnv = "KUEUE"

// ChartDir is Kueue's Helm chart of the binary's version, beside it: the
// Go module cache it comes from is not there at run time, so make kueue
// copies it there at build time.
const ChartDir = "chart"

// Names the chart gives Kueue's objects (release kueue).
const (
	Namespace      = "kueue-system"
	ServiceAccount = "kueue-controller-manager"
	WebhookService = "kueue-webhook-service"
	WebhookSecret  = "kueue-webhook-server-cert"
)

// GPUResource is what Kueue counts gpudra's whole GPUs as (config.yaml's
// deviceClassMappings): a ClusterQueue's quota of gpudra GPUs.
const GPUResource = "gpudra.dev/gpu"

//go:embed config.yaml
var baseConfig []byte

// chartKinds are what devcluster applies of the rendered chart: Kueue's
// CRDs and identity, and its webhooks' Service and configurations. The
// Deployment is this process; the visibility APIServices and the metrics
// Service are left out (no aggregated API server or scraper here).
var chartKinds = []string{"CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
	"Secret", "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"}

// Options configure Kueue's run.
type Options struct {
	// Binary is kueue-manager; empty: $KUEUE. Its chart is ChartDir
	// beside it.
	Binary string
	// Helm renders the chart; empty: $HELM.
	Helm string
	// PodsReadyTimeout is waitForPodsReady's timeout: how long an
	// admitted job may wait for all of its pods to run before Kueue takes
	// its quota back and queues it again. Zero: config.yaml's.
	PodsReadyTimeout time.Duration
}

// Manager is a running Kueue manager.
type Manager struct {
	*engine.Process
	// Dir holds its configuration, kubeconfig, certificates and log.
	Dir string
	// Config is the configuration it runs with.
	Config  string
	route   *devcluster.ServiceRoute
	unmount func()
}

// Start installs Kueue's CRDs, identity and webhooks from its chart and
// runs its manager until Stop, waiting until it reports ready.
func Start(ctx context.Context, c *devcluster.Cluster, opts Options) (*Manager, error) {
	if opts.Binary == "" {
		opts.Binary = os.Getenv(BinaryEnv)
	}
	if opts.Binary == "" {
		return nil, fmt.Errorf("no Kueue manager binary: set %s (make kueue builds bin/kueue/kueue-manager)", BinaryEnv)
	}
	if opts.Helm == "" {
		opts.Helm = os.Getenv("HELM")
	}
	if opts.Helm == "" {
		return nil, fmt.Errorf("no helm to render Kueue's chart: set HELM (make helm builds bin/helm)")
	}
	dir := filepath.Join(c.Dir, "kueue")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	objs, err := renderChart(ctx, opts.Helm, filepath.Join(filepath.Dir(opts.Binary), ChartDir))
	if err != nil {
		return nil, err
	}
	ns := &unstructured.Unstructured{Object: map[string]any{"apiVersion": "v1", "kind": "Namespace", "metadata": map[string]any{"name": Namespace}}}
	if err := c.Apply(ctx, Namespace, append([]*unstructured.Unstructured{ns}, objs...)); err != nil {
		return nil, fmt.Errorf("Kueue's chart: %w", err)
	}
	ports, err := engine.FreePorts(2)
	if err != nil {
		return nil, err
	}
	health, webhookPort := ports[0], ports[1]
	route, err := c.ServeService(ctx, Namespace, WebhookService, 443, "127.0.0.1:"+strconv.Itoa(webhookPort))
	if err != nil {
		return nil, err
	}
	config, err := managerConfig(dir, health, webhookPort, opts)
	if err != nil {
		route.Close()
		return nil, err
	}
	configFile, err := engine.WriteManifest(dir, "config.yaml", config)
	if err != nil {
		route.Close()
		return nil, err
	}
	// Kueue makes its webhook certificate into a Secret and waits until
	// it appears in its certificate directory, where a pod's kubelet
	// mounts the Secret: devcluster is that kubelet here.
	mountCtx, unmount := context.WithCancel(context.WithoutCancel(ctx))
	mounted := make(chan struct{})
	go func() {
		defer close(mounted)
		mountSecret(mountCtx, c, Namespace, WebhookSecret, filepath.Join(dir, "certs"))
	}()
	stopMount := func() {
		unmount()
		<-mounted
	}
	p, err := engine.Start(ctx, c, engine.Spec{Name: "Kueue", Dir: dir, Binary: opts.Binary,
		Args:   []string{"--config=" + configFile, "--zap-log-level=2"},
		Served: []schema.GroupVersionResource{kueue.ClusterQueues, kueue.LocalQueues, kueue.ResourceFlavors, kueue.Cohorts, kueue.Workloads}, Namespace: Namespace, ServiceAccount: ServiceAccount,
		ReadyURL: "http://127.0.0.1:" + strconv.Itoa(health) + "/readyz"})
	if err != nil {
		stopMount()
		route.Close()
		return nil, err
	}
	return &Manager{Process: p, Dir: dir, Config: configFile, route: route, unmount: stopMount}, nil
}

// Stop stops the manager, its Secret's mount and its webhooks' route.
func (m *Manager) Stop() {
	m.Process.Stop()
	m.unmount()
	m.route.Close()
}

// mountKey writes one key of a Secret into dir, the file replaced whole.
func mountKey(dir, key string, data []byte) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	return checkpoint.WriteFileAtomic(filepath.Join(dir, key), data)
}

// mountSecret keeps the Secret's keys as files in dir, as a kubelet keeps
// a pod's secret volume (each file replaced whole), until ctx ends.
func mountSecret(ctx context.Context, c *devcluster.Cluster, namespace, name, dir string) {
	logger := klog.FromContext(ctx).WithValues("secret", namespace+"/"+name, "dir", dir)
	written := map[string]string{}
	_ = wait.PollUntilContextCancel(ctx, 500*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		secret, err := c.Client.CoreV1().Secrets(namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for key, data := range secret.Data {
			if written[key] == string(data) {
				continue
			}
			if err := mountKey(dir, key, data); err != nil {
				logger.Error(err, "Mount a key of the Secret", "key", key)
				continue
			}
			written[key] = string(data)
		}
		return false, nil
	})
}

// renderChart renders Kueue's chart (release kueue in Namespace) and
// keeps chartKinds, and of the Services the webhooks' one.
func renderChart(ctx context.Context, helm, chartDir string) ([]*unstructured.Unstructured, error) {
	if _, err := os.Stat(filepath.Join(chartDir, "Chart.yaml")); err != nil {
		return nil, fmt.Errorf("Kueue's chart, %s (make kueue copies it there): %w", chartDir, err)
	}
	out, err := exec.CommandContext(ctx, helm, "template", "kueue", chartDir, "--namespace", Namespace, "--kube-version", "1.37.1").Output()
	if err != nil {
		return nil, fmt.Errorf("helm template %s: %w", chartDir, errWithStderr(err))
	}
	var objs []*unstructured.Unstructured
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(out), 4096)
	for {
		var o map[string]any
		if err := dec.Decode(&o); err != nil {
			if errors.Is(err, io.EOF) {
				break
			}
			return nil, fmt.Errorf("Kueue's rendered chart: %w", err)
		}
		if o == nil {
			continue
		}
		u := &unstructured.Unstructured{Object: o}
		if slices.Contains(chartKinds, u.GetKind()) || (u.GetKind() == "Service" && u.GetName() == WebhookService) {
			objs = append(objs, u)
		}
	}
	if len(objs) == 0 {
		return nil, fmt.Errorf("Kueue's rendered chart %s has none of %s", chartDir, strings.Join(chartKinds, ", "))
	}
	return objs, nil
}

func errWithStderr(err error) error {
	if ee := (*exec.ExitError)(nil); errors.As(err, &ee) && len(ee.Stderr) > 0 {
		return fmt.Errorf("%w: %s", err, bytes.TrimSpace(ee.Stderr))
	}
	return err
}

// managerConfig is config.yaml with devcluster's addresses: the health
// probe and the webhook server on loopback, no metrics server (nothing
// scrapes it here, and it would listen on every address), certificates in
// dir.
func managerConfig(dir string, health, webhookPort int, opts Options) ([]byte, error) {
	var cfg map[string]any
	if err := yaml.Unmarshal(baseConfig, &cfg); err != nil {
		return nil, fmt.Errorf("Kueue's base configuration: %w", err)
	}
	cfg["health"] = map[string]any{"healthProbeBindAddress": "127.0.0.1:" + strconv.Itoa(health)}
	cfg["metrics"] = map[string]any{"bindAddress": "0"}
	cfg["webhook"] = map[string]any{"host": "127.0.0.1", "port": webhookPort, "certDir": filepath.Join(dir, "certs")}
	if opts.PodsReadyTimeout > 0 {
		w, _ := cfg["waitForPodsReady"].(map[string]any)
		if w == nil {
			return nil, fmt.Errorf("Kueue's base configuration has no waitForPodsReady")
		}
		w["timeout"] = opts.PodsReadyTimeout.String()
	}
	return yaml.Marshal(cfg)
}
