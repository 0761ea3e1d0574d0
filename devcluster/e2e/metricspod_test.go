package e2e

import (
	"bytes"
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	v1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	restclient "k8s.io/client-go/rest"

	"github.com/gpudra/gpudra/pkg/dashboard"
	"github.com/gpudra/gpudra/pkg/metrics"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/devcluster/e2e/tenant"
	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/devcluster/podnetwork"
	"github.com/gpudra/gpudra/pkg/top"
)

// TestPluginMetricsThroughTheAPIServerProxy: every node's plugin telemetry
// is reachable as a real plugin pod's is, through kube-apiserver's pods
// proxy to the pod's metrics port (how gpudra dashboard reads usage), with
// the caller's own token, and it is that node's: the GPUs of its slices.
func TestPluginMetricsThroughTheAPIServerProxy(t *testing.T) {
	ctx := context.Background()
	proxyClient, err := kubernetes.NewForConfig(metrics.WithProxiedBearerToken(cluster.RESTConfig))
	require.NoError(t, err)
	for _, node := range []string{"dgx-h100-0", nomigNode} {
		pod, err := cluster.Client.CoreV1().Pods(chart.PluginNamespace).Get(ctx, nodeagent.MetricsPodName(node), metav1.GetOptions{})
		require.NoError(t, err)
		require.NotEmpty(t, pod.Status.PodIP, "%s: the metrics pod has an IP", node)
		// On devcluster's pod network (root), not on an interface of the
		// machine, where every host of its network could read it; the
		// API server reaches it through its egress selector.
		// make test (GPUDRA_REQUIRE_REAL_NODE=1) requires it.
		if os.Getenv("GPUDRA_REQUIRE_REAL_NODE") == "1" {
			require.Equal(t, podnetwork.Address, cluster.PodNetworkAddress(), "make test runs devcluster with its pod network (root, nsenter, ip)")
		}
		if cluster.PodNetworkAddress() != "" {
			assert.Equal(t, podnetwork.Address, pod.Status.PodIP, "%s", node)
			addrs, err := net.InterfaceAddrs()
			require.NoError(t, err)
			for _, a := range addrs {
				ip, _, _ := net.ParseCIDR(a.String())
				assert.NotEqual(t, pod.Status.PodIP, ip.String(), "%s: the metrics pod's address is the machine's %s", node, a)
			}
		}
		port := pod.Spec.Containers[0].Ports[0]
		require.Equal(t, nodeagent.MetricsPort, port.Name)
		// The plugin serves HTTPS and reviews the caller's token, which
		// the proxy does not forward: as gpudra dashboard does, the
		// client sends it in metrics.ProxiedAuthorizationHeader.
		_, err = cluster.Client.CoreV1().Pods(chart.PluginNamespace).ProxyGet("https", pod.Name, strconv.Itoa(int(port.ContainerPort)), "/metrics", nil).DoRaw(ctx)
		require.True(t, apierrors.IsUnauthorized(err), "%s: without the token the plugin answers 401: %v", node, err)
		body, err := proxyClient.CoreV1().Pods(chart.PluginNamespace).ProxyGet("https", pod.Name, strconv.Itoa(int(port.ContainerPort)), "/metrics", nil).DoRaw(ctx)
		require.NoError(t, err, "%s: /metrics through the API server's proxy", node)
		fams, err := top.ParseMetrics(bytes.NewReader(body))
		require.NoError(t, err)
		snap := top.FromMetrics(fams, "proxy", pod.CreationTimestamp.Time)
		assert.Equal(t, node, snap.Node)
		gpus := 0
		for _, d := range snap.Devices {
			if d.Profile == "" {
				gpus++
			}
		}
		assert.Equal(t, 8, gpus, "%s: its 8 GPUs", node)

		// gpudra top --node's reader: the node's plugin pod found by the
		// chart's labels in any namespace, read through the same proxy.
		read, err := (&dashboard.PluginProxyUsage{Client: proxyClient}).ReadNode(ctx, node)
		require.NoError(t, err, "gpudra top --node %s", node)
		assert.Equal(t, node, read.Node)
		assert.Len(t, read.Devices, len(snap.Devices), "%s: the same devices", node)
	}

	_, err = (&dashboard.PluginProxyUsage{Client: proxyClient}).ReadNode(ctx, "no-such-node")
	assert.ErrorContains(t, err, "node no-such-node has no running gpudra kubelet plugin pod")
	// A user who may list the plugin pods but not proxy to them: the API
	// server's refusal, named as the verb to ask for.
	viewer := "plugin-viewer"
	_, err = cluster.Client.RbacV1().Roles(chart.PluginNamespace).Create(ctx, &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: viewer},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get", "list"}}}}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = cluster.Client.RbacV1().RoleBindings(chart.PluginNamespace).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: viewer},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: viewer},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: viewer}}}, metav1.CreateOptions{})
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = cluster.Client.RbacV1().RoleBindings(chart.PluginNamespace).Delete(context.Background(), viewer, metav1.DeleteOptions{})
		_ = cluster.Client.RbacV1().Roles(chart.PluginNamespace).Delete(context.Background(), viewer, metav1.DeleteOptions{})
	})
	cfg := restclient.CopyConfig(cluster.RESTConfig)
	cfg.Impersonate = restclient.ImpersonationConfig{UserName: viewer, Groups: []string{"system:authenticated"}}
	viewerClient, err := kubernetes.NewForConfig(metrics.WithProxiedBearerToken(cfg))
	require.NoError(t, err)
	// Until the API server's RBAC cache has the binding, the list is
	// refused too.
	var readErr error
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 10*time.Second, true, func(ctx context.Context) (bool, error) {
		_, readErr = (&dashboard.PluginProxyUsage{Client: viewerClient, Namespace: chart.PluginNamespace}).ReadNode(ctx, "dgx-h100-0")
		return readErr != nil && !strings.Contains(readErr.Error(), "to list pods"), nil
	})
	require.NoError(t, err, "the binding takes effect: %v", readErr)
	assert.ErrorContains(t, readErr, "node dgx-h100-0: RBAC forbids you to get pods/proxy in namespace "+chart.PluginNamespace)
	_, err = (&dashboard.PluginProxyUsage{Client: viewerClient}).ReadNode(ctx, "dgx-h100-0")
	assert.ErrorContains(t, err, "RBAC forbids you to list pods there: pass --plugin-namespace")
}

// TestPluginMetricsAreForPrometheusNotTenants: the plugin's /metrics names
// the claims, pods and containers on the node's GPUs. A tenant (a
// ServiceAccount with the default `edit` role in its own namespace) on the
// pod network cannot read them, over HTTP or HTTPS, with its token or
// without, nor through the API server's proxy; Prometheus, scraping as
// the chart's ServiceMonitor says (its scheme, its TLS settings, its own
// ServiceAccount's token, the ServiceAccount the chart binds to the
// metrics reader role), can.
func TestPluginMetricsAreForPrometheusNotTenants(t *testing.T) {
	ctx := context.Background()
	pod, err := cluster.Client.CoreV1().Pods(chart.PluginNamespace).Get(ctx, nodeagent.MetricsPodName("dgx-h100-0"), metav1.GetOptions{})
	require.NoError(t, err)
	require.NotEmpty(t, pod.Status.PodIP)
	addr := net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(int(pod.Spec.Containers[0].Ports[0].ContainerPort)))
	// One connection per request: a plain HTTP request to the HTTPS
	// server gets its 400 and the connection closed.
	scrapeOrErr := func(scheme string, insecure bool, token string) (int, string, error) {
		t.Helper()
		client := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{DisableKeepAlives: true,
			DialContext:     func(ctx context.Context, _, addr string) (net.Conn, error) { return cluster.DialPodNetwork(ctx, addr) },
			TLSClientConfig: &tls.Config{InsecureSkipVerify: insecure}, //nolint:gosec // as the ServiceMonitor says
		}}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, scheme+"://"+addr+"/metrics", nil)
		require.NoError(t, err)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := client.Do(req)
		if err != nil {
			return 0, "", err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body), err
	}
	scrape := func(scheme string, insecure bool, token string) (int, string) {
		t.Helper()
		code, body, err := scrapeOrErr(scheme, insecure, token)
		require.NoError(t, err, "%s://%s", scheme, addr)
		return code, body
	}
	token := func(ns, sa string) string {
		t.Helper()
		tr, err := cluster.Client.CoreV1().ServiceAccounts(ns).CreateToken(ctx, sa, &authenticationv1.TokenRequest{
			Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr[int64](3600)}}, metav1.CreateOptions{})
		require.NoError(t, err)
		return tr.Status.Token
	}

	// A tenant: a ServiceAccount holding `edit` (as aggregated in a
	// cluster) in its own namespace.
	ns := namespace(t)
	_, err = cluster.Client.CoreV1().ServiceAccounts(ns).Create(ctx, &v1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "app"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	rules, err := tenant.Rules(ctx, cluster.Client, "edit")
	require.NoError(t, err)
	_, err = cluster.Client.RbacV1().Roles(ns).Create(ctx, &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: "edit"},
		Rules: rules}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = cluster.Client.RbacV1().RoleBindings(ns).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "app-edit"},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "edit"},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: "app", Namespace: ns}}}, metav1.CreateOptions{})
	require.NoError(t, err)
	tenantToken := token(ns, "app")
	for _, scheme := range []string{"http", "https"} {
		for _, tok := range []string{"", tenantToken} {
			code, body, err := scrapeOrErr(scheme, true, tok)
			if err != nil {
				continue // not read
			}
			assert.NotEqual(t, http.StatusOK, code, "%s, token %t: the tenant reads the plugin's metrics", scheme, tok != "")
			assert.False(t, strings.Contains(body, "gpudra_"), "%s, token %t: the tenant sees series", scheme, tok != "")
		}
	}
	code, body := scrape("https", true, "")
	assert.Equal(t, http.StatusUnauthorized, code, body)
	code, body = scrape("https", true, tenantToken)
	assert.Equal(t, http.StatusForbidden, code, body)
	assert.Contains(t, body, "system:serviceaccount:"+ns+":app")
	tenantCfg := restclient.CopyConfig(cluster.RESTConfig)
	tenantCfg.BearerToken, tenantCfg.Impersonate = tenantToken, restclient.ImpersonationConfig{}
	tenant, err := kubernetes.NewForConfig(metrics.WithProxiedBearerToken(tenantCfg))
	require.NoError(t, err)
	_, err = tenant.CoreV1().Pods(chart.PluginNamespace).ProxyGet("https", pod.Name, strconv.Itoa(int(pod.Spec.Containers[0].Ports[0].ContainerPort)), "/metrics", nil).DoRaw(ctx)
	require.True(t, apierrors.IsForbidden(err), "the tenant may not proxy to the plugin's pod: %v", err)

	// Prometheus, as the chart's ServiceMonitor configures it.
	rendered, err := chart.Render(ctx, chart.Default("../.."), t.TempDir(), "--set", "metrics.serviceMonitor.enabled=true")
	require.NoError(t, err)
	var endpoint map[string]any
	var reader *unstructured.Unstructured
	for _, o := range objectsFrom(t, rendered) {
		switch {
		case o.GetKind() == "ServiceMonitor" && o.GetName() == chart.Release+"-kubelet-plugin":
			eps, _, _ := unstructured.NestedSlice(o.Object, "spec", "endpoints")
			require.Len(t, eps, 1)
			endpoint = eps[0].(map[string]any)
		case o.GetKind() == "ClusterRoleBinding" && o.GetName() == chart.Release+"-metrics-reader":
			reader = o
		}
	}
	require.NotNil(t, endpoint, "the chart renders the plugins' ServiceMonitor")
	require.NotNil(t, reader, "the chart binds Prometheus to the metrics reader role")
	scheme, _, _ := unstructured.NestedString(endpoint, "scheme")
	insecure, _, _ := unstructured.NestedBool(endpoint, "tlsConfig", "insecureSkipVerify")
	tokenFile, _, _ := unstructured.NestedString(endpoint, "bearerTokenFile")
	assert.Equal(t, "https", scheme)
	assert.Equal(t, "/var/run/secrets/kubernetes.io/serviceaccount/token", tokenFile, "Prometheus' own ServiceAccount token, as the kubelet mounts it")
	subjects, _, _ := unstructured.NestedSlice(reader.Object, "subjects")
	require.Len(t, subjects, 1)
	promNS, promSA := subjects[0].(map[string]any)["namespace"].(string), subjects[0].(map[string]any)["name"].(string)
	// devcluster applied the chart's RBAC at its start: the binding is
	// there; the Prometheus is made here.
	_, err = cluster.Client.RbacV1().ClusterRoleBindings().Get(ctx, reader.GetName(), metav1.GetOptions{})
	require.NoError(t, err)
	_, err = cluster.Client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: promNS}}, metav1.CreateOptions{})
	if !apierrors.IsAlreadyExists(err) {
		require.NoError(t, err)
	}
	_, err = cluster.Client.CoreV1().ServiceAccounts(promNS).Create(ctx, &v1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: promSA}}, metav1.CreateOptions{})
	if !apierrors.IsAlreadyExists(err) {
		require.NoError(t, err)
	}
	code, body = scrape(scheme, insecure, token(promNS, promSA))
	require.Equal(t, http.StatusOK, code, body)
	fams, err := top.ParseMetrics(strings.NewReader(body))
	require.NoError(t, err)
	assert.Equal(t, "dgx-h100-0", top.FromMetrics(fams, "prometheus", time.Now()).Node, "the node's own telemetry")
	// The probes' path stays open, with no token.
	code, _ = scrapePath(t, ctx, addr, "/healthz")
	assert.Equal(t, http.StatusOK, code)
}

// scrapePath GETs path over HTTPS from the pod network, without a token.
func scrapePath(t *testing.T, ctx context.Context, addr, path string) (int, string) {
	t.Helper()
	client := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{
		DialContext:     func(ctx context.Context, _, addr string) (net.Conn, error) { return cluster.DialPodNetwork(ctx, addr) },
		TLSClientConfig: &tls.Config{InsecureSkipVerify: true}, //nolint:gosec // the probes' view
	}}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "https://"+addr+path, nil)
	require.NoError(t, err)
	resp, err := client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}
