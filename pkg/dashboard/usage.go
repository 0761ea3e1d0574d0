package dashboard

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	promapi "github.com/prometheus/client_golang/api"
	promv1 "github.com/prometheus/client_golang/api/prometheus/v1"
	"github.com/prometheus/common/model"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/top"
)

// UsageReader reads the devices' live usage, per node name, for the
// nodes given (all it can find when nodes is empty). What it could not
// read is a note, never an empty reading: a node missing from the map
// has no usage shown, not zero.
type UsageReader interface {
	Read(ctx context.Context, nodes []string) (map[string]*top.Snapshot, []string)
}

// The chart's kubelet plugin pods (deployments/helm/gpudra/templates/
// kubeletplugin.yaml: gpudra.pluginSelector, the container port
// "metrics").
const (
	DefaultPluginSelector = "app.kubernetes.io/component=kubelet-plugin"
	DefaultPluginPortName = "metrics"
)

// PluginProxyUsage reads each kubelet plugin's own /metrics through the
// API server's pods proxy, with the user's credentials: a person who may
// proxy to the plugin pods, and whom RBAC lets get /metrics, sees their
// telemetry, without Prometheus and without a route to the nodes. The
// proxy forwards none of the user's identity: Client must send the user's
// bearer token in metrics.ProxiedAuthorizationHeader
// (metrics.WithProxiedBearerToken), which the plugin reviews.
type PluginProxyUsage struct {
	Client kubernetes.Interface
	// Namespace is the plugin pods' (the chart's release namespace); "":
	// found by Selector in every namespace, wherever the chart was
	// installed.
	Namespace string
	// Selector selects the plugin pods (DefaultPluginSelector when "").
	Selector string
	// PortName is their metrics port's name (DefaultPluginPortName).
	PortName string
	// Concurrency bounds the scrapes in flight (16 when 0).
	Concurrency int
	// Pods, when set, lists the plugin pods from an informer that already
	// watches their namespace; nil: a List per read.
	Pods func() []*corev1.Pod
	// Now is the clock (time.Now when nil).
	Now func() time.Time
}

// Read implements UsageReader.
func (p *PluginProxyUsage) Read(ctx context.Context, nodes []string) (map[string]*top.Snapshot, []string) {
	selector := cmp.Or(p.Selector, DefaultPluginSelector)
	pods, err := p.pluginPods(ctx, selector)
	if err != nil {
		switch {
		case apierrors.IsForbidden(err) && p.Namespace == "":
			return nil, []string{fmt.Sprintf("usage: gpudra's plugin pods (%s) are looked for in every namespace, and listing pods there is forbidden: pass --plugin-namespace <the namespace gpudra is installed in>", selector)}
		case apierrors.IsForbidden(err):
			return nil, []string{fmt.Sprintf("usage: listing the plugin pods in namespace %s is forbidden: no live usage", p.Namespace)}
		}
		return nil, []string{fmt.Sprintf("usage: list the plugin pods in %s: %v", p.where(), err)}
	}
	if len(pods) == 0 {
		return nil, []string{fmt.Sprintf("usage: no gpudra kubelet plugin pods (%s) in %s: is the chart installed? Else pass --plugin-namespace", selector, p.where())}
	}
	byNode := pluginPodsByNode(pods, nodes)
	var (
		mu        sync.Mutex
		out       = map[string]*top.Snapshot{}
		failed    []string
		forbidden bool
		refused   error
		wg        sync.WaitGroup
		sem       = make(chan struct{}, cmp.Or(p.Concurrency, 16))
	)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for node, pod := range byNode {
		wg.Add(1)
		go func() {
			defer wg.Done()
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
				return
			}
			defer func() { <-sem }()
			snap, err := p.scrape(ctx, pod, p.now())
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				out[node] = snap
			case errors.Is(err, errPluginRefused):
				// The plugins review the user alike: one note.
				refused = err
				cancel()
			case apierrors.IsForbidden(err):
				// Every other pod will say the same: one note, no more requests.
				forbidden = true
				cancel()
			case ctx.Err() == nil:
				failed = append(failed, fmt.Sprintf("%s: %v", node, err))
			}
		}()
	}
	wg.Wait()
	var notes []string
	if forbidden {
		notes = append(notes, fmt.Sprintf("usage: pods/proxy forbidden in %s: no live usage from the plugins", p.where()))
		return nil, notes
	}
	if refused != nil {
		return nil, []string{"usage: " + refused.Error()}
	}
	if len(failed) > 0 {
		slices.Sort(failed)
		total, more := len(failed), ""
		if total > 3 {
			more, failed = fmt.Sprintf(" and %d more", total-3), failed[:3]
		}
		notes = append(notes, fmt.Sprintf("usage: %d plugins not read (%s%s)", total, strings.Join(failed, "; "), more))
	}
	return out, notes
}

// ReadNode reads one node's plugin, for gpudra top --node: its snapshot,
// or an error naming the node and what to do: no plugin pod there, or a
// list or proxy that RBAC forbids (naming the verb), or the plugin's own
// refusal of the user.
func (p *PluginProxyUsage) ReadNode(ctx context.Context, node string) (*top.Snapshot, error) {
	selector := cmp.Or(p.Selector, DefaultPluginSelector)
	pods, err := p.pluginPods(ctx, selector)
	switch {
	case apierrors.IsForbidden(err) && p.Namespace == "":
		return nil, fmt.Errorf("node %s: gpudra's plugin pods (%s) are looked for in every namespace, and RBAC forbids you to list pods there: pass --plugin-namespace <the namespace gpudra is installed in>", node, selector)
	case apierrors.IsForbidden(err):
		return nil, fmt.Errorf("node %s: RBAC forbids you to list pods in namespace %s, where its plugin pod is looked for", node, p.Namespace)
	case err != nil:
		return nil, fmt.Errorf("node %s: list the plugin pods in %s: %w", node, p.where(), err)
	}
	pod := pluginPodsByNode(pods, []string{node})[node]
	if pod == nil {
		return nil, fmt.Errorf("node %s has no running gpudra kubelet plugin pod (%s) in %s: is it a gpudra node? Else pass --plugin-namespace", node, selector, p.where())
	}
	snap, err := p.scrape(ctx, pod, p.now())
	switch {
	case err == nil:
		return snap, nil
	case errors.Is(err, errPluginRefused):
		return nil, fmt.Errorf("node %s: %w", node, err)
	case apierrors.IsForbidden(err):
		return nil, fmt.Errorf("node %s: RBAC forbids you to get pods/proxy in namespace %s: its plugin pod %s is read through the API server's proxy", node, pod.Namespace, pod.Name)
	}
	return nil, fmt.Errorf("node %s: %w", node, err)
}

// pluginPodsByNode is the plugin pod to read of each node (of nodes; of
// every node when empty): a running one, the newest during a rolling
// update.
func pluginPodsByNode(pods []*corev1.Pod, nodes []string) map[string]*corev1.Pod {
	byNode := map[string]*corev1.Pod{}
	for _, pod := range pods {
		node := pod.Spec.NodeName
		if node == "" || pod.Status.Phase != corev1.PodRunning || (len(nodes) > 0 && !slices.Contains(nodes, node)) {
			continue
		}
		if o := byNode[node]; o == nil || pod.CreationTimestamp.After(o.CreationTimestamp.Time) {
			byNode[node] = pod
		}
	}
	return byNode
}

func (p *PluginProxyUsage) now() time.Time {
	if p.Now != nil {
		return p.Now()
	}
	return time.Now()
}

// where says where the plugin pods are looked for.
func (p *PluginProxyUsage) where() string {
	if p.Namespace == "" {
		return "any namespace"
	}
	return "namespace " + p.Namespace
}

func (p *PluginProxyUsage) pluginPods(ctx context.Context, selector string) ([]*corev1.Pod, error) {
	if p.Pods != nil {
		return p.Pods(), nil
	}
	list, err := p.Client.CoreV1().Pods(p.Namespace).List(ctx, metav1.ListOptions{LabelSelector: selector})
	if err != nil {
		return nil, err
	}
	out := make([]*corev1.Pod, 0, len(list.Items))
	for i := range list.Items {
		out = append(out, &list.Items[i])
	}
	return out, nil
}

// scrape reads one plugin pod's /metrics through the API server. The
// pods proxy takes a port number, not a name: the name is looked up in
// the pod's spec.
func (p *PluginProxyUsage) scrape(ctx context.Context, pod *corev1.Pod, at time.Time) (*top.Snapshot, error) {
	port := ""
	name := cmp.Or(p.PortName, DefaultPluginPortName)
	for _, c := range pod.Spec.Containers {
		for _, cp := range c.Ports {
			if cp.Name == name {
				port = fmt.Sprint(cp.ContainerPort)
			}
		}
	}
	if port == "" {
		return nil, fmt.Errorf("pod %s has no port %q", pod.Name, name)
	}
	body, err := p.Client.CoreV1().Pods(pod.Namespace).ProxyGet(metricsScheme(pod, name), pod.Name, port, "/metrics", nil).Stream(ctx)
	if err != nil {
		return nil, pluginRefusal(pod, err)
	}
	defer body.Close()
	fams, err := top.ParseMetrics(body)
	if err != nil {
		return nil, fmt.Errorf("pod %s: %w", pod.Name, err)
	}
	s := top.FromMetrics(fams, "plugin", at)
	if s.Node == "" {
		s.Node = pod.Spec.NodeName
	}
	return s, nil
}

// errPluginRefused marks a plugin's own refusal of the user, as opposed to
// the API server's refusal of the proxy.
var errPluginRefused = errors.New("the plugins refused")

// pluginRefusal tells the plugin's 401 and 403 (its /metrics is for those
// RBAC lets get it) from the API server's own (no pods/proxy): the API
// server answers with a Status naming pods/proxy.
func pluginRefusal(pod *corev1.Pod, err error) error {
	switch {
	case apierrors.IsUnauthorized(err):
		return fmt.Errorf("%w your credentials (401): they review a bearer token, and yours has none (a client certificate, or impersonation): use --prometheus, or a kubeconfig with a token", errPluginRefused)
	case apierrors.IsForbidden(err) && !strings.Contains(err.Error(), "pods/proxy"):
		return fmt.Errorf("%w you (403): RBAC must let you get the non-resource URL /metrics (the chart's <release>-metrics-reader ClusterRole)", errPluginRefused)
	}
	return fmt.Errorf("pod %s: %w", pod.Name, err)
}

// metricsScheme is the plugin's metrics port's scheme, as its probes on
// that port say (the chart's follow kubeletPlugin.metrics.tls); https
// when none does.
func metricsScheme(pod *corev1.Pod, portName string) string {
	for _, c := range pod.Spec.Containers {
		for _, probe := range []*corev1.Probe{c.LivenessProbe, c.ReadinessProbe} {
			if probe == nil || probe.HTTPGet == nil {
				continue
			}
			if probe.HTTPGet.Port.String() == portName && probe.HTTPGet.Scheme == corev1.URISchemeHTTP {
				return "http"
			}
		}
	}
	return "https"
}

// PrometheusUsage reads the plugins' series from Prometheus: the last
// value of each (instant queries) for the usage, and a range for the
// allocation over time.
type PrometheusUsage struct {
	URL        string
	HTTPClient *http.Client
	// Now is the clock (time.Now when nil).
	Now func() time.Time

	once   sync.Once
	api    promv1.API
	apiErr error
}

func (p *PrometheusUsage) client() (promv1.API, error) {
	p.once.Do(func() {
		c, err := promapi.NewClient(promapi.Config{Address: p.URL, Client: p.HTTPClient})
		if err != nil {
			p.apiErr = fmt.Errorf("--prometheus %s: %w", p.URL, err)
			return
		}
		p.api = promv1.NewAPI(c)
	})
	return p.api, p.apiErr
}

func (p *PrometheusUsage) now() time.Time {
	if p.Now != nil {
		return p.Now()
	}
	return time.Now()
}

// promFields are the series the usage is read from (docs/metrics.md),
// and where each goes in a device.
var promFields = map[string]func(d *top.Device) **float64{
	"gpudra_gpu_utilization_ratio":       func(d *top.Device) **float64 { return &d.Utilization },
	"gpudra_gpu_sm_active_ratio":         func(d *top.Device) **float64 { return &d.SMActive },
	"gpudra_mig_sm_active_ratio":         func(d *top.Device) **float64 { return &d.SMActive },
	"gpudra_gpu_framebuffer_used_bytes":  func(d *top.Device) **float64 { return &d.MemoryUsedBytes },
	"gpudra_gpu_framebuffer_total_bytes": func(d *top.Device) **float64 { return &d.MemoryTotalBytes },
	"gpudra_mig_framebuffer_used_bytes":  func(d *top.Device) **float64 { return &d.MemoryUsedBytes },
	"gpudra_mig_framebuffer_total_bytes": func(d *top.Device) **float64 { return &d.MemoryTotalBytes },
	"gpudra_gpu_power_watts":             func(d *top.Device) **float64 { return &d.PowerWatts },
}

// usageQuery selects every usage series in one instant query.
func usageQuery() string {
	names := make([]string, 0, len(promFields))
	for n := range promFields {
		names = append(names, n)
	}
	slices.Sort(names)
	return `{__name__=~"` + strings.Join(names, "|") + `"}`
}

// Read implements UsageReader.
func (p *PrometheusUsage) Read(ctx context.Context, nodes []string) (map[string]*top.Snapshot, []string) {
	api, err := p.client()
	if err != nil {
		return nil, []string{"usage: " + err.Error()}
	}
	at := p.now()
	val, warnings, _, err := api.Query(ctx, usageQuery(), at)
	if err != nil {
		return nil, []string{fmt.Sprintf("usage: query Prometheus at %s: %v", p.URL, err)}
	}
	var notes []string
	for _, w := range warnings {
		notes = append(notes, "usage: Prometheus warns: "+w)
	}
	vec, ok := val.(model.Vector)
	if !ok {
		return nil, append(notes, fmt.Sprintf("usage: Prometheus answered a %s, not a vector", val.Type()))
	}
	want := map[string]bool{}
	for _, n := range nodes {
		want[n] = true
	}
	snaps := map[string]*top.Snapshot{}
	devs := map[string]map[string]*top.Device{}
	for _, s := range vec {
		node, device := string(s.Metric["node"]), string(s.Metric["dra_device_name"])
		field := promFields[string(s.Metric[model.MetricNameLabel])]
		if node == "" || device == "" || field == nil || (len(want) > 0 && !want[node]) {
			continue
		}
		if snaps[node] == nil {
			snaps[node] = &top.Snapshot{Node: node, Source: "prometheus", At: s.Timestamp.Time()}
			devs[node] = map[string]*top.Device{}
		}
		d := devs[node][device]
		if d == nil {
			d = &top.Device{Name: device, Model: string(s.Metric["model"]), Profile: string(s.Metric["dra_mig_profile"])}
			if strings.Contains(device, "-mig-") {
				d.GPU = string(s.Metric["gpu"])
			} else {
				d.UUID = string(s.Metric["gpu"])
			}
			devs[node][device] = d
		}
		v := float64(s.Value)
		*field(d) = &v
	}
	for node, s := range snaps {
		for _, d := range devs[node] {
			s.Devices = append(s.Devices, *d)
		}
		slices.SortFunc(s.Devices, func(a, b top.Device) int { return cmp.Compare(a.Name, b.Name) })
	}
	return snaps, notes
}

// The allocation queries: devices held per namespace (a prepared claim's
// device, each claim once per device), and of them those a kernel ran on
// (a GPU's utilization, or a MIG device's SM activity, above 0).
const (
	allocatedQuery = `count by (dra_claim_namespace) (gpudra_device_claim_info)`
	usedQuery      = `count by (dra_claim_namespace) (gpudra_device_claim_info and on (node, gpu, dra_device_name) ((gpudra_gpu_utilization_ratio > 0) or (gpudra_mig_sm_active_ratio > 0)))`
)

// Range is the allocation per namespace over the last span, from
// Prometheus, about 240 points. Used is absent throughout when Prometheus
// has no usage series in the span (nothing to tell used from idle); where
// it has some, a namespace with none in use at a time used 0 devices.
func (p *PrometheusUsage) Range(ctx context.Context, span time.Duration) (*Allocation, error) {
	api, err := p.client()
	if err != nil {
		return nil, err
	}
	end := p.now()
	step := max(30*time.Second, (span / 240).Truncate(time.Second))
	r := promv1.Range{Start: end.Add(-span), End: end, Step: step}
	alloc, err := p.matrix(ctx, api, allocatedQuery, r)
	if err != nil {
		return nil, err
	}
	used, err := p.matrix(ctx, api, usedQuery, r)
	if err != nil {
		// The allocation alone is still worth drawing.
		klog.FromContext(ctx).V(2).Info("Prometheus used-devices query failed", "err", err)
		used = nil
	}
	usageKnown := len(used) > 0
	// Every owner gets a point at every time any owner has one.
	var times []model.Time
	seenTime := map[model.Time]bool{}
	for _, ss := range alloc {
		for _, pt := range ss {
			if !seenTime[pt.Timestamp] {
				seenTime[pt.Timestamp] = true
				times = append(times, pt.Timestamp)
			}
		}
	}
	slices.Sort(times)
	out := &Allocation{Source: "prometheus", StepSeconds: int(step / time.Second), Series: []AllocationSeries{}}
	owners := make([]string, 0, len(alloc))
	for o := range alloc {
		owners = append(owners, o)
	}
	slices.Sort(owners)
	for _, o := range owners {
		a, u := pointsByTime(alloc[o]), pointsByTime(used[o])
		s := AllocationSeries{Owner: o, Points: make([]AllocationPoint, 0, len(times))}
		for _, t := range times {
			pt := AllocationPoint{At: t.Time().UTC(), Allocated: a[t]}
			if usageKnown {
				v := u[t]
				pt.Used = &v
			}
			s.Points = append(s.Points, pt)
		}
		out.Series = append(out.Series, s)
	}
	return out, nil
}

// matrix runs a range query, its series by the dra_claim_namespace label.
func (p *PrometheusUsage) matrix(ctx context.Context, api promv1.API, q string, r promv1.Range) (map[string][]model.SamplePair, error) {
	val, _, _, err := api.QueryRange(ctx, q, r)
	if err != nil {
		return nil, fmt.Errorf("query Prometheus at %s: %w", p.URL, err)
	}
	m, ok := val.(model.Matrix)
	if !ok {
		return nil, errors.New("Prometheus answered a " + val.Type().String() + ", not a matrix")
	}
	out := map[string][]model.SamplePair{}
	for _, s := range m {
		out[string(s.Metric["dra_claim_namespace"])] = s.Values
	}
	return out, nil
}

func pointsByTime(ps []model.SamplePair) map[model.Time]float64 {
	out := make(map[model.Time]float64, len(ps))
	for _, p := range ps {
		out[p.Timestamp] = float64(p.Value)
	}
	return out
}
