// Package controller is gpudra-controller: the cluster side of gpudra. Every
// replica serves the admission webhook; the leader, elected on a Lease, runs
// the controllers (Grove sharing groups) and the webhook's certificate
// manager, so that nothing is done, or reported, twice.
package controller

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/events"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/allocator"
	"github.com/gpudra/gpudra/pkg/controller/gang"
	"github.com/gpudra/gpudra/pkg/controller/grove"
	"github.com/gpudra/gpudra/pkg/metrics"
	"github.com/gpudra/gpudra/pkg/webhook"
)

// EventsReportingController is the reportingController of the
// controller's Events.
const EventsReportingController = "gpu.gpudra.dev/controller"

// Config is what Run needs; cmd/controller fills it from flags, devcluster
// directly.
type Config struct {
	// RESTConfig is the API client's configuration (QPS and burst set).
	RESTConfig *rest.Config
	// Client, when set, is used instead of one made from RESTConfig.
	Client kubernetes.Interface
	// Namespace is where the Lease and the certificate Secret are.
	Namespace string
	// Identity names this replica in the Lease (pod name).
	Identity string
	// LeaseName, and the leader election's timing (zero: 15 s, 10 s, 2 s,
	// kube-controller-manager's defaults).
	LeaseName                                 string
	LeaseDuration, RenewDeadline, RetryPeriod time.Duration
	// HealthAddress serves /healthz, /readyz and /metrics; empty: none.
	HealthAddress string
	// Webhook: the listener (or address, when Listener is nil) it serves
	// on; empty address and no listener: no webhook.
	WebhookAddress  string
	WebhookListener net.Listener
	// WebhookSecret holds the serving certificate; WebhookConfiguration is
	// the ValidatingWebhookConfiguration whose caBundle the leader keeps.
	WebhookSecret, WebhookConfiguration string
	// ManageCertificates: the leader issues and renews the certificate
	// (false with cert-manager). WebhookDNSNames and WebhookIPs are what it
	// is issued for; CAValidity and CertValidity its lifetimes (zero: the
	// CertManager's defaults).
	ManageCertificates       bool
	WebhookDNSNames          []string
	WebhookIPs               []net.IP
	CAValidity, CertValidity time.Duration
	// CertReloadPeriod: how often every replica re-reads the Secret (zero:
	// 30 s).
	CertReloadPeriod time.Duration
	// GrovePendingGrace is how long a sharing group's consumer may stay
	// Pending on its claim before it is reported (zero: the grove
	// controller's default).
	GrovePendingGrace time.Duration
	// Gangs runs the gang and reservation controller (pkg/controller/gang)
	// on the path GangMode decides (gangpath.go): auto (default),
	// workload, gates or off.
	Gangs    bool
	GangMode string
	// GangStrategy orders candidate nodes for gangs and reservations
	// (empty: FewestNVLinkDomains); FenceSettle is how long a device
	// fence is given to reach the scheduler (zero: 1 s).
	GangStrategy allocator.Strategy
	FenceSettle  time.Duration
	// NodePoolLabels are the node labels naming a node's pool, tried in
	// order, for the per-pool device counts and demand (nil: the gang
	// controller's defaults).
	NodePoolLabels []string
	// AutoscalerDemand: the gang controller publishes the demand of gangs
	// and reservations waiting for devices as CapacityBuffers
	// (gang.AutoscalerDemandCapacityBuffers, the default, where they are
	// served) or not (gang.AutoscalerDemandOff).
	AutoscalerDemand string
	// ProtectNodes: the leader keeps autoscalers (Karpenter, Cluster
	// Autoscaler) off nodes that hold gpudra devices in use, with node
	// annotations (pkg/controller/nodehold). Off, it removes the marks it
	// set before, once.
	ProtectNodes bool
	// Metadata, when set, is used instead of a metadata client made from
	// RESTConfig (nodes, metadata only).
	Metadata metadata.Interface
	// Registry receives the metrics; nil: a new one.
	Registry *prometheus.Registry
}

func (c *Config) defaults() {
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	def(&c.LeaseDuration, 15*time.Second)
	def(&c.RenewDeadline, 10*time.Second)
	def(&c.RetryPeriod, 2*time.Second)
	def(&c.CertReloadPeriod, 30*time.Second)
	if c.LeaseName == "" {
		c.LeaseName = "gpudra-controller"
	}
	if c.Registry == nil {
		c.Registry = metrics.NewRegistry(metrics.ComponentController)
	}
}

func (c *Config) validate() error {
	var errs []error
	if c.RESTConfig == nil && c.Client == nil {
		errs = append(errs, errors.New("no API client configuration"))
	}
	if c.Namespace == "" {
		errs = append(errs, errors.New("no namespace"))
	}
	if c.Identity == "" {
		errs = append(errs, errors.New("no identity"))
	}
	if c.serveWebhook() && c.WebhookSecret == "" {
		errs = append(errs, errors.New("the webhook needs its certificate Secret"))
	}
	return errors.Join(errs...)
}

func (c *Config) serveWebhook() bool { return c.WebhookListener != nil || c.WebhookAddress != "" }

// Run runs the controller until ctx ends or something fatal happens; it
// returns the cause. A replica that loses the lease returns an error
// (its leader-only work may not be stopped in time): restarted, it joins
// again as a follower.
func Run(ctx context.Context, cfg Config) error {
	cfg.defaults()
	if err := cfg.validate(); err != nil {
		return fmt.Errorf("controller: %w", err)
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	logger := klog.FromContext(ctx).WithValues("identity", cfg.Identity)
	ctx = klog.NewContext(ctx, logger)
	client := cfg.Client
	if client == nil {
		var err error
		if client, err = kubernetes.NewForConfig(cfg.RESTConfig); err != nil {
			return fmt.Errorf("API client: %w", err)
		}
	}
	m := newMetrics(cfg.Registry)

	b := events.NewBroadcaster(&events.EventSinkImpl{Interface: client.EventsV1()})
	if err := b.StartRecordingToSinkWithContext(ctx); err != nil {
		return fmt.Errorf("start recording Events: %w", err)
	}
	defer b.Shutdown()
	recorder := b.NewRecorder(scheme.Scheme, EventsReportingController)

	h := &health{}
	// Every replica decides the gang path from discovery, before it
	// serves: its webhook gates gang pods only on the gate path.
	var paths *gangPathWatcher
	if cfg.Gangs {
		var err error
		if paths, err = newGangPathWatcher(cfg.GangMode, client.Discovery(), cfg.Registry); err != nil {
			return err
		}
		paths.check(ctx)
		go paths.Run(ctx)
	}
	var certs *webhook.CertLoader
	if cfg.serveWebhook() {
		certs = &webhook.CertLoader{Client: client, Namespace: cfg.Namespace, Secret: cfg.WebhookSecret}
		h.ready = certs.Ready
		l := cfg.WebhookListener
		if l == nil {
			var err error
			if l, err = net.Listen("tcp", cfg.WebhookAddress); err != nil {
				return fmt.Errorf("webhook listener: %w", err)
			}
		}
		go certs.Run(ctx, cfg.CertReloadPeriod)
		go func() {
			handler := webhook.NewHandler(cfg.Registry)
			handler.GangPath = func() string {
				if paths == nil {
					return GangPathOff
				}
				return paths.Path()
			}
			if paths != nil {
				handler.GangMembers = watchGangMembers(ctx, client)
				handler.PodGroupGang = podGroupGang(client)
			}
			if err := webhook.Serve(ctx, l, certs, handler); err != nil {
				cancel(err)
			}
		}()
	}

	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1ObjectMeta(cfg.Namespace, cfg.LeaseName),
		Client:     client.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: cfg.Identity},
	}
	leaderWork := func(ctx context.Context) {
		m.leader.Set(1)
		defer m.leader.Set(0)
		logger.Info("Became leader")
		if err := runLeader(ctx, cfg, client, recorder, certs, paths); err != nil {
			cancel(err)
		}
	}
	le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
		Lock: lock, Name: cfg.LeaseName,
		LeaseDuration: cfg.LeaseDuration, RenewDeadline: cfg.RenewDeadline, RetryPeriod: cfg.RetryPeriod,
		// A replica that stops gives the lease up at once, so that a
		// rolling update does not wait out the lease.
		ReleaseOnCancel: true,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: leaderWork,
			OnStoppedLeading: func() {
				if ctx.Err() == nil {
					cancel(errors.New("lost the leader lease"))
				}
			},
			OnNewLeader: func(id string) { logger.V(1).Info("Leader", "leader", id) },
		},
	})
	if err != nil {
		return fmt.Errorf("leader election: %w", err)
	}
	h.leader = le
	if cfg.HealthAddress != "" {
		go func() {
			if err := metrics.Serve(ctx, cfg.HealthAddress, h.mux(metrics.Handler(cfg.Registry))); err != nil {
				cancel(err)
			}
		}()
	}
	logger.Info("gpudra controller running", "namespace", cfg.Namespace, "webhook", cfg.serveWebhook())
	le.Run(ctx)
	if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, context.Canceled) {
		return cause
	}
	return nil
}

// runLeader runs the leader-only work until ctx ends; the first fatal
// error stops all of it.
func runLeader(ctx context.Context, cfg Config, client kubernetes.Interface, recorder events.EventRecorder, certs *webhook.CertLoader, paths *gangPathWatcher) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	g, err := grove.New(grove.Options{Client: client, Recorder: recorder, Registerer: cfg.Registry, PendingGrace: cfg.GrovePendingGrace})
	if err != nil {
		return fmt.Errorf("grove controller: %w", err)
	}
	var wg wait.Group
	wg.StartWithContext(ctx, func(ctx context.Context) {
		if err := g.Run(ctx); err != nil {
			cancel(fmt.Errorf("grove controller: %w", err))
		}
	})
	plans := &gangPlans{}
	if err := startNodeHold(ctx, &wg, cfg, client, plans, cancel); err != nil {
		return err
	}
	if paths != nil {
		wg.StartWithContext(ctx, func(ctx context.Context) {
			if err := runGangs(ctx, cfg, client, recorder, paths, plans); err != nil {
				cancel(fmt.Errorf("gang controller: %w", err))
			}
		})
	}
	if cfg.ManageCertificates && certs != nil {
		cm := &webhook.CertManager{Client: client, Namespace: cfg.Namespace, Secret: cfg.WebhookSecret, WebhookConfiguration: cfg.WebhookConfiguration,
			// The chart and devcluster give both configurations one name.
			MutatingWebhookConfiguration: cfg.WebhookConfiguration,
			DNSNames:                     cfg.WebhookDNSNames, IPs: cfg.WebhookIPs, CAValidity: cfg.CAValidity, CertValidity: cfg.CertValidity, Recorder: recorder}
		wg.StartWithContext(ctx, func(ctx context.Context) {
			_ = cm.Run(ctx, 30*time.Second)
		})
		// Replicas poll the Secret; the leader, which just wrote it, loads
		// it at once so that a new cluster is ready within seconds.
		wg.StartWithContext(ctx, func(ctx context.Context) {
			_ = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
				return certs.Load(ctx) == nil, nil
			})
		})
	}
	<-ctx.Done()
	wg.Wait()
	if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, context.Canceled) {
		return cause
	}
	return nil
}

// runGangs runs the gang path the watcher decides, again at each change:
// on the Workload API and gate paths the gang and reservation controller,
// handing gangs over the path's way; with gangs off, a
// release of every pod a stale view gated (now, and once more after every
// replica has asked discovery again).
func runGangs(ctx context.Context, cfg Config, client kubernetes.Interface, recorder events.EventRecorder, paths *gangPathWatcher, plans *gangPlans) error {
	logger := klog.FromContext(ctx)
	for ctx.Err() == nil {
		p, changed := paths.current()
		switch p.Path {
		case "":
			// Not decided: discovery has not yet answered. Nothing is
			// released on "could not tell".
			select {
			case <-changed:
			case <-ctx.Done():
			}
		case GangPathGates, GangPathWorkload:
			gc, err := newGangController(cfg, client, recorder, p, plans.kick)
			if err != nil {
				return err
			}
			plans.set(gc)
			sub, stop := context.WithCancel(ctx)
			if p.Path == GangPathWorkload {
				// Pods gated on the gate path before (or by a replica
				// with the old view) would wait for ever: the Workload
				// API path lifts no gate. Released now, and once more
				// after every replica has asked discovery again.
				go func() {
					why := "gangs moved to the Workload API path; a pod gated before schedules as a plain pod"
					releaseGated(sub, client, recorder, why)
					select {
					case <-time.After(2 * gangPathCheckEvery):
						releaseGated(sub, client, recorder, why)
					case <-sub.Done():
					}
				}()
			}
			go func() {
				select {
				case <-changed:
				case <-sub.Done():
				}
				stop()
			}()
			err = gc.Run(sub)
			stop()
			plans.set(nil)
			// Stopped for a new path (caches that had not synced yet say
			// so as an error): go on with that path.
			if err != nil && ctx.Err() == nil && !isClosed(changed) {
				return err
			}
		default:
			logger.Info("Gangs off", "reason", p.Reason)
			releaseGated(ctx, client, recorder, p.Reason)
			// Once more after every replica has asked discovery again: a
			// replica with the old view may have gated pods meanwhile.
			select {
			case <-time.After(2 * gangPathCheckEvery):
				releaseGated(ctx, client, recorder, p.Reason)
				select {
				case <-changed:
				case <-ctx.Done():
				}
			case <-changed:
			case <-ctx.Done():
			}
		}
	}
	return nil
}

// releaseGated releases the pods that carry gpudra's gate where gangs are
// off, and logs what it did.
func releaseGated(ctx context.Context, client kubernetes.Interface, recorder events.EventRecorder, why string) {
	if n, err := gang.ReleaseGated(ctx, client, recorder, why); err != nil || n > 0 {
		klog.FromContext(ctx).Info("Released gated gang pods: gangs are off", "released", n, "err", err)
	}
}

func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// newGangController returns the gang and reservation controller.
func newGangController(cfg Config, client kubernetes.Interface, recorder events.EventRecorder, p gangPath, handedOff func()) (*gang.Controller, error) {
	if cfg.RESTConfig == nil {
		return nil, errors.New("gang and reservation controller: it needs a REST configuration for its dynamic client")
	}
	dyn, err := dynamic.NewForConfig(cfg.RESTConfig)
	if err != nil {
		return nil, fmt.Errorf("dynamic client: %w", err)
	}
	return gang.New(gang.Options{Client: client, Dynamic: dyn, Recorder: recorder, Registerer: cfg.Registry,
		Strategy: cfg.GangStrategy, FenceSettle: cfg.FenceSettle, Grove: p.Grove, Path: p.Path, NodePoolLabels: cfg.NodePoolLabels,
		AutoscalerDemand: cfg.AutoscalerDemand, HandedOff: handedOff})
}

// health serves /healthz (the process and, on the leader, its lease) and
// /readyz (the webhook can serve: a valid certificate is loaded).
type health struct {
	leader *leaderelection.LeaderElector
	ready  func() error
}

func (h *health) mux(metricsHandler http.Handler) *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle("/metrics", metricsHandler)
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		// A leader that could not renew its lease for too long is stuck:
		// the liveness probe restarts it.
		if h.leader != nil {
			if err := h.leader.Check(20 * time.Second); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
		}
		_, _ = w.Write([]byte("ok"))
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
		if h.ready != nil {
			if err := h.ready(); err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
		}
		_, _ = w.Write([]byte("ok"))
	})
	return mux
}
