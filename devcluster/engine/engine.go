// Package engine runs an engine of the field (Karpenter, KubeRay's
// operator) against a devcluster as a cluster runs it: its CRDs and its
// identity (a ServiceAccount under RBAC) installed from manifests, then its
// own binary as its own process, with that ServiceAccount's kubeconfig,
// ready once its health probe says so. What is particular to an engine
// (its flags, its environment, a cloud beside it) stays in its own package
// (devcluster/autoscaler, devcluster/rayoperator).
package engine

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
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

// Spec is an engine's run.
type Spec struct {
	// Name names the engine in messages and its log ("Karpenter").
	Name string
	// Dir holds its manifests, kubeconfig and log.
	Dir string
	// Binary and Args are its process.
	Binary string
	Args   []string
	// Env is its environment besides PATH, HOME (Dir) and KUBECONFIG.
	Env map[string]string
	// Manifests are applied in order before it starts (its CRDs, then its
	// namespace, ServiceAccount and RBAC); namespaced objects without a
	// namespace go into Namespace.
	Manifests []string
	// Served are the resources its CRDs add: it starts once the API
	// server serves them and discovery lists them.
	Served []schema.GroupVersionResource
	// Namespace and ServiceAccount are who it runs as.
	Namespace, ServiceAccount string
	// ReadyURL is its readiness probe; it is ready once that answers 200.
	ReadyURL string
}

// Process is a running engine.
type Process struct {
	Name string
	// Log is its output, stdout and stderr.
	Log string

	cmd  *exec.Cmd
	done chan struct{}
}

// Start installs the engine's manifests, waits until its resources are
// served, writes its ServiceAccount's kubeconfig and runs it until Stop,
// waiting until it reports ready.
func Start(ctx context.Context, c *devcluster.Cluster, s Spec) (*Process, error) {
	if err := os.MkdirAll(s.Dir, 0o700); err != nil {
		return nil, err
	}
	for _, m := range s.Manifests {
		if _, err := c.ApplyFiles(ctx, s.Namespace, m); err != nil {
			return nil, fmt.Errorf("%s's %s: %w", s.Name, filepath.Base(m), err)
		}
	}
	if err := WaitServed(ctx, c, s.Served...); err != nil {
		return nil, fmt.Errorf("%s's CRDs: %w", s.Name, err)
	}
	kubeconfig := filepath.Join(s.Dir, "kubeconfig")
	if err := c.WriteServiceAccountKubeconfig(ctx, kubeconfig, s.Namespace, s.ServiceAccount); err != nil {
		return nil, err
	}
	p := &Process{Name: s.Name, Log: filepath.Join(s.Dir, filepath.Base(s.Binary)+".log"), done: make(chan struct{})}
	logFile, err := os.OpenFile(p.Log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	p.cmd = exec.Command(s.Binary, s.Args...) //nolint:gosec // the binary the harness was given
	p.cmd.Stdout, p.cmd.Stderr = logFile, logFile
	p.cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + s.Dir, "KUBECONFIG=" + kubeconfig}
	for k, v := range s.Env {
		p.cmd.Env = append(p.cmd.Env, k+"="+v)
	}
	if err := p.cmd.Start(); err != nil {
		_ = logFile.Close()
		return nil, fmt.Errorf("start %s: %w", s.Name, err)
	}
	go func() {
		_ = p.cmd.Wait()
		_ = logFile.Close()
		close(p.done)
	}()
	klog.FromContext(ctx).Info("Engine started", "engine", s.Name, "pid", p.cmd.Process.Pid, "log", p.Log)
	if err := p.waitReady(ctx, s.ReadyURL); err != nil {
		p.Stop()
		return nil, err
	}
	return p, nil
}

// waitReady waits for the readiness probe to answer 200.
func (p *Process) waitReady(ctx context.Context, url string) error {
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		select {
		case <-p.done:
			return false, fmt.Errorf("%s exited", p.Name)
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
		return fmt.Errorf("%s not ready: %w; its log (%s):\n%s", p.Name, err, p.Log, p.LogTail(4000))
	}
	return nil
}

// Stop stops the engine (SIGTERM, then SIGKILL after 10 s). What it made
// stays until the cluster stops.
func (p *Process) Stop() {
	if p.cmd.Process == nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// Exited is closed once the engine's process has ended.
func (p *Process) Exited() <-chan struct{} { return p.done }

// LogTail is the end of the engine's log, for a failing test's message.
func (p *Process) LogTail(n int) string {
	b, err := os.ReadFile(p.Log)
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

// Forbidden are the lines of an engine's log where the API server refused
// it a call: the RBAC it was given lacks what it does.
func Forbidden(log []byte) []string {
	var out []string
	for _, line := range strings.Split(string(log), "\n") {
		if strings.Contains(line, "is forbidden") {
			out = append(out, line)
		}
	}
	return out
}

// WaitServed waits until the API server serves the resources and
// discovery lists them: new CRDs are served a moment after they are
// created, and listed in discovery a moment after that, and an engine's
// controllers map kinds through discovery.
func WaitServed(ctx context.Context, c *devcluster.Cluster, gvrs ...schema.GroupVersionResource) error {
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

// FreePorts are n TCP ports free on the loopback now.
func FreePorts(n int) ([]int, error) {
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

// WriteManifest writes an embedded manifest into dir, for Spec.Manifests.
func WriteManifest(dir, name string, content []byte) (string, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, content, 0o600); err != nil {
		return "", err
	}
	return path, nil
}
