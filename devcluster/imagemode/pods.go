// Package imagemode runs pods from make image's OCI layout, as a kubelet and
// containerd would: the image unpacked with go-containerregistry, each
// container in real runc over an overlay of it, its OCI spec made from the
// pod spec (podspec.go: command, env with the downward API, user,
// capabilities, privileges, namespaces), its volumes (hostPath, secret,
// configMap, emptyDir, a bound ServiceAccount token), its readiness and
// liveness probes dialled inside its network namespace, restarts with
// back-off and the status the kubelet would write. devcluster's image mode
// runs the chart's plugin and controller pods with it; what it does not
// apply (seccomp, resources, ...) is listed in docs/devcluster.md.
package imagemode

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/devcluster/controlplane"
	"github.com/gpudra/gpudra/devcluster/noderuntime"
	"github.com/gpudra/gpudra/internal/image"
)

// Options run the chart's own pods from the image (issue 38): the
// kubelet plugin DaemonSet's pod on every node and the controller
// Deployment's pods, as the chart renders them, in runc, from make image's
// OCI layout. devcluster's in-process plugin and controller are then not
// started.
type Options struct {
	// Layout is make image's OCI layout (bin/image/oci); the host's
	// architecture is run.
	Layout string
	// Runc is the runc binary (make runc).
	Runc string
}

// PodAnnotation marks a pod that devcluster runs from the image: the
// devcluster kubelet leaves it to the image runner.
const PodAnnotation = "devcluster.gpudra.dev/image-pod"

// Config is what the runner needs of the cluster.
type Config struct {
	// Dir is devcluster's directory: host paths below it are the nodes'
	// own; the runner keeps its state in Dir/image.
	Dir string
	// Admin is the client the runner plays the pods' controllers and the
	// kubelet with; APIServerHost is the API server's URL, whose serving
	// CA pods trust.
	Admin         kubernetes.Interface
	APIServerHost string
	// TokenLifetime is that of the pods' ServiceAccount tokens.
	TokenLifetime time.Duration
}

// Runner runs pods from the image.
type Runner struct {
	runc string
	root string // state/, bundles/, logs/, volumes/
	img  *image.Unpacked
	// clusterDir: host paths below it are the nodes' own; any other
	// hostPath is below the node's directory, the node's root.
	clusterDir string
	admin      kubernetes.Interface
	// tokenLifetime is that of the pods' ServiceAccount tokens.
	tokenLifetime time.Duration
	// apiAddr is the API server's host:port, caPEM its CA.
	apiAddr string
	caPEM   []byte

	mu   sync.Mutex
	pods map[string]*Pod
}

// NewRunner unpacks the image of the host's architecture from the layout
// and trusts the API server's serving CA.
func NewRunner(ctx context.Context, cfg Config, opts Options) (*Runner, error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("image mode runs the chart's pods in runc and needs root")
	}
	if _, err := os.Stat(opts.Runc); err != nil {
		return nil, fmt.Errorf("image mode: runc: %w", err)
	}
	r := &Runner{runc: opts.Runc, root: filepath.Join(cfg.Dir, "image"), clusterDir: cfg.Dir, admin: cfg.Admin, tokenLifetime: cfg.TokenLifetime,
		pods: map[string]*Pod{}}
	start := time.Now()
	var err error
	if r.img, err = image.Unpack(opts.Layout, runtime.GOARCH, filepath.Join(r.root, "unpacked")); err != nil {
		return nil, fmt.Errorf("image mode: %w", err)
	}
	klog.FromContext(ctx).Info("Image unpacked", "layout", opts.Layout, "image", r.img.Digest.String(), "elapsed", time.Since(start).Round(time.Millisecond))
	u, err := url.Parse(cfg.APIServerHost)
	if err != nil {
		return nil, err
	}
	r.apiAddr = u.Host
	if r.caPEM, err = controlplane.ServingCA(r.apiAddr); err != nil {
		return nil, err
	}
	return r, nil
}

// Pod is one pod run from the image: its one container, restarted
// as restartPolicy Always does, probed as its spec says.
type Pod struct {
	r       *Runner
	pod     *v1.Pod
	nodeDir string
	// webhook, when set, learns each container's network namespace
	// (the controller's pods: the front dials into it).
	onStart func(netns string)
	ready   atomic.Bool
	cancel  context.CancelFunc
	done    chan struct{}

	mu       sync.Mutex
	pid      int
	id       string
	restarts int32
	lastExit string
	// lastFinished is when the container last ended.
	lastFinished time.Time
	// apiListener is the API server's address in the container's network
	// namespace; cancelContainer ends what serves the container (its
	// forwarder).
	apiListener     net.Listener
	cancelContainer context.CancelFunc
}

// RunPod creates the pod (as its controller would) and runs it until ctx
// ends or stop. nodeDir is the node's root for host paths outside
// devcluster's directory.
func (r *Runner) RunPod(ctx context.Context, pod *v1.Pod, nodeDir string, onStart func(netns string)) (*Pod, error) {
	if len(pod.Spec.Containers) != 1 || len(pod.Spec.InitContainers) > 0 {
		return nil, fmt.Errorf("pod %s/%s: devcluster runs pods of one container from the image, this one has %d (and %d init containers)",
			pod.Namespace, pod.Name, len(pod.Spec.Containers), len(pod.Spec.InitContainers))
	}
	if pod.Annotations == nil {
		pod.Annotations = map[string]string{}
	}
	pod.Annotations[PodAnnotation] = "true"
	err := r.admin.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To(int64(0))})
	if err != nil && !apierrors.IsNotFound(err) {
		return nil, fmt.Errorf("pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	created, err := r.admin.CoreV1().Pods(pod.Namespace).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("create pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	ctx, cancel := context.WithCancel(klog.NewContext(ctx, klog.LoggerWithValues(klog.FromContext(ctx), "imagePod", created.Name)))
	p := &Pod{r: r, pod: created, nodeDir: nodeDir, onStart: onStart, cancel: cancel, done: make(chan struct{})}
	r.mu.Lock()
	r.pods[created.Namespace+"/"+created.Name] = p
	r.mu.Unlock()
	go p.run(ctx)
	return p, nil
}

// Cancel stops the pod's container and its loops.
func (p *Pod) Cancel() { p.cancel() }

// Done is closed once the pod's container and loops have ended.
func (p *Pod) Done() <-chan struct{} { return p.done }

// Ready says whether the pod's container passes its readiness probe.
func (p *Pod) Ready() bool { return p.ready.Load() }

// LogDir holds the logs of the pods run from the image.
func (r *Runner) LogDir() string { return filepath.Join(r.root, "logs") }

// stop stops the pod's container and its loops.
func (p *Pod) stop() {
	p.cancel()
	<-p.done
}

// StopAll stops every pod run from the image: none outlives devcluster.
func (r *Runner) StopAll() {
	if r == nil {
		return
	}
	r.mu.Lock()
	pods := make([]*Pod, 0, len(r.pods))
	for _, p := range r.pods {
		pods = append(pods, p)
	}
	r.pods = map[string]*Pod{}
	r.mu.Unlock()
	for _, p := range pods {
		p.stop()
	}
}

// run is the pod's kubelet: set the container up, start it, probe it,
// restart it when it ends or its liveness probe fails (back-off 1 s
// doubling to 10 s), report its status, until ctx ends or the pod is
// deleted. A container that could not be set up (a volume, its spec) is
// waiting in ContainerCreating and was never started: no restart counts.
func (p *Pod) run(ctx context.Context) {
	defer close(p.done)
	defer p.removePodDir()
	logger := klog.FromContext(ctx)
	backoff := time.Second
	for ctx.Err() == nil {
		cctx, cancel := context.WithCancel(ctx)
		p.mu.Lock()
		p.cancelContainer = cancel
		p.mu.Unlock()
		started := time.Now()
		err := p.start(cctx)
		var setup *setupError
		switch {
		case errors.As(err, &setup):
			logger.Info("Container of a pod run from the image cannot be set up", "err", err, "retryIn", backoff)
			p.report(ctx, podState{waiting: "ContainerCreating", message: err.Error()})
		case err == nil:
			p.report(ctx, podState{startedAt: started})
			err = p.watch(cctx, started)
		}
		p.ready.Store(false)
		p.kill()
		if errors.Is(err, errPodDeleted) {
			p.confirmDeletion(ctx)
			return
		}
		if ctx.Err() != nil {
			break
		}
		if setup == nil {
			p.mu.Lock()
			p.restarts++
			p.lastExit = err.Error()
			p.mu.Unlock()
			logger.Info("Container of a pod run from the image ended; restarting", "err", err, "backoff", backoff)
			p.report(ctx, podState{waiting: "CrashLoopBackOff", message: err.Error(), finishedAt: time.Now()})
		}
		select {
		case <-ctx.Done():
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 10*time.Second)
	}
	p.kill()
}

// setupError is a failure before the container exists (a volume, the
// spec): the kubelet's ContainerCreating, not a crash.
type setupError struct{ err error }

func (e *setupError) Error() string { return e.err.Error() }
func (e *setupError) Unwrap() error { return e.err }

// errPodDeleted ends a pod whose object is being deleted.
var errPodDeleted = errors.New("pod deleted")

// confirmDeletion removes the pod's object once its container is gone, as
// the kubelet does (devcluster does not recreate it, as a DaemonSet or a
// ReplicaSet would).
func (p *Pod) confirmDeletion(ctx context.Context) {
	err := p.r.admin.CoreV1().Pods(p.pod.Namespace).Delete(ctx, p.pod.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To(int64(0)),
		Preconditions: &metav1.Preconditions{UID: &p.pod.UID}})
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		klog.FromContext(ctx).Error(err, "Confirm the deletion of a pod run from the image")
	}
	p.r.mu.Lock()
	if p.r.pods[p.pod.Namespace+"/"+p.pod.Name] == p {
		delete(p.r.pods, p.pod.Namespace+"/"+p.pod.Name)
	}
	p.r.mu.Unlock()
}

// podDir holds what lives as long as the pod: its emptyDir volumes.
func (p *Pod) podDir() string { return filepath.Join(p.r.root, "pods", string(p.pod.UID)) }

func (p *Pod) removePodDir() { _ = os.RemoveAll(p.podDir()) }

// start prepares the volumes and the spec, creates the container, opens
// the API server's address inside its network namespace and starts it.
func (p *Pod) start(ctx context.Context) error {
	r, pod := p.r, p.pod
	// The chart's host paths below devcluster's directory name the node
	// (chart.NodeNamePlaceholder: each node's directories are its own), in its
	// hostPath volumes and in the mount paths that repeat them.
	c := pod.Spec.Containers[0].DeepCopy()
	for i := range c.VolumeMounts {
		c.VolumeMounts[i].MountPath = strings.ReplaceAll(c.VolumeMounts[i].MountPath, chart.NodeNamePlaceholder, pod.Spec.NodeName)
	}
	p.mu.Lock()
	p.id = fmt.Sprintf("%s-%d", pod.UID, p.restarts)
	id := p.id
	p.mu.Unlock()
	bundle := filepath.Join(r.root, "bundles", id)
	volumes, err := p.volumes(ctx, bundle)
	if err != nil {
		return &setupError{err}
	}
	rootfs, err := overlayRootfs(r.img.Rootfs, bundle)
	if err != nil {
		return &setupError{err}
	}
	host, port, _ := net.SplitHostPort(r.apiAddr)
	in := imageContainer{Pod: pod, Container: c, Rootfs: rootfs, ImageEnv: r.img.Config.Env, ImageUser: r.img.Config.User,
		ImageWorkingDir: r.img.Config.WorkingDir, Volumes: volumes,
		ServiceEnv: []string{"KUBERNETES_SERVICE_HOST=" + host, "KUBERNETES_SERVICE_PORT=" + port, "KUBERNETES_SERVICE_PORT_HTTPS=" + port},
		Cgroup:     "/devcluster-image/" + id}
	if tok := volumes[serviceAccountVolume]; tok != "" {
		in.ExtraMounts = append(in.ExtraMounts, oci.Mount{Destination: serviceAccountDir, Type: "bind", Source: tok, Options: []string{"rbind", "ro"}})
	}
	spec, err := imageContainerSpec(in)
	if err != nil {
		return &setupError{err}
	}
	if err := noderuntime.WriteJSON(filepath.Join(bundle, "config.json"), spec); err != nil {
		return err
	}
	logPath := p.logPath()
	if err := os.MkdirAll(filepath.Dir(logPath), 0o755); err != nil {
		return err
	}
	log, err := os.OpenFile(logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	defer log.Close()
	fmt.Fprintf(log, "--- devcluster: container %s starts (%s)\n", id, time.Now().UTC().Format(time.RFC3339))
	cmd := exec.CommandContext(ctx, r.runc, "--root", filepath.Join(r.root, "state"), "create", "--bundle", bundle, id)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("runc create: %w: %s", err, p.logTail())
	}
	pid, _, err := p.state(ctx)
	if err != nil {
		return err
	}
	p.mu.Lock()
	p.pid = pid
	p.mu.Unlock()
	netns := noderuntime.NetnsOf(pid)
	if !pod.Spec.HostNetwork {
		// The API server at the address its certificate names, inside
		// the pod, as kube-proxy makes the kubernetes Service reachable.
		l, err := noderuntime.ListenInNetns(netns, r.apiAddr)
		if err != nil {
			return fmt.Errorf("the API server's address in the pod: %w", err)
		}
		// Closed with the container (kill), or the socket would keep its
		// namespace alive after it.
		p.mu.Lock()
		p.apiListener = l
		p.mu.Unlock()
		go noderuntime.Forward(ctx, l, func(ctx context.Context) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "tcp", r.apiAddr)
		})
		if p.onStart != nil {
			p.onStart(netns)
		}
	} else if p.onStart != nil {
		p.onStart("") // the host's network: dialled as it is
	}
	if out, err := exec.CommandContext(ctx, r.runc, "--root", filepath.Join(r.root, "state"), "start", id).CombinedOutput(); err != nil {
		return fmt.Errorf("runc start: %w: %s", err, bytes.TrimSpace(out))
	}
	return nil
}

// watch probes the running container until it ends, its liveness probe
// fails failureThreshold times, or ctx ends.
func (p *Pod) watch(ctx context.Context, started time.Time) error {
	c := &p.pod.Spec.Containers[0]
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	var nextLive, nextReady, nextLook time.Time
	liveFailures, readyFailures, readySuccesses := 0, 0, 0
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
		if _, status, err := p.state(ctx); err != nil || status != "running" {
			return fmt.Errorf("container exited (%s): %s", status, p.logTail())
		}
		now := time.Now()
		// Deleted (kubectl delete pod): the container goes, then the
		// object. Asked every 5 s: a handful of pods, not a watch's worth.
		if now.After(nextLook) {
			nextLook = now.Add(5 * time.Second)
			cur, err := p.r.admin.CoreV1().Pods(p.pod.Namespace).Get(ctx, p.pod.Name, metav1.GetOptions{})
			if (err == nil && (cur.UID != p.pod.UID || cur.DeletionTimestamp != nil)) || apierrors.IsNotFound(err) {
				return errPodDeleted
			}
		}
		if pr := c.ReadinessProbe; now.After(nextReady) {
			ready := true
			if pr != nil {
				ready = p.ready.Load()
				if now.Sub(started) >= time.Duration(pr.InitialDelaySeconds)*time.Second {
					nextReady = now.Add(probePeriod(pr))
					// Ready after successThreshold successes in a row,
					// unready after failureThreshold failures, as the
					// kubelet's prober counts.
					if err := p.probe(ctx, pr); err != nil {
						klog.FromContext(ctx).V(2).Info("Readiness probe failed", "err", err)
						readySuccesses, readyFailures = 0, readyFailures+1
						if readyFailures >= int(max(pr.FailureThreshold, 1)) {
							ready = false
						}
					} else {
						readySuccesses, readyFailures = readySuccesses+1, 0
						if readySuccesses >= int(max(pr.SuccessThreshold, 1)) {
							ready = true
						}
					}
				}
			}
			if p.ready.Swap(ready) != ready {
				p.report(ctx, podState{startedAt: started})
			}
		}
		if pr := c.LivenessProbe; pr != nil && now.After(nextLive) && now.Sub(started) >= time.Duration(pr.InitialDelaySeconds)*time.Second {
			nextLive = now.Add(probePeriod(pr))
			if err := p.probe(ctx, pr); err != nil {
				klog.FromContext(ctx).Info("Liveness probe failed", "err", err, "failures", liveFailures+1)
				liveFailures++
				if liveFailures >= int(max(pr.FailureThreshold, 1)) {
					return fmt.Errorf("liveness probe failed %d times: %w", liveFailures, err)
				}
			} else {
				liveFailures = 0
			}
		}
	}
}

// state is the container's pid and status, as runc state tells them.
func (p *Pod) state(ctx context.Context) (int, string, error) {
	p.mu.Lock()
	id := p.id
	p.mu.Unlock()
	out, err := exec.CommandContext(ctx, p.r.runc, "--root", filepath.Join(p.r.root, "state"), "state", id).Output()
	if err != nil {
		return 0, "gone", fmt.Errorf("runc state %s: %w", id, err)
	}
	var st struct {
		Pid    int    `json:"pid"`
		Status string `json:"status"`
	}
	if err := json.Unmarshal(out, &st); err != nil {
		return 0, "", fmt.Errorf("runc state %s: %w", id, err)
	}
	return st.Pid, st.Status, nil
}

// kill deletes the container, unmounts its root and removes its bundle.
func (p *Pod) kill() {
	p.mu.Lock()
	id, l, cancel := p.id, p.apiListener, p.cancelContainer
	p.apiListener, p.cancelContainer = nil, nil
	p.mu.Unlock()
	if cancel != nil {
		cancel() // the container's forwarder
	}
	if l != nil {
		_ = l.Close()
	}
	if id == "" {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if out, err := exec.CommandContext(ctx, p.r.runc, "--root", filepath.Join(p.r.root, "state"), "delete", "--force", id).CombinedOutput(); err != nil &&
		!strings.Contains(string(out), "does not exist") {
		// Its root and bundle stay: the container may still run on them.
		klog.Background().Error(err, "runc delete", "container", id, "output", strings.TrimSpace(string(out)))
		return
	}
	bundle := filepath.Join(p.r.root, "bundles", id)
	_ = unix.Unmount(filepath.Join(bundle, "rootfs"), unix.MNT_DETACH)
	_ = os.RemoveAll(bundle)
	_ = os.Remove(filepath.Join("/sys/fs/cgroup/devcluster-image", id))
}

func (p *Pod) logPath() string {
	return filepath.Join(p.r.root, "logs", p.pod.Namespace+"_"+p.pod.Name+".log")
}

// logTail is the end of the container's output, for its status message.
func (p *Pod) logTail() string {
	b, _ := os.ReadFile(p.logPath())
	if i := bytes.LastIndex(b, []byte("--- devcluster: container ")); i >= 0 {
		if j := bytes.IndexByte(b[i:], '\n'); j >= 0 {
			b = b[i+j+1:]
		}
	}
	return noderuntime.LastLines(string(b), 5)
}

// Process is the host PID of the container of a pod run from the image,
// and its log (every start of it): for tests, which read what runs.
func (r *Runner) Process(namespace, name string) (pid int, logPath string, err error) {
	r.mu.Lock()
	p := r.pods[namespace+"/"+name]
	r.mu.Unlock()
	if p == nil {
		return 0, "", fmt.Errorf("no pod %s/%s runs from the image", namespace, name)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.pid, p.logPath(), nil
}

// Logs are the logs of every pod run from the image, by pod.
func (r *Runner) Logs() map[string]string {
	out := map[string]string{}
	r.mu.Lock()
	defer r.mu.Unlock()
	for k, p := range r.pods {
		out[k] = p.logPath()
	}
	return out
}
