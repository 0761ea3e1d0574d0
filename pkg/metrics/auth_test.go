package metrics

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// reviews is an API server's TokenReview and SubjectAccessReview, on a
// real HTTP server: tokens name users, and only Prometheus' may get
// /metrics.
type reviews struct {
	mu           sync.Mutex
	tokenReviews int
	accessSpecs  []authorizationv1.SubjectAccessReviewSpec
}

const prometheusUser = "system:serviceaccount:monitoring:prometheus"

func (rv *reviews) auth(t *testing.T) *Auth {
	t.Helper()
	users := map[string]string{"prometheus-token": prometheusUser, "tenant-token": "system:serviceaccount:team-a:app"}
	apiServer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rv.mu.Lock()
		defer rv.mu.Unlock()
		var out any
		switch r.URL.Path {
		case "/apis/authentication.k8s.io/v1/tokenreviews":
			var tr authenticationv1.TokenReview
			if err := json.NewDecoder(r.Body).Decode(&tr); err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			rv.tokenReviews++
			if u, ok := users[tr.Spec.Token]; ok {
				tr.Status = authenticationv1.TokenReviewStatus{Authenticated: true, User: authenticationv1.UserInfo{Username: u}}
			}
			out = &tr
		case "/apis/authorization.k8s.io/v1/subjectaccessreviews":
			var sar authorizationv1.SubjectAccessReview
			if err := json.NewDecoder(r.Body).Decode(&sar); err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			rv.accessSpecs = append(rv.accessSpecs, sar.Spec)
			na := sar.Spec.NonResourceAttributes
			sar.Status.Allowed = sar.Spec.User == prometheusUser && na != nil && na.Path == "/metrics" && na.Verb == "get"
			out = &sar
		default:
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(out)
	}))
	t.Cleanup(apiServer.Close)
	auth, err := NewKubernetesAuth(&rest.Config{Host: apiServer.URL})
	require.NoError(t, err)
	return auth
}

func get(t *testing.T, url string, header http.Header) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	require.NoError(t, err)
	req.Header = header
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	resp, err := client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}

// The metrics server answers only those RBAC lets get /metrics, and the
// probes without credentials; over TLS, with the certificate it made.
func TestProtectServesMetricsOnlyToThoseAllowed(t *testing.T) {
	rv := &reviews{}
	auth := rv.auth(t)
	mux := http.NewServeMux()
	mux.Handle("/metrics", Handler(NewRegistry(ComponentKubeletPlugin)))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") })
	srv := httptest.NewUnstartedServer(auth.Protect(mux, "/healthz"))
	var err error
	srv.TLS, err = SelfSignedTLS("node-a")
	require.NoError(t, err)
	srv.StartTLS()
	defer srv.Close()

	bearer := func(h, tok string) http.Header { return http.Header{h: {"Bearer " + tok}} }
	tests := []struct {
		name   string
		path   string
		header http.Header
		code   int
		body   string
	}{
		{"no token", "/metrics", nil, http.StatusUnauthorized, "bearer token"},
		{"a token the API server does not know", "/metrics", bearer("Authorization", "stolen"), http.StatusUnauthorized, "bearer token"},
		{"a tenant", "/metrics", bearer("Authorization", "tenant-token"), http.StatusForbidden, `user "system:serviceaccount:team-a:app" may not get /metrics`},
		{"Prometheus", "/metrics", bearer("Authorization", "prometheus-token"), http.StatusOK, "gpudra_build_info"},
		{"through the API server's proxy", "/metrics", bearer(ProxiedAuthorizationHeader, "prometheus-token"), http.StatusOK, "gpudra_build_info"},
		{"a tenant through the proxy", "/metrics", bearer(ProxiedAuthorizationHeader, "tenant-token"), http.StatusForbidden, "may not get /metrics"},
		{"the probes", "/healthz", nil, http.StatusOK, "ok"},
		{"another path, without a token", "/debug", nil, http.StatusUnauthorized, "bearer token"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			code, body := get(t, srv.URL+tc.path, tc.header)
			assert.Equal(t, tc.code, code, body)
			assert.Contains(t, body, tc.body)
		})
	}
	rv.mu.Lock()
	defer rv.mu.Unlock()
	require.NotEmpty(t, rv.accessSpecs)
	for _, s := range rv.accessSpecs {
		assert.Nil(t, s.ResourceAttributes, "a non-resource request")
		assert.Equal(t, &authorizationv1.NonResourceAttributes{Path: "/metrics", Verb: "get"}, s.NonResourceAttributes)
	}
}

// A scrape every 10 s costs one TokenReview and one SubjectAccessReview
// per cache period, not one per scrape.
func TestProtectCachesTheReviews(t *testing.T) {
	rv := &reviews{}
	auth := rv.auth(t)
	srv := httptest.NewServer(auth.Protect(Handler(NewRegistry(ComponentKubeletPlugin))))
	defer srv.Close()
	for range 5 {
		code, _ := get(t, srv.URL+"/metrics", http.Header{"Authorization": {"Bearer prometheus-token"}})
		require.Equal(t, http.StatusOK, code)
	}
	rv.mu.Lock()
	defer rv.mu.Unlock()
	assert.Equal(t, 1, rv.tokenReviews)
	assert.Len(t, rv.accessSpecs, 1)
}

// The user's token reaches the plugin through the API server's proxy in
// ProxiedAuthorizationHeader, whatever gave it to client-go (here a token
// file), and goes nowhere else in it.
func TestWithProxiedBearerTokenForwardsTheUsersToken(t *testing.T) {
	seen := map[string]string{}
	var mu sync.Mutex
	apiServer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen[r.URL.Path] = r.Header.Get(ProxiedAuthorizationHeader)
		mu.Unlock()
		_, _ = io.WriteString(w, "ok")
	}))
	defer apiServer.Close()
	tokenFile := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte("user-token"), 0o600))
	client, err := kubernetes.NewForConfig(WithProxiedBearerToken(&rest.Config{Host: apiServer.URL, BearerTokenFile: tokenFile}))
	require.NoError(t, err)
	ctx := context.Background()
	_, err = client.CoreV1().Pods("gpudra").ProxyGet("https", "plugin-a", "9477", "/metrics", nil).DoRaw(ctx)
	require.NoError(t, err)
	_, err = client.CoreV1().RESTClient().Get().AbsPath("/api/v1/namespaces/gpudra/pods").DoRaw(ctx)
	require.NoError(t, err)
	mu.Lock()
	defer mu.Unlock()
	assert.Equal(t, map[string]string{
		"/api/v1/namespaces/gpudra/pods/https:plugin-a:9477/proxy/metrics": "Bearer user-token",
		"/api/v1/namespaces/gpudra/pods":                                   "",
	}, seen)
}
