package controller

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/discovery"
	"k8s.io/klog/v2"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/controller/gang"
	"github.com/gpudra/gpudra/pkg/webhook"
)

// Gang modes (--gang-mode, chart gangs.mode): which path hands gangs to
// the scheduler.
const (
	// GangModeAuto takes the Workload API path where the API server serves
	// scheduling.k8s.io/v1beta1 PodGroups, the gate path where it serves
	// resource.k8s.io/v1 DeviceTaintRules, and turns gangs off otherwise.
	GangModeAuto = "auto"
	// GangModeWorkload is kube-scheduler's own gang scheduling: each gang
	// is a Workload with a gang PodGroup, created when its queue hands it
	// over; the scheduler places all of its pods or none. Off where
	// PodGroups are not served.
	GangModeWorkload = "workload"
	// GangModeGates is the gate path: a scheduling gate on gang pods, lifted
	// once the controller allocated the whole gang behind a DeviceTaintRule
	// fence. Off where DeviceTaintRules are not served.
	GangModeGates = "gates"
	// GangModeOff: no gate; gang pods schedule as plain pods.
	GangModeOff = "off"
)

// Gang paths: what a mode comes to on this cluster.
const (
	GangPathWorkload = webhook.GangPathWorkload
	GangPathGates    = webhook.GangPathGates
	GangPathOff      = "off"
)

// gangPaths are the paths, as the metric lists them.
var gangPaths = []string{GangPathWorkload, GangPathGates, GangPathOff}

// gangPathCheckEvery is how often every replica asks discovery again: a
// cluster upgraded to serve DeviceTaintRules, or CRDs installed later, take
// effect without a restart.
var gangPathCheckEvery = time.Minute

// served is what discovery says the API server serves, of what gangs need.
type served struct {
	// PodGroups: scheduling.k8s.io/v1beta1 Workloads and PodGroups
	// (Kubernetes 1.37 with the GenericWorkload gate).
	PodGroups bool
	// TaintRules: resource.k8s.io/v1 DeviceTaintRules (Kubernetes 1.37).
	TaintRules bool
	// CRDs: gpudra.dev GpuReservations and GpuQueues.
	CRDs bool
	// Grove: Grove's PodGangs.
	Grove bool
}

// gangPath is the decision, and why.
type gangPath struct {
	Path, Reason string
	// Grove: watch Grove's PodGangs (a change restarts the gang controller).
	Grove bool
}

// decideGangPath is the pure decision of a mode on a cluster.
func decideGangPath(mode string, s served) gangPath {
	switch {
	case mode == GangModeOff:
		return gangPath{Path: GangPathOff, Reason: "gangs.mode is off"}
	case !s.CRDs:
		return gangPath{Path: GangPathOff, Reason: "the gpudra.dev CRDs (GpuReservation, GpuQueue) are not installed; the chart installs them"}
	case mode == GangModeWorkload && !s.PodGroups:
		return gangPath{Path: GangPathOff, Reason: "gangs.mode is workload but the API server does not serve scheduling.k8s.io/v1beta1 PodGroups " +
			"(Kubernetes 1.37 with the GenericWorkload feature gate and --runtime-config=scheduling.k8s.io/v1beta1=true): gang pods schedule as plain pods"}
	case (mode == GangModeWorkload || mode == GangModeAuto) && s.PodGroups:
		return gangPath{Path: GangPathWorkload, Reason: "scheduling.k8s.io/v1beta1 PodGroups are served: each gang is handed to kube-scheduler as a gang PodGroup, which it places whole",
			Grove: s.Grove}
	case !s.TaintRules:
		return gangPath{Path: GangPathOff, Reason: "the API server does not serve resource.k8s.io/v1 DeviceTaintRules (Kubernetes 1.37 or later), " +
			"which the gate path fences devices with: gang pods are not gated and schedule as plain pods"}
	}
	return gangPath{Path: GangPathGates, Reason: "DeviceTaintRules are served: gang pods are gated and allocated whole behind a fence", Grove: s.Grove}
}

// discover asks the API server what it serves. A group version the
// server says it does not have (404) is absent; any other failure (a 500,
// a 429, a timeout, a refused connection) means discovery could not tell,
// and is returned as an error: "could not tell" is never "absent".
func discover(disc discovery.DiscoveryInterface) (served, error) {
	var errs []error
	has := func(gv schema.GroupVersion, resource string) bool {
		list, err := disc.ServerResourcesForGroupVersion(gv.String())
		switch {
		case apierrors.IsNotFound(err):
			return false
		case err != nil:
			errs = append(errs, fmt.Errorf("discovery of %s: %w", gv, err))
			return false
		}
		return slices.ContainsFunc(list.APIResources, func(r metav1.APIResource) bool { return r.Name == resource })
	}
	s := served{
		PodGroups: has(schema.GroupVersion{Group: "scheduling.k8s.io", Version: "v1beta1"}, "podgroups") &&
			has(schema.GroupVersion{Group: "scheduling.k8s.io", Version: "v1beta1"}, "workloads"),
		TaintRules: has(schema.GroupVersion{Group: "resource.k8s.io", Version: "v1"}, "devicetaintrules"),
		CRDs:       has(gpudrav1.SchemeGroupVersion, gpudrav1.GpuReservations.Resource) && has(gpudrav1.SchemeGroupVersion, gpudrav1.GpuQueues.Resource),
		Grove:      has(gang.PodGangs.GroupVersion(), gang.PodGangs.Resource),
	}
	return s, errors.Join(errs...)
}

// leaveWorkingPathAfter is how many successful discoveries in a row must
// agree before a replica leaves a working path (workload or gates): one
// odd answer, an API server restarting behind a load balancer, must not
// release or strand a cluster's gangs.
const leaveWorkingPathAfter = 3

// gangPathRecheck is how soon a replica asks again while its decision is
// unsettled: discovery failed, or it is counting answers to leave a path.
var gangPathRecheck = 10 * time.Second

// gangPathWatcher keeps every replica's view of the gang path: the webhook
// gates gang pods only on the gate path, and the leader runs the gang
// controller or releases what a stale view gated.
type gangPathWatcher struct {
	mode   string
	disc   discovery.DiscoveryInterface
	metric *prometheus.GaugeVec

	failures prometheus.Counter

	mu      sync.Mutex
	cur     gangPath
	checked bool
	changed chan struct{} // closed and replaced at each change
	// pending is a decision that would leave a working path, and how
	// many successful discoveries in a row made it.
	pending      gangPath
	pendingSeen  int
	lastDiscover error
}

func newGangPathWatcher(mode string, disc discovery.DiscoveryInterface, reg prometheus.Registerer) (*gangPathWatcher, error) {
	switch mode {
	case "":
		mode = GangModeAuto
	case GangModeAuto, GangModeWorkload, GangModeGates, GangModeOff:
	default:
		return nil, fmt.Errorf("gang mode %q: want %s, %s, %s or %s", mode, GangModeAuto, GangModeWorkload, GangModeGates, GangModeOff)
	}
	w := &gangPathWatcher{mode: mode, disc: disc, changed: make(chan struct{}),
		metric: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "gpudra", Subsystem: "gang", Name: "path",
			Help: "The path that hands gangs to the scheduler on this cluster (1 for the current one): workload, gates, or off."}, []string{"path"})}
	w.failures = prometheus.NewCounter(prometheus.CounterOpts{Namespace: "gpudra", Subsystem: "gang", Name: "path_discovery_failures_total",
		Help: "API discovery calls for the gang path that could not tell whether an API is served (the path was kept)."})
	if reg != nil {
		for _, c := range []prometheus.Collector{w.metric, w.failures} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("gang path metric: %w", err)
			}
		}
	}
	return w, nil
}

// check asks discovery and records the decision; it logs a change. A
// discovery that could not tell keeps the last decision (none before the
// first success), and a working path is left only after
// leaveWorkingPathAfter successful discoveries in a row agree.
func (w *gangPathWatcher) check(ctx context.Context) {
	logger := klog.FromContext(ctx)
	s, err := discover(w.disc)
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.mode == GangModeOff {
		err = nil // off needs no answer from discovery
	}
	w.lastDiscover = err
	if err != nil {
		w.failures.Inc()
		logger.Error(err, "API discovery could not tell what is served: the gang path stays as it was", "path", w.cur.Path, "decided", w.checked)
		return
	}
	p := decideGangPath(w.mode, s)
	if w.checked && p == w.cur {
		w.pending, w.pendingSeen = gangPath{}, 0
		return
	}
	if w.checked && p.Path != w.cur.Path && (w.cur.Path == GangPathWorkload || w.cur.Path == GangPathGates) {
		if p != w.pending {
			w.pending, w.pendingSeen = p, 0
		}
		w.pendingSeen++
		if w.pendingSeen < leaveWorkingPathAfter {
			logger.Info("Discovery would leave the gang path; waiting for it to say so again", "path", w.cur.Path, "next", p.Path,
				"seen", w.pendingSeen, "of", leaveWorkingPathAfter, "reason", p.Reason)
			return
		}
	}
	w.pending, w.pendingSeen = gangPath{}, 0
	logger.Info("Gang path", "path", p.Path, "mode", w.mode, "reason", p.Reason, "grove", p.Grove)
	w.cur, w.checked = p, true
	for _, path := range gangPaths {
		v := 0.0
		if path == p.Path {
			v = 1
		}
		w.metric.WithLabelValues(path).Set(v)
	}
	close(w.changed)
	w.changed = make(chan struct{})
}

// unsettled: the last discovery failed, or a change is being confirmed.
func (w *gangPathWatcher) unsettled() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.lastDiscover != nil || w.pendingSeen > 0
}

// Run checks at once and then every gangPathCheckEvery until ctx ends,
// every gangPathRecheck while unsettled.
func (w *gangPathWatcher) Run(ctx context.Context) {
	for {
		w.check(ctx)
		every := gangPathCheckEvery
		if w.unsettled() {
			every = gangPathRecheck
		}
		select {
		case <-time.After(every):
		case <-ctx.Done():
			return
		}
	}
}

// current is the path and a channel closed when it changes.
func (w *gangPathWatcher) current() (gangPath, <-chan struct{}) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.cur, w.changed
}

// Path is the current path, for the webhook: "" until discovery has
// answered once, and the webhook then refuses gang pods with the reason
// (webhook.Handler): admitted unchanged they would schedule outside their
// gangs, and gated they might wait on a path nobody runs.
func (w *gangPathWatcher) Path() string {
	p, _ := w.current()
	return p.Path
}
