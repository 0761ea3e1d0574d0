package dashboard

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/telemetry"
)

// pluginMetrics is a real kubelet plugin scrape: pkg/telemetry's collector
// over the simulator (two H100s, the second in MIG mode with a 3g.40gb),
// GPU 0 at load 0.6.
func pluginMetrics(t *testing.T, node string) []byte {
	t.Helper()
	spec, err := sim.ParseSpec([]byte(twoGPUs + "migDevices:\n- {gpu: 1, profile: 3g.40gb, start: 4}\n"))
	require.NoError(t, err)
	m, err := sim.New(spec, node)
	require.NoError(t, err)
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	require.NoError(t, m.SetLoad(inv.GPUs[0].UUID, 0.6))
	c := telemetry.NewCollector(m, node, 0)
	c.Sample(context.Background())
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	rec := httptest.NewRecorder()
	promhttp.HandlerFor(reg, promhttp.HandlerOpts{}).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	require.Equal(t, http.StatusOK, rec.Code)
	return rec.Body.Bytes()
}

func pluginPod(name, node string, port int32) corev1.Pod {
	return corev1.Pod{TypeMeta: metav1.TypeMeta{Kind: "Pod", APIVersion: "v1"},
		ObjectMeta: metav1.ObjectMeta{Namespace: "gpudra", Name: name, Labels: map[string]string{"app.kubernetes.io/component": "kubelet-plugin"}},
		Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "plugin",
			Ports: []corev1.ContainerPort{{Name: "metrics", ContainerPort: port}}}}},
		Status: corev1.PodStatus{Phase: corev1.PodRunning}}
}

// apiServer stands in for the API server's pod list and pods proxy, at
// the paths client-go's ProxyGet calls; proxy answers one pod's proxy.
func fakeAPIServer(t *testing.T, pods []corev1.Pod, proxy func(w http.ResponseWriter, pod, port string)) (kubernetes.Interface, *atomic.Int32) {
	t.Helper()
	var proxied atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.URL.Path == "/api/v1/namespaces/gpudra/pods":
			assert.Equal(t, "app.kubernetes.io/component=kubelet-plugin", r.URL.Query().Get("labelSelector"))
			w.Header().Set("Content-Type", "application/json")
			_ = json.NewEncoder(w).Encode(corev1.PodList{TypeMeta: metav1.TypeMeta{Kind: "PodList", APIVersion: "v1"}, Items: pods})
		case strings.HasPrefix(r.URL.Path, "/api/v1/namespaces/gpudra/pods/") && strings.HasSuffix(r.URL.Path, "/proxy/metrics"):
			proxied.Add(1)
			namePort := strings.TrimSuffix(strings.TrimPrefix(r.URL.Path, "/api/v1/namespaces/gpudra/pods/"), "/proxy/metrics")
			scheme, rest, _ := strings.Cut(namePort, ":")
			name, port, _ := strings.Cut(rest, ":")
			proxy(w, scheme+"://"+name, port)
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(srv.Close)
	c, err := kubernetes.NewForConfig(&rest.Config{Host: srv.URL})
	require.NoError(t, err)
	return c, &proxied
}

func writeForbidden(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusForbidden)
	_ = json.NewEncoder(w).Encode(metav1.Status{TypeMeta: metav1.TypeMeta{Kind: "Status", APIVersion: "v1"}, Status: metav1.StatusFailure,
		Reason: metav1.StatusReasonForbidden, Code: http.StatusForbidden, Message: `pods "x" is forbidden: cannot get resource "pods/proxy"`})
}

func TestPluginProxyUsage(t *testing.T) {
	scrapes := map[string][]byte{"plugin-a": pluginMetrics(t, "node-a"), "plugin-b": pluginMetrics(t, "node-b")}
	pods := []corev1.Pod{pluginPod("plugin-a", "node-a", 9477), pluginPod("plugin-b", "node-b", 9477), pluginPod("plugin-c", "node-c", 9477)}
	at := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)

	t.Run("scrapes through the proxy, by the port's number", func(t *testing.T) {
		client, _ := fakeAPIServer(t, pods, func(w http.ResponseWriter, pod, port string) {
			assert.Equal(t, "9477", port)
			if b, ok := scrapes[strings.TrimPrefix(pod, "https://")]; ok {
				_, _ = w.Write(b)
				return
			}
			http.Error(w, "plugin not ready", http.StatusServiceUnavailable)
		})
		u := &PluginProxyUsage{Client: client, Namespace: "gpudra", Now: func() time.Time { return at }}
		got, notes := u.Read(context.Background(), []string{"node-a", "node-c"})
		require.Contains(t, got, "node-a")
		assert.NotContains(t, got, "node-b", "not asked for")
		assert.NotContains(t, got, "node-c", "not read: absent, not empty")
		s := got["node-a"]
		assert.Equal(t, "node-a", s.Node)
		assert.Equal(t, at, s.At)
		require.NotEmpty(t, s.Devices)
		assert.Equal(t, "gpu-0", s.Devices[0].Name)
		require.NotNil(t, s.Devices[0].Utilization)
		assert.InDelta(t, 0.6, *s.Devices[0].Utilization, 0.01)
		var mig bool
		for _, d := range s.Devices {
			if d.Name == "gpu-1-mig-3g-40gb-4" {
				mig = true
				assert.NotNil(t, d.MemoryTotalBytes)
			}
		}
		assert.True(t, mig, "the MIG device's series")
		require.Len(t, notes, 1)
		assert.Contains(t, notes[0], "1 plugins not read (node-c:")
	})

	t.Run("pods/proxy forbidden: one note, no request per pod after it", func(t *testing.T) {
		client, proxied := fakeAPIServer(t, pods, func(w http.ResponseWriter, _, _ string) { writeForbidden(w) })
		u := &PluginProxyUsage{Client: client, Namespace: "gpudra", Concurrency: 1}
		got, notes := u.Read(context.Background(), nil)
		assert.Empty(t, got)
		assert.Equal(t, []string{"usage: pods/proxy forbidden in namespace gpudra: no live usage from the plugins"}, notes)
		assert.Equal(t, int32(1), proxied.Load())
	})

	// The plugin's own refusals, passed on by the proxy: the user's
	// credentials carry no token, or RBAC does not let the user get
	// /metrics. One note, which says what to do.
	for _, tc := range []struct {
		name, body, note string
		code             int
	}{
		{"no token", "Unauthorized: a bearer token the API server accepts (TokenReview) is required", "they review a bearer token, and yours has none", http.StatusUnauthorized},
		{"not allowed", `Forbidden: user "jane" may not get /metrics`, "RBAC must let you get the non-resource URL /metrics", http.StatusForbidden},
	} {
		t.Run("the plugin refuses: "+tc.name, func(t *testing.T) {
			client, proxied := fakeAPIServer(t, pods, func(w http.ResponseWriter, _, _ string) { http.Error(w, tc.body, tc.code) })
			u := &PluginProxyUsage{Client: client, Namespace: "gpudra", Concurrency: 1}
			got, notes := u.Read(context.Background(), nil)
			assert.Empty(t, got)
			require.Len(t, notes, 1)
			assert.Contains(t, notes[0], tc.note)
			assert.NotContains(t, notes[0], "pods/proxy forbidden")
			assert.Equal(t, int32(1), proxied.Load())
		})
	}

	t.Run("HTTPS unless the pod's probes on the port say HTTP", func(t *testing.T) {
		plain := pluginPod("plugin-a", "node-a", 9477)
		plain.Spec.Containers[0].LivenessProbe = &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{
			Path: "/healthz", Port: intstr.FromString("metrics"), Scheme: corev1.URISchemeHTTP}}}
		var asked []string
		var mu sync.Mutex
		client, _ := fakeAPIServer(t, []corev1.Pod{plain, pluginPod("plugin-b", "node-b", 9477)}, func(w http.ResponseWriter, pod, _ string) {
			mu.Lock()
			asked = append(asked, pod)
			mu.Unlock()
			_, _ = w.Write(scrapes[pod[strings.Index(pod, "://")+3:]])
		})
		got, notes := (&PluginProxyUsage{Client: client, Namespace: "gpudra"}).Read(context.Background(), nil)
		assert.Empty(t, notes)
		assert.Len(t, got, 2)
		assert.ElementsMatch(t, []string{"http://plugin-a", "https://plugin-b"}, asked)
	})
}

// TestPluginProxyReadNode: gpudra top --node reads that node's plugin
// through the API server's proxy, and says what stops it: no plugin pod on
// the node, the proxy forbidden (the verb named), the plugin's refusal.
func TestPluginProxyReadNode(t *testing.T) {
	metrics := pluginMetrics(t, "node-a")
	pods := []corev1.Pod{pluginPod("plugin-a", "node-a", 9477), pluginPod("plugin-b", "node-b", 9477)}
	ctx := context.Background()
	for _, tc := range []struct {
		name    string
		node    string
		proxy   func(w http.ResponseWriter, pod, port string)
		asked   string // the pod proxied to
		wantErr string
	}{
		{name: "its plugin, read through the proxy", node: "node-a", asked: "https://plugin-a",
			proxy: func(w http.ResponseWriter, _, _ string) { _, _ = w.Write(metrics) }},
		{name: "a node without a plugin pod", node: "node-x",
			wantErr: "node node-x has no running gpudra kubelet plugin pod (app.kubernetes.io/component=kubelet-plugin) in namespace gpudra"},
		{name: "pods/proxy forbidden", node: "node-b", asked: "https://plugin-b",
			proxy:   func(w http.ResponseWriter, _, _ string) { writeForbidden(w) },
			wantErr: "node node-b: RBAC forbids you to get pods/proxy in namespace gpudra: its plugin pod plugin-b is read through the API server's proxy"},
		{name: "the plugin refuses the user", node: "node-a", asked: "https://plugin-a",
			proxy:   func(w http.ResponseWriter, _, _ string) { http.Error(w, "Unauthorized", http.StatusUnauthorized) },
			wantErr: "node node-a: the plugins refused your credentials (401)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var asked string
			client, _ := fakeAPIServer(t, pods, func(w http.ResponseWriter, pod, port string) {
				asked = pod
				assert.Equal(t, "9477", port)
				tc.proxy(w, pod, port)
			})
			snap, err := (&PluginProxyUsage{Client: client, Namespace: "gpudra"}).ReadNode(ctx, tc.node)
			assert.Equal(t, tc.asked, asked, "the pod proxied to")
			if tc.wantErr != "" {
				assert.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, "node-a", snap.Node)
			assert.NotEmpty(t, snap.Devices)
		})
	}
	t.Run("listing every namespace forbidden", func(t *testing.T) {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { writeForbidden(w) }))
		t.Cleanup(srv.Close)
		client, err := kubernetes.NewForConfig(&rest.Config{Host: srv.URL})
		require.NoError(t, err)
		_, err = (&PluginProxyUsage{Client: client}).ReadNode(ctx, "node-a")
		assert.ErrorContains(t, err, "node node-a: gpudra's plugin pods (app.kubernetes.io/component=kubelet-plugin) are looked for in every namespace, and RBAC forbids you to list pods there: pass --plugin-namespace")
	})
}

// promServer serves Prometheus's HTTP API answers: /api/v1/query and
// /api/v1/query_range, with the JSON shapes Prometheus writes.
func promServer(t *testing.T, query func(q string) string, queryRange func(q string) string) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		require.NoError(t, r.ParseForm())
		w.Header().Set("Content-Type", "application/json")
		switch r.URL.Path {
		case "/api/v1/query":
			fmt.Fprint(w, query(r.Form.Get("query")))
		case "/api/v1/query_range":
			fmt.Fprint(w, queryRange(r.Form.Get("query")))
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(srv.Close)
	return srv
}

func TestPrometheusUsage(t *testing.T) {
	at := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	ts := float64(at.Unix())
	vector := fmt.Sprintf(`{"status":"success","data":{"resultType":"vector","result":[
	 {"metric":{"__name__":"gpudra_gpu_utilization_ratio","node":"node-a","dra_device_name":"gpu-0","gpu":"GPU-0","model":"NVIDIA H100 80GB HBM3"},"value":[%.3[1]f,"0"]},
	 {"metric":{"__name__":"gpudra_gpu_framebuffer_used_bytes","node":"node-a","dra_device_name":"gpu-0","gpu":"GPU-0","model":"NVIDIA H100 80GB HBM3"},"value":[%.3[1]f,"1073741824"]},
	 {"metric":{"__name__":"gpudra_mig_sm_active_ratio","node":"node-a","dra_device_name":"gpu-1-mig-3g-40gb-4","gpu":"GPU-1","dra_mig_profile":"3g.40gb"},"value":[%.3[1]f,"0.25"]},
	 {"metric":{"__name__":"gpudra_gpu_power_watts","node":"node-b","dra_device_name":"gpu-0","gpu":"GPU-B0"},"value":[%.3[1]f,"310.5"]}
	]}}`, ts)
	var queries []string
	srv := promServer(t, func(q string) string { queries = append(queries, q); return vector }, nil)
	p := &PrometheusUsage{URL: srv.URL, Now: func() time.Time { return at }}
	got, notes := p.Read(context.Background(), nil)
	assert.Empty(t, notes)
	require.Len(t, got, 2)
	a := got["node-a"]
	assert.Equal(t, "prometheus", a.Source)
	require.Len(t, a.Devices, 2)
	assert.Equal(t, "gpu-0", a.Devices[0].Name)
	assert.Equal(t, "GPU-0", a.Devices[0].UUID)
	require.NotNil(t, a.Devices[0].Utilization)
	assert.Equal(t, 0.0, *a.Devices[0].Utilization, "a read 0 stays 0")
	assert.Equal(t, float64(1<<30), *a.Devices[0].MemoryUsedBytes)
	assert.Nil(t, a.Devices[0].PowerWatts, "no series: not read")
	assert.Equal(t, "GPU-1", a.Devices[1].GPU)
	assert.Equal(t, 0.25, *a.Devices[1].SMActive)
	assert.Equal(t, 310.5, *got["node-b"].Devices[0].PowerWatts)
	require.Len(t, queries, 1, "one instant query per read")
	assert.Contains(t, queries[0], "gpudra_gpu_utilization_ratio")

	only, _ := p.Read(context.Background(), []string{"node-b"})
	assert.NotContains(t, only, "node-a")

	bad := promServer(t, func(string) string {
		return `{"status":"error","errorType":"bad_data","error":"invalid parameter \"query\""}`
	}, nil)
	got, notes = (&PrometheusUsage{URL: bad.URL}).Read(context.Background(), nil)
	assert.Nil(t, got)
	require.Len(t, notes, 1)
	assert.Contains(t, notes[0], "invalid parameter")
}

func TestPrometheusRange(t *testing.T) {
	at := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	t0, t1 := float64(at.Add(-time.Minute).Unix()), float64(at.Unix())
	matrix := func(series ...string) string {
		return `{"status":"success","data":{"resultType":"matrix","result":[` + strings.Join(series, ",") + `]}}`
	}
	var ranges []string
	srv := promServer(t, nil, func(q string) string {
		ranges = append(ranges, q)
		if strings.Contains(q, "utilization") {
			return matrix(fmt.Sprintf(`{"metric":{"dra_claim_namespace":"team-a"},"values":[[%.3f,"1"]]}`, t1))
		}
		return matrix(
			fmt.Sprintf(`{"metric":{"dra_claim_namespace":"team-b"},"values":[[%.3f,"2"],[%.3f,"3"]]}`, t0, t1),
			fmt.Sprintf(`{"metric":{"dra_claim_namespace":"team-a"},"values":[[%.3f,"4"]]}`, t1))
	})
	p := &PrometheusUsage{URL: srv.URL, Now: func() time.Time { return at }}
	a, err := p.Range(context.Background(), 6*time.Hour)
	require.NoError(t, err)
	assert.Equal(t, "prometheus", a.Source)
	assert.Equal(t, 90, a.StepSeconds)
	require.Len(t, a.Series, 2)
	assert.Equal(t, "team-a", a.Series[0].Owner)
	assert.Equal(t, []AllocationPoint{{At: at.Add(-time.Minute), Allocated: 0, Used: fp(0)}, {At: at, Allocated: 4, Used: fp(1)}}, a.Series[0].Points)
	assert.Equal(t, []AllocationPoint{{At: at.Add(-time.Minute), Allocated: 2, Used: fp(0)}, {At: at, Allocated: 3, Used: fp(0)}}, a.Series[1].Points)
	assert.Equal(t, []string{allocatedQuery, usedQuery}, ranges)

	// No usage series at all: used unknown, not 0.
	noUse := promServer(t, nil, func(q string) string {
		if strings.Contains(q, "utilization") {
			return matrix()
		}
		return matrix(fmt.Sprintf(`{"metric":{"dra_claim_namespace":"team-a"},"values":[[%.3f,"4"]]}`, t1))
	})
	a, err = (&PrometheusUsage{URL: noUse.URL, Now: func() time.Time { return at }}).Range(context.Background(), time.Hour)
	require.NoError(t, err)
	assert.Nil(t, a.Series[0].Points[0].Used)
}
