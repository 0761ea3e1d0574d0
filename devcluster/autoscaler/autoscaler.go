// Package autoscaler runs Karpenter against a devcluster, as a cluster runs
// it: Karpenter's own binary (v1.15's controllers as they are, with
// devcluster's cloud provider compiled in: devcluster/karpenter, a module
// of its own on Karpenter's Kubernetes libraries) as its own process, as
// its own ServiceAccount under RBAC, against devcluster's API server, with
// its real CRDs; and devcluster's cloud (devcluster/cloud), whose machines
// are simulated GPU nodes that run the real plugin.
package autoscaler

import (
	"bytes"
	"context"
	_ "embed"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/cloud"
	"github.com/gpudra/gpudra/devcluster/cloudapi"
)

// BinaryEnv names the environment variable that points at the Karpenter
// binary (make karpenter builds bin/devcluster-karpenter).
const BinaryEnv = "KARPENTER"

// Namespace and ServiceAccount Karpenter runs as.
const (
	Namespace      = "karpenter"
	ServiceAccount = "karpenter"
)

//go:embed karpenter-rbac.yaml
var rbac []byte

// Options configure Karpenter's run.
type Options struct {
	// Binary is devcluster-karpenter; empty: $KARPENTER.
	Binary string
	// FeatureGates is Karpenter's --feature-gates; empty: its defaults
	// and CapacityBuffer=true.
	FeatureGates string
	// Env adds to or overrides Karpenter's environment (its options:
	// BATCH_IDLE_DURATION, LOG_LEVEL, ...).
	Env map[string]string
}

// Karpenter is a running Karpenter and the cloud it buys from.
type Karpenter struct {
	Cloud *cloud.Cloud
	// Log is Karpenter's output.
	Log string
	// Dir holds its kubeconfig, CRDs and log.
	Dir string

	cmd    *exec.Cmd
	done   chan struct{}
	cancel context.CancelFunc
}

// GVRs of Karpenter's objects, for tests and the demo.
var (
	NodePools    = schema.GroupVersionResource{Group: "karpenter.sh", Version: "v1", Resource: "nodepools"}
	NodeClaims   = schema.GroupVersionResource{Group: "karpenter.sh", Version: "v1", Resource: "nodeclaims"}
	NodeClasses  = schema.GroupVersionResource{Group: "karpenter.devcluster.gpudra.dev", Version: "v1alpha1", Resource: "gpunodeclasses"}
	CapacityBufs = schema.GroupVersionResource{Group: "autoscaling.x-k8s.io", Version: "v1beta1", Resource: "capacitybuffers"}
)

// Start installs Karpenter's CRDs and identity, starts the cloud, and
// runs Karpenter until Stop, waiting until it reports ready.
func Start(ctx context.Context, c *devcluster.Cluster, opts Options) (_ *Karpenter, err error) {
	if opts.Binary == "" {
		opts.Binary = os.Getenv(BinaryEnv)
	}
	if opts.Binary == "" {
		return nil, fmt.Errorf("no Karpenter binary: set %s (make karpenter builds bin/devcluster-karpenter)", BinaryEnv)
	}
	dir := filepath.Join(c.Dir, "karpenter")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	crds, err := exec.CommandContext(ctx, opts.Binary, "crds").Output()
	if err != nil {
		return nil, fmt.Errorf("%s crds: %w", opts.Binary, err)
	}
	for name, content := range map[string][]byte{"crds.yaml": crds, "rbac.yaml": rbac} {
		if err := os.WriteFile(filepath.Join(dir, name), content, 0o600); err != nil {
			return nil, err
		}
		if _, err := c.ApplyFiles(ctx, Namespace, filepath.Join(dir, name)); err != nil {
			return nil, fmt.Errorf("Karpenter's %s: %w", name, err)
		}
	}
	if err := waitServed(ctx, c, NodePools, NodeClaims, NodeClasses, CapacityBufs); err != nil {
		return nil, err
	}
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := c.WriteServiceAccountKubeconfig(ctx, kubeconfig, Namespace, ServiceAccount); err != nil {
		return nil, err
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer func() {
		if err != nil {
			cancel()
		}
	}()
	cl, err := cloud.Start(runCtx, filepath.Join(dir, "cloud.sock"), c)
	if err != nil {
		return nil, err
	}
	ports, err := freePorts(2)
	if err != nil {
		return nil, err
	}
	env := map[string]string{
		"KUBECONFIG": kubeconfig, cloudapi.SocketEnv: cl.Socket, "SYSTEM_NAMESPACE": Namespace,
		// Its DRA simulation: ResourceClaims decide which type fits.
		"IGNORE_DRA_REQUESTS": "false",
		// One replica: no lease to wait for.
		"DISABLE_LEADER_ELECTION": "true",
		"METRICS_PORT":            strconv.Itoa(ports[0]), "HEALTH_PROBE_PORT": strconv.Itoa(ports[1]),
		"FEATURE_GATES": "CapacityBuffer=true",
		"LOG_LEVEL":     "debug",
	}
	if opts.FeatureGates != "" {
		env["FEATURE_GATES"] = opts.FeatureGates
	}
	for k, v := range opts.Env {
		env[k] = v
	}
	k := &Karpenter{Cloud: cl, Dir: dir, Log: filepath.Join(dir, "karpenter.log"), done: make(chan struct{}), cancel: cancel}
	logFile, err := os.OpenFile(k.Log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	k.cmd = exec.Command(opts.Binary) //nolint:gosec // the binary the harness was given
	k.cmd.Stdout, k.cmd.Stderr = logFile, logFile
	k.cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + dir}
	for key, v := range env {
		k.cmd.Env = append(k.cmd.Env, key+"="+v)
	}
	if err := k.cmd.Start(); err != nil {
		_ = logFile.Close()
		return nil, fmt.Errorf("start Karpenter: %w", err)
	}
	go func() {
		_ = k.cmd.Wait()
		_ = logFile.Close()
		close(k.done)
	}()
	klog.FromContext(ctx).Info("Karpenter started", "pid", k.cmd.Process.Pid, "log", k.Log)
	if err := k.waitReady(ctx, ports[1]); err != nil {
		k.Stop()
		return nil, err
	}
	return k, nil
}

// waitReady waits for Karpenter's readiness probe.
func (k *Karpenter) waitReady(ctx context.Context, port int) error {
	url := "http://127.0.0.1:" + strconv.Itoa(port) + "/readyz"
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		select {
		case <-k.done:
			return false, errors.New("Karpenter exited")
		default:
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return false, err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return false, nil
		}
		_ = resp.Body.Close()
		return resp.StatusCode == http.StatusOK, nil
	})
	if err != nil {
		return fmt.Errorf("Karpenter not ready: %w; its log (%s):\n%s", err, k.Log, tail(k.Log, 4000))
	}
	return nil
}

// Stop stops Karpenter (SIGTERM, then SIGKILL after 10 s) and the cloud.
// The machines it bought stay until the cluster stops.
func (k *Karpenter) Stop() {
	if k.cmd.Process != nil {
		_ = k.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-k.done:
		case <-time.After(10 * time.Second):
			_ = k.cmd.Process.Kill()
			<-k.done
		}
	}
	k.cancel()
}

// Exited is closed once Karpenter's process has ended.
func (k *Karpenter) Exited() <-chan struct{} { return k.done }

// LogTail is the end of Karpenter's log, for a failing test's message.
func (k *Karpenter) LogTail(n int) string { return tail(k.Log, n) }

func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	if len(b) > n {
		b = b[len(b)-n:]
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			b = b[i+1:]
		}
	}
	return string(b)
}

// waitServed waits until the API server serves the resources (new CRDs
// are served a moment after they are created).
func waitServed(ctx context.Context, c *devcluster.Cluster, gvrs ...schema.GroupVersionResource) error {
	dyn, err := dynamic.NewForConfig(c.RESTConfig)
	if err != nil {
		return err
	}
	for _, gvr := range gvrs {
		err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
			_, err := dyn.Resource(gvr).List(ctx, metav1.ListOptions{Limit: 1})
			return err == nil, nil
		})
		if err != nil {
			return fmt.Errorf("%s not served: %w", gvr, err)
		}
	}
	return nil
}

// freePorts are n TCP ports free on the loopback now.
func freePorts(n int) ([]int, error) {
	var out []int
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		out = append(out, ln.Addr().(*net.TCPAddr).Port)
		defer func() { _ = ln.Close() }()
	}
	return out, nil
}
