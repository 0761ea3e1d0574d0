// Package rayoperator runs KubeRay's operator against a devcluster, as a
// cluster runs it: KubeRay's own binary (v1.5's ray-operator main package
// as released, built from devcluster/kuberay, a module of its own at
// KubeRay's dependency versions) as its own process, as its own
// ServiceAccount under RBAC, against devcluster's API server, with the
// CRDs of that version (docs/ray.md).
package rayoperator

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
	"strings"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/devcluster"
)

// BinaryEnv names the environment variable that points at KubeRay's
// operator binary (make kuberay builds bin/kuberay/kuberay-operator).
const BinaryEnv = "KUBERAY"

// CRDsFile is the name of the CRDs of the binary's version, beside it:
// the binary cannot print them, and the Go module cache they come from is
// not there at run time, so make kuberay writes them there at build time.
const CRDsFile = "crds.yaml"

// Namespace and ServiceAccount the operator runs as.
const (
	Namespace      = "kuberay"
	ServiceAccount = "kuberay-operator"
)

//go:embed kuberay-rbac.yaml
var rbac []byte

// GVRs of KubeRay's objects, for tests and the demo.
var (
	RayClusters = schema.GroupVersionResource{Group: "ray.io", Version: "v1", Resource: "rayclusters"}
	RayJobs     = schema.GroupVersionResource{Group: "ray.io", Version: "v1", Resource: "rayjobs"}
	RayServices = schema.GroupVersionResource{Group: "ray.io", Version: "v1", Resource: "rayservices"}
)

// Options configure the operator's run.
type Options struct {
	// Binary is kuberay-operator; empty: $KUBERAY. Its CRDs are
	// CRDsFile beside it.
	Binary string
	// Args add to the operator's flags (--feature-gates, ...).
	Args []string
	// Env adds to the operator's environment.
	Env map[string]string
}

// Operator is a running KubeRay operator.
type Operator struct {
	// Log is the operator's output.
	Log string
	// Dir holds its kubeconfig, RBAC and log.
	Dir string

	cmd  *exec.Cmd
	done chan struct{}
}

// Start installs KubeRay's CRDs and the operator's identity, and runs the
// operator until Stop, waiting until it reports ready.
func Start(ctx context.Context, c *devcluster.Cluster, opts Options) (_ *Operator, err error) {
	if opts.Binary == "" {
		opts.Binary = os.Getenv(BinaryEnv)
	}
	if opts.Binary == "" {
		return nil, fmt.Errorf("no KubeRay operator binary: set %s (make kuberay builds bin/kuberay/kuberay-operator)", BinaryEnv)
	}
	crds := filepath.Join(filepath.Dir(opts.Binary), CRDsFile)
	if _, err := os.Stat(crds); err != nil {
		return nil, fmt.Errorf("KubeRay's CRDs, %s beside %s (make kuberay writes them): %w", CRDsFile, opts.Binary, err)
	}
	dir := filepath.Join(c.Dir, "kuberay")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	rbacFile := filepath.Join(dir, "rbac.yaml")
	if err := os.WriteFile(rbacFile, rbac, 0o600); err != nil {
		return nil, err
	}
	for _, f := range []string{crds, rbacFile} {
		if _, err := c.ApplyFiles(ctx, Namespace, f); err != nil {
			return nil, fmt.Errorf("KubeRay's %s: %w", f, err)
		}
	}
	if err := waitServed(ctx, c, RayClusters, RayJobs, RayServices); err != nil {
		return nil, err
	}
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := c.WriteServiceAccountKubeconfig(ctx, kubeconfig, Namespace, ServiceAccount); err != nil {
		return nil, err
	}
	ports, err := freePorts(2)
	if err != nil {
		return nil, err
	}
	args := []string{
		"--metrics-addr=127.0.0.1:" + strconv.Itoa(ports[0]),
		"--health-probe-bind-address=127.0.0.1:" + strconv.Itoa(ports[1]),
		// One replica: no lease to wait for.
		"--enable-leader-election=false",
		"--log-stdout-encoder=console",
	}
	args = append(args, opts.Args...)
	op := &Operator{Dir: dir, Log: filepath.Join(dir, "kuberay-operator.log"), done: make(chan struct{})}
	logFile, err := os.OpenFile(op.Log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	op.cmd = exec.Command(opts.Binary, args...) //nolint:gosec // the binary the harness was given
	op.cmd.Stdout, op.cmd.Stderr = logFile, logFile
	op.cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + dir, "KUBECONFIG=" + kubeconfig}
	for k, v := range opts.Env {
		op.cmd.Env = append(op.cmd.Env, k+"="+v)
	}
	if err := op.cmd.Start(); err != nil {
		_ = logFile.Close()
		return nil, fmt.Errorf("start KubeRay's operator: %w", err)
	}
	go func() {
		_ = op.cmd.Wait()
		_ = logFile.Close()
		close(op.done)
	}()
	klog.FromContext(ctx).Info("KubeRay's operator started", "pid", op.cmd.Process.Pid, "log", op.Log)
	if err := op.waitReady(ctx, ports[1]); err != nil {
		op.Stop()
		return nil, err
	}
	return op, nil
}

// waitReady waits for the operator's readiness probe.
func (op *Operator) waitReady(ctx context.Context, port int) error {
	url := "http://127.0.0.1:" + strconv.Itoa(port) + "/readyz"
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		select {
		case <-op.done:
			return false, errors.New("KubeRay's operator exited")
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
		return fmt.Errorf("KubeRay's operator not ready: %w; its log (%s):\n%s", err, op.Log, op.LogTail(4000))
	}
	return nil
}

// Stop stops the operator (SIGTERM, then SIGKILL after 10 s). What it
// made stays until the cluster stops.
func (op *Operator) Stop() {
	if op.cmd.Process == nil {
		return
	}
	_ = op.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-op.done:
	case <-time.After(10 * time.Second):
		_ = op.cmd.Process.Kill()
		<-op.done
	}
}

// Exited is closed once the operator's process has ended.
func (op *Operator) Exited() <-chan struct{} { return op.done }

// LogTail is the end of the operator's log, for a failing test's message.
func (op *Operator) LogTail(n int) string {
	b, err := os.ReadFile(op.Log)
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

// Forbidden are the lines of the operator's log where the API server
// refused it a call: its RBAC (kuberay-rbac.yaml) lacks what it does.
func Forbidden(log []byte) []string {
	var out []string
	for _, line := range strings.Split(string(log), "\n") {
		if strings.Contains(line, "is forbidden") {
			out = append(out, line)
		}
	}
	return out
}

// waitServed waits until the API server serves the resources and
// discovery lists them (new CRDs are served a moment after they are
// created, and listed in discovery a moment after that; the operator's
// controllers map kinds through discovery).
func waitServed(ctx context.Context, c *devcluster.Cluster, gvrs ...schema.GroupVersionResource) error {
	dyn, err := dynamic.NewForConfig(c.RESTConfig)
	if err != nil {
		return err
	}
	disc, err := discovery.NewDiscoveryClientForConfig(c.RESTConfig)
	if err != nil {
		return err
	}
	for _, gvr := range gvrs {
		err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
			if _, err := dyn.Resource(gvr).List(ctx, metav1.ListOptions{Limit: 1}); err != nil {
				return false, nil
			}
			list, err := disc.ServerResourcesForGroupVersion(gvr.GroupVersion().String())
			if err != nil {
				return false, nil
			}
			for _, r := range list.APIResources {
				if r.Name == gvr.Resource {
					return true, nil
				}
			}
			return false, nil
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
