package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpudra/gpudra/pkg/local"
	"github.com/gpudra/gpudra/pkg/metrics"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/prepared"
	"github.com/gpudra/gpudra/pkg/telemetry"
	"github.com/gpudra/gpudra/pkg/top"
)

// TestTopOnceEndpoint runs gpudra top --once against a kubelet plugin's
// telemetry, served as the plugin serves it: pkg/telemetry's collector over
// the simulator with one GPU loaded and claimed.
func TestTopOnceEndpoint(t *testing.T) {
	m, err := sim.NewBuiltin("dgx-h100-nomig", "node-a")
	require.NoError(t, err)
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	gpu2 := inv.GPUs[2].UUID
	require.NoError(t, m.SetLoad(gpu2, 0.8))
	c := telemetry.NewCollector(m, "node-a", 0)
	c.Sample(context.Background())
	c.SetClaims(func() []prepared.Claim {
		return []prepared.Claim{{UID: "u1", Namespace: "ml", Name: "train", Devices: []prepared.Device{{Device: "gpu-2", UUID: gpu2, GPUUUID: gpu2}}}}
	})
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()

	out, err := run(t, "top", "--once", "--endpoint", srv.URL, "-o", "json")
	require.NoError(t, err)
	require.Equal(t, 1, strings.Count(out, "\n"), "one line per refresh")
	var s top.Snapshot
	require.NoError(t, json.Unmarshal([]byte(out), &s))
	assert.Equal(t, "node-a", s.Node)
	require.Len(t, s.Devices, 8)
	for i, d := range s.Devices {
		assert.Equal(t, inv.GPUs[i].UUID, d.UUID, "row %d in GPU order", i)
		require.NotNil(t, d.Free, d.Name)
		require.NotNil(t, d.Utilization, d.Name)
		if d.Name == "gpu-2" {
			assert.Equal(t, []top.Holder{{Claim: "ml/train"}}, d.Holders)
			assert.False(t, *d.Free)
			assert.Greater(t, *d.Utilization, 0.5, "the load shows")
			continue
		}
		assert.Empty(t, d.Holders, d.Name)
		assert.True(t, *d.Free, d.Name)
		assert.Zero(t, *d.Utilization, "%s: idle, and read (not absent)", d.Name)
	}

	out, err = run(t, "top", "--once", "--endpoint", srv.URL)
	require.NoError(t, err)
	assert.Regexp(t, `(?m)^gpu-2\s+gpu\s+ml/train\s+\d+%`, out)
	assert.Regexp(t, `(?m)^gpu-3\s+gpu\s+free\s+0%`, out)
}

// TestTopOnceMachine reads the simulated machine directly, with gpudra
// local's state file: the local allocation and its user hold their GPU,
// and the waiter is listed.
func TestTopOnceMachine(t *testing.T) {
	dir := t.TempDir()
	m, err := sim.NewBuiltin("dgx-h100-nomig", "n")
	require.NoError(t, err)
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	st := local.State{
		Allocations: []local.Allocation{{Request: local.Request{Name: "job", User: "alice"}, Devices: []local.Device{{Name: "gpu-1", UUID: inv.GPUs[1].UUID}}}},
		Waiters:     []local.Waiter{{Request: local.Request{Name: "next", User: "bob"}}},
	}
	b, err := json.Marshal(st)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "state.json"), b, 0o644))

	for _, tc := range []struct {
		name     string
		stateDir string
		want     []string
		notWant  []string
	}{
		{name: "with local's state", stateDir: dir, want: []string{"local job (alice)", "WAITING (gpudra local)", "next  bob"}},
		{name: "local never used here: no holders, not free either", stateDir: filepath.Join(dir, "none"), notWant: []string{"local job", "free"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := run(t, "top", "--once", "--backend", "sim", "--machine", "dgx-h100-nomig", "--node-name", "n", "--state-dir", tc.stateDir)
			require.NoError(t, err)
			assert.True(t, strings.HasPrefix(out, "n  sim  "), out)
			for _, w := range tc.want {
				assert.Contains(t, out, w)
			}
			for _, w := range tc.notWant {
				assert.NotContains(t, out, w)
			}
		})
	}
}

func TestTopFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"top", "--once", "-o", "yaml"}, `unknown format "yaml"`},
		{[]string{"top", "--once", "--interval", "0s"}, "--interval 0s"},
		{[]string{"top", "--once", "--endpoint", "http://127.0.0.1:1/metrics"}, "scrape http://127.0.0.1:1/metrics"},
	} {
		_, err := run(t, tc.args...)
		require.Error(t, err, tc.args)
		assert.Contains(t, err.Error(), tc.want)
	}
	var b bytes.Buffer
	assert.False(t, isTerminal(&b), "a buffer is redrawn by appending")
}

// A plugin serves /metrics over HTTPS to a bearer token only: top sends
// --token-file's, accepts the plugin's own certificate when told, and says
// what is missing when refused.
func TestTopEndpointWithTokenOverTLS(t *testing.T) {
	c := telemetry.NewCollector(mustSim(t), "node-a", 0)
	c.Sample(context.Background())
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	metrics := promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer reader-token" {
			http.Error(w, "Unauthorized", http.StatusUnauthorized)
			return
		}
		metrics.ServeHTTP(w, r)
	}))
	defer srv.Close()
	tokenFile := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte("reader-token\n"), 0o600))

	out, err := run(t, "top", "--once", "--endpoint", srv.URL, "--token-file", tokenFile, "--insecure-skip-tls-verify", "-o", "json")
	require.NoError(t, err)
	assert.Contains(t, out, `"node":"node-a"`)

	_, err = run(t, "top", "--once", "--endpoint", srv.URL, "--insecure-skip-tls-verify")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "401 Unauthorized: the plugin serves /metrics to a bearer token (--token-file)")

	_, err = run(t, "top", "--once", "--endpoint", srv.URL, "--token-file", tokenFile)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "certificate", "the plugin's certificate is verified unless told otherwise")
}

func mustSim(t *testing.T) *sim.Machine {
	t.Helper()
	m, err := sim.NewBuiltin("dgx-h100-nomig", "node-a")
	require.NoError(t, err)
	return m
}

// TestTopNodeThroughAPIServerProxy: gpudra top --node reads that node's
// plugin through the API server's pods proxy with the kubeconfig's
// credentials, finding its pod by the chart's labels in any namespace (here
// gpudra-system), as the dashboard does; the user's token goes to the
// plugin in its own header. A node without a plugin pod is an error that
// names it. The API server is an httptest server at client-go's paths.
func TestTopNodeThroughAPIServerProxy(t *testing.T) {
	c := telemetry.NewCollector(mustSim(t), "node-a", 0)
	c.Sample(context.Background())
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	plugin := promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
	pod := corev1.Pod{TypeMeta: metav1.TypeMeta{Kind: "Pod", APIVersion: "v1"},
		ObjectMeta: metav1.ObjectMeta{Namespace: "gpudra-system", Name: "plugin-a", Labels: map[string]string{"app.kubernetes.io/component": "kubelet-plugin"}},
		Spec: corev1.PodSpec{NodeName: "node-a", Containers: []corev1.Container{{Name: "plugin",
			Ports: []corev1.ContainerPort{{Name: "metrics", ContainerPort: 9477}}}}},
		Status: corev1.PodStatus{Phase: corev1.PodRunning}}
	var proxied []string
	apiServer := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		assert.Equal(t, "Bearer alice-token", r.Header.Get("Authorization"), r.URL.Path)
		switch r.URL.Path {
		case "/api/v1/pods":
			assert.Equal(t, "app.kubernetes.io/component=kubelet-plugin", r.URL.Query().Get("labelSelector"))
			w.Header().Set("Content-Type", "application/json")
			_ = json.NewEncoder(w).Encode(corev1.PodList{TypeMeta: metav1.TypeMeta{Kind: "PodList", APIVersion: "v1"}, Items: []corev1.Pod{pod}})
		case "/api/v1/namespaces/gpudra-system/pods/https:plugin-a:9477/proxy/metrics":
			proxied = append(proxied, r.URL.Path)
			assert.Equal(t, "Bearer alice-token", r.Header.Get(metrics.ProxiedAuthorizationHeader), "the user's token, for the plugin to review")
			plugin.ServeHTTP(w, r)
		default:
			http.NotFound(w, r)
		}
	}))
	defer apiServer.Close()
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	require.NoError(t, os.WriteFile(kubeconfig, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "`+apiServer.URL+`", insecure-skip-tls-verify: true}}]
users: [{name: alice, user: {token: alice-token}}]
contexts: [{name: c, context: {cluster: c, user: alice}}]
current-context: c
`), 0o600))

	out, err := run(t, "top", "--once", "--node", "node-a", "--kubeconfig", kubeconfig, "-o", "json")
	require.NoError(t, err, out)
	var s top.Snapshot
	require.NoError(t, json.Unmarshal([]byte(out), &s))
	assert.Equal(t, "node-a", s.Node)
	assert.Len(t, s.Devices, 8)
	assert.Len(t, proxied, 1, "one scrape through the proxy")

	_, err = run(t, "top", "--once", "--node", "node-b", "--kubeconfig", kubeconfig)
	assert.ErrorContains(t, err, "node node-b has no running gpudra kubelet plugin pod (app.kubernetes.io/component=kubelet-plugin) in any namespace")
	_, err = run(t, "top", "--once", "--node", "node-a", "--endpoint", apiServer.URL)
	assert.ErrorContains(t, err, "--node and --endpoint: give one")
	_, err = run(t, "top", "--once", "--plugin-namespace", "gpudra")
	assert.ErrorContains(t, err, "are for --node")
}
