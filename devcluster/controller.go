package devcluster

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	gpudraapi "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/devcluster/noderuntime"
	"github.com/gpudra/gpudra/pkg/controller"
	"github.com/gpudra/gpudra/pkg/webhook"
)

// The gpudra controller in devcluster: two replicas, as the chart runs, in
// the plugins' namespace, with the chart's names.
const (
	ControllerLease          = "gpudra-controller"
	WebhookSecret            = "gpudra-webhook-cert"
	WebhookConfigurationName = "gpudra-webhook"
	controllerReplicas       = 2
)

// Leader election timing in devcluster: shorter than the chart's 15 s, so
// that failover tests finish quickly; the same ratios.
var (
	ControllerLeaseDuration = 4 * time.Second
	controllerRenewDeadline = 3 * time.Second
	controllerRetryPeriod   = 500 * time.Millisecond
)

// Controller is one replica of gpudra-controller running in-process.
type Controller struct {
	Name string
	// Addr is where its webhook listens.
	Addr   string
	cancel context.CancelFunc
	done   chan error
	// ready: its webhook serves TLS, what the chart's readiness probe
	// (/readyz) reports; the front sends connections only to ready
	// replicas, as a Service's endpoints hold only ready pods.
	ready atomic.Bool
	// dial reaches its webhook where Addr does not: a pod run from the
	// image listens in its own network namespace (imagechart.go).
	dial func(context.Context) (net.Conn, error)
	// isReady, when set, is its readiness instead of ready: the pod's
	// readiness probe.
	isReady func() bool
}

func (r *Controller) serving() bool {
	if r.isReady != nil {
		return r.isReady()
	}
	return r.ready.Load()
}

// Stop stops the replica, as a deleted pod stops (the lease is given up),
// and returns what Run returned.
// GrovePendingGrace is the controller's grace for Pending sharing-group
// consumers in devcluster: short, so that the e2e suite sees the report.
const GrovePendingGrace = 5 * time.Second

// FenceSettle is the controller's device fence settle time in devcluster,
// where the scheduler's informer sees a DeviceTaintRule within
// milliseconds.
const FenceSettle = 300 * time.Millisecond

func (r *Controller) Stop() error {
	r.cancel()
	return <-r.done
}

// controllers are the replicas and the stand-in for the webhook's Service:
// devcluster has no Service networking, so the API server calls
// https://127.0.0.1:<port>/validate (and /mutate), a TCP front that forwards
// each connection to a running replica, as kube-proxy would.
type controllers struct {
	front    net.Listener
	mu       sync.Mutex
	replicas []*Controller
	next     int
	// gangMode is the replicas' --gang-mode (empty: auto); generation
	// names the replicas SetGangMode starts.
	gangMode   string
	generation int
	down       bool
	// discoveryOutage is the group version ("resource.k8s.io/v1") whose
	// discovery every replica's client is refused with a 503 (empty: none).
	discoveryOutage string
	// conns are the open front connections: an outage ends them too, or
	// the API server would go on using its kept-alive connections.
	conns map[net.Conn]struct{}
	// serverName is the name the API server checks the webhook's
	// certificate for: 127.0.0.1 (the in-process replicas' URL), or the
	// Service's DNS name (the chart's pods run from the image).
	serverName string
}

// startGpudraController registers the webhook and starts the replicas; it
// returns once the webhook serves with the caBundle the API server has.
func (c *Cluster) startGpudraController(ctx context.Context) error {
	var err error
	c.gpudra = &controllers{serverName: "127.0.0.1"}
	if c.gpudra.front, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
		return fmt.Errorf("webhook front: %w", err)
	}
	go c.gpudra.serve()
	cfg := webhook.Configuration(WebhookConfigurationName, admissionregistrationv1.WebhookClientConfig{
		URL: ptr.To("https://" + c.gpudra.front.Addr().String() + webhook.Path)}, true)
	if _, err := c.Client.AdmissionregistrationV1().ValidatingWebhookConfigurations().Create(ctx, cfg, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create ValidatingWebhookConfiguration: %w", err)
	}
	// The gang pods' gate, through the same front at /mutate, under the
	// same name (as the chart names both); its caBundle is kept by the
	// leader too.
	mutating := webhook.MutatingConfiguration(WebhookConfigurationName, admissionregistrationv1.WebhookClientConfig{
		URL: ptr.To("https://" + c.gpudra.front.Addr().String() + webhook.MutatePath)})
	if _, err := c.Client.AdmissionregistrationV1().MutatingWebhookConfigurations().Create(ctx, mutating, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create MutatingWebhookConfiguration: %w", err)
	}
	for i := range controllerReplicas {
		if _, err := c.StartController(fmt.Sprintf("gpudra-controller-%d", i)); err != nil {
			return err
		}
	}
	if err := c.WaitForWebhook(ctx, 30*time.Second); err != nil {
		return err
	}
	return c.waitGangPathDecided(ctx)
}

// waitGangPathDecided waits until the replicas' webhook admits a gang pod
// (a server-side dry run): until a replica's API discovery has answered, it
// refuses gang pods ("cannot tell yet"), as a real rollout's first seconds
// would. It does not wait during a discovery outage the caller made.
func (c *Cluster) waitGangPathDecided(ctx context.Context) error {
	c.gpudra.mu.Lock()
	outage := c.gpudra.discoveryOutage
	c.gpudra.mu.Unlock()
	if outage != "" {
		return nil
	}
	probe := &v1.Pod{ObjectMeta: metav1.ObjectMeta{GenerateName: "gang-path-probe-", Namespace: metav1.NamespaceDefault,
		Labels: map[string]string{gpudraapi.LabelGang: "gang-path-probe"}, Annotations: map[string]string{gpudraapi.AnnotationGangSize: "1"}},
		Spec: v1.PodSpec{Containers: []v1.Container{{Name: "c", Image: "probe"}}}}
	var last error
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, last = c.Client.CoreV1().Pods(metav1.NamespaceDefault).Create(ctx, probe, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return last == nil || !strings.Contains(last.Error(), "cannot tell yet"), nil
	})
	if err != nil {
		return fmt.Errorf("gpudra-controller's gang path not decided: %w (last answer: %v)", err, last)
	}
	return nil
}

// StartController starts one more replica under the given name.
func (c *Cluster) StartController(name string) (*Controller, error) {
	if c.image != nil {
		return nil, errors.New("image mode: the controller is the chart's Deployment, run from the image; no replica runs in this process")
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("webhook listener: %w", err)
	}
	// A client of its own, at the controller's default limits, as the
	// chart's ServiceAccount.
	rc, err := c.componentConfig(c.ctx, chart.ControllerServiceAccount, "gpudra-controller/"+name, nil)
	if err != nil {
		_ = l.Close()
		return nil, err
	}
	rc.QPS, rc.Burst = 20, 30
	rc.Wrap(func(rt http.RoundTripper) http.RoundTripper { return discoveryOutage{next: rt, c: c.gpudra} })
	c.gpudra.mu.Lock()
	gangMode := c.gpudra.gangMode
	c.gpudra.mu.Unlock()
	ctx, cancel := context.WithCancel(klog.NewContext(c.ctx, klog.FromContext(c.ctx).WithName(name)))
	r := &Controller{Name: name, Addr: l.Addr().String(), cancel: cancel, done: make(chan error, 1)}
	go func() {
		r.done <- controller.Run(ctx, controller.Config{RESTConfig: rc, Namespace: chart.PluginNamespace, Identity: name,
			LeaseName: ControllerLease, LeaseDuration: ControllerLeaseDuration, RenewDeadline: controllerRenewDeadline, RetryPeriod: controllerRetryPeriod,
			WebhookListener: l, WebhookSecret: WebhookSecret, WebhookConfiguration: WebhookConfigurationName, ManageCertificates: true,
			WebhookIPs: []net.IP{net.ParseIP("127.0.0.1")}, CertReloadPeriod: time.Second, GrovePendingGrace: GrovePendingGrace,
			Gangs: true, GangMode: gangMode, FenceSettle: FenceSettle, ProtectNodes: true})
	}()
	go func() {
		_ = wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(context.Context) (bool, error) {
			// The handshake only: whether the certificate is trusted is
			// the API server's question (WaitForWebhook asks it).
			conn, err := tls.Dial("tcp", r.Addr, &tls.Config{InsecureSkipVerify: true}) //nolint:gosec
			if err != nil {
				return false, nil
			}
			_ = conn.Close()
			r.ready.Store(true)
			return true, nil
		})
	}()
	c.gpudra.mu.Lock()
	c.gpudra.replicas = append(c.gpudra.replicas, r)
	c.gpudra.mu.Unlock()
	return r, nil
}

// Controllers returns the running replicas.
func (c *Cluster) Controllers() []*Controller {
	c.gpudra.mu.Lock()
	defer c.gpudra.mu.Unlock()
	return append([]*Controller(nil), c.gpudra.replicas...)
}

// StopController stops a replica and forgets it.
func (c *Cluster) StopController(r *Controller) error {
	c.gpudra.mu.Lock()
	for i, x := range c.gpudra.replicas {
		if x == r {
			c.gpudra.replicas = append(c.gpudra.replicas[:i], c.gpudra.replicas[i+1:]...)
			break
		}
	}
	c.gpudra.mu.Unlock()
	return r.Stop()
}

// SetGangMode replaces every replica by one running with --gang-mode mode
// (auto, gates or off), as a chart upgrade that changes gangs.mode rolls
// the Deployment, and waits until the new ones serve the webhook.
func (c *Cluster) SetGangMode(ctx context.Context, mode string) error {
	if c.image != nil {
		return errors.New("image mode: the gang mode is the chart's gangs.mode value")
	}
	old := c.Controllers()
	c.gpudra.mu.Lock()
	c.gpudra.gangMode = mode
	c.gpudra.mu.Unlock()
	for _, r := range old {
		if err := c.StopController(r); err != nil {
			return fmt.Errorf("stop %s: %w", r.Name, err)
		}
	}
	for i := range controllerReplicas {
		c.gpudra.mu.Lock()
		c.gpudra.generation++
		name := fmt.Sprintf("gpudra-controller-%d-%d", i, c.gpudra.generation)
		c.gpudra.mu.Unlock()
		if _, err := c.StartController(name); err != nil {
			return err
		}
	}
	if err := c.WaitForWebhook(ctx, 30*time.Second); err != nil {
		return err
	}
	return c.waitGangPathDecided(ctx)
}

// SetDiscoveryOutage makes every replica's API discovery of the group
// version (for example "resource.k8s.io/v1") fail with 503 Service
// Unavailable, as an API server restart or an overloaded aggregation layer
// does, until it is called with "". Every other request goes through.
func (c *Cluster) SetDiscoveryOutage(groupVersion string) {
	c.gpudra.mu.Lock()
	defer c.gpudra.mu.Unlock()
	c.gpudra.discoveryOutage = groupVersion
}

// discoveryOutage answers the discovery of the group version in outage
// with a 503.
type discoveryOutage struct {
	next http.RoundTripper
	c    *controllers
}

func (d discoveryOutage) RoundTrip(req *http.Request) (*http.Response, error) {
	d.c.mu.Lock()
	gv := d.c.discoveryOutage
	d.c.mu.Unlock()
	if gv != "" && req.Method == http.MethodGet && strings.TrimSuffix(req.URL.Path, "/") == "/apis/"+gv {
		body := `{"kind":"Status","apiVersion":"v1","status":"Failure","message":"devcluster: discovery outage","reason":"ServiceUnavailable","code":503}`
		return &http.Response{StatusCode: http.StatusServiceUnavailable, Status: "503 Service Unavailable", Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
			Header: http.Header{"Content-Type": []string{"application/json"}}, Body: io.NopCloser(strings.NewReader(body)),
			ContentLength: int64(len(body)), Request: req}, nil
	}
	return d.next.RoundTrip(req)
}

// SetWebhookDown makes the webhook unreachable (every connection refused
// at once) or reachable again, as an outage of all replicas would.
func (c *Cluster) SetWebhookDown(down bool) {
	c.gpudra.mu.Lock()
	defer c.gpudra.mu.Unlock()
	c.gpudra.down = down
	if down {
		for conn := range c.gpudra.conns {
			_ = conn.Close()
		}
	}
}

// WaitForWebhook waits until the webhook answers TLS with a certificate
// that the caBundles of the Validating and (where there is one) the
// MutatingWebhookConfiguration trust, which is what the API server checks.
func (c *Cluster) WaitForWebhook(ctx context.Context, timeout time.Duration) error {
	var last error
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		last = c.webhookTrusted(ctx)
		return last == nil, nil
	})
	if err != nil {
		return fmt.Errorf("webhook not ready after %s: %w", timeout, errors.Join(err, last))
	}
	return nil
}

func (c *Cluster) webhookTrusted(ctx context.Context) error {
	cfg, err := c.Client.AdmissionregistrationV1().ValidatingWebhookConfigurations().Get(ctx, WebhookConfigurationName, metav1.GetOptions{})
	if err != nil {
		return err
	}
	if len(cfg.Webhooks) == 0 {
		return errors.New("no webhooks in the ValidatingWebhookConfiguration")
	}
	if err := c.frontTrusted(cfg.Webhooks[0].ClientConfig.CABundle); err != nil {
		return fmt.Errorf("ValidatingWebhookConfiguration: %w", err)
	}
	// Tests may delete the mutating configuration (or run without it).
	mutating, err := c.Client.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, WebhookConfigurationName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	for _, w := range mutating.Webhooks {
		if err := c.frontTrusted(w.ClientConfig.CABundle); err != nil {
			return fmt.Errorf("MutatingWebhookConfiguration: %w", err)
		}
	}
	return nil
}

// frontTrusted says whether the front serves a certificate bundle trusts.
func (c *Cluster) frontTrusted(bundle []byte) error {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(bundle) {
		return errors.New("no caBundle yet")
	}
	// The front may be on the pod network (image mode), which this
	// process reaches as the API server does.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var raw net.Conn
	var err error
	if addr := c.gpudra.front.Addr().String(); c.podNet != nil {
		raw, err = c.podNet.Dial(ctx, addr)
	} else {
		var d net.Dialer
		raw, err = d.DialContext(ctx, "tcp", addr)
	}
	if err != nil {
		return err
	}
	conn := tls.Client(raw, &tls.Config{RootCAs: pool, ServerName: c.gpudra.serverName})
	defer conn.Close()
	return conn.HandshakeContext(ctx)
}

// stop stops every replica and the front.
func (s *controllers) stop() {
	if s == nil {
		return
	}
	s.mu.Lock()
	replicas := s.replicas
	s.replicas = nil
	s.mu.Unlock()
	for _, r := range replicas {
		r.cancel()
	}
	for _, r := range replicas {
		select {
		case <-r.done:
		case <-time.After(10 * time.Second):
		}
	}
	if s.front != nil {
		_ = s.front.Close()
	}
}

// pick chooses a replica round-robin for conn; nil when the webhook is
// down.
func (s *controllers) pick(conn net.Conn) *Controller {
	s.mu.Lock()
	defer s.mu.Unlock()
	var ready []*Controller
	for _, r := range s.replicas {
		if r.serving() {
			ready = append(ready, r)
		}
	}
	if s.down || len(ready) == 0 {
		return nil
	}
	if s.conns == nil {
		s.conns = map[net.Conn]struct{}{}
	}
	s.conns[conn] = struct{}{}
	s.next++
	return ready[s.next%len(ready)]
}

func (s *controllers) serve() {
	for {
		conn, err := s.front.Accept()
		if err != nil {
			return
		}
		go func() {
			defer func() {
				s.mu.Lock()
				delete(s.conns, conn)
				s.mu.Unlock()
				_ = conn.Close()
			}()
			r := s.pick(conn)
			if r == nil {
				return
			}
			dial := r.dial
			if dial == nil {
				dial = func(ctx context.Context) (net.Conn, error) {
					var d net.Dialer
					return d.DialContext(ctx, "tcp", r.Addr)
				}
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			back, err := dial(ctx)
			cancel()
			if err != nil {
				return
			}
			defer back.Close()
			go func() {
				_, _ = io.Copy(back, conn)
				noderuntime.CloseWrite(back)
			}()
			_, _ = io.Copy(conn, back)
		}()
	}
}
