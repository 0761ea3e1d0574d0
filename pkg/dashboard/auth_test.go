package dashboard

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestEveryRouteNeedsTheToken asks every route the server has (its route
// table, so that a new one is asked too) and a few it has not, without the
// token and with wrong ones: 401 with a message saying where the URL was
// printed; with the token, served.
func TestEveryRouteNeedsTheToken(t *testing.T) {
	ts, srv, _ := newTestServer(t, FixtureView(1, 1, 1))
	_, port, err := net.SplitHostPort(ts.Listener.Addr().String())
	require.NoError(t, err)
	paths := []string{"/nope", "/static/nope.js", "/api/", "/api/view/x"}
	routes := srv.routes()
	require.NotEmpty(t, routes)
	for _, rt := range routes {
		paths = append(paths, rt.example)
	}
	refusals := []struct {
		name   string
		header map[string]string
		query  string
	}{
		{name: "no token", header: map[string]string{"Authorization": ""}},
		{name: "wrong bearer", header: map[string]string{"Authorization": "Bearer " + testToken + "x"}},
		{name: "bearer of another scheme", header: map[string]string{"Authorization": "Basic " + testToken}},
		{name: "wrong cookie", header: map[string]string{"Authorization": "", "Cookie": "gpudra-dashboard-" + port + "=nope"}},
		{name: "token cookie of another port", header: map[string]string{"Authorization": "", "Cookie": "gpudra-dashboard-1=" + testToken}},
		{name: "wrong query token", header: map[string]string{"Authorization": ""}, query: "?token=nope"},
		{name: "empty query token", header: map[string]string{"Authorization": ""}, query: "?token="},
	}
	for _, path := range paths {
		for _, method := range []string{"GET", "HEAD", "POST"} {
			for _, r := range refusals {
				resp, body := get(t, ts, method, path+r.query, r.header)
				if !assert.Equal(t, http.StatusUnauthorized, resp.StatusCode, "%s %s%s (%s)", method, path, r.query, r.name) {
					continue
				}
				assert.Equal(t, `Bearer realm="gpudra dashboard"`, resp.Header.Get("WWW-Authenticate"))
				assert.Empty(t, resp.Header.Get("Set-Cookie"), "%s %s (%s): a refusal sets no cookie", method, path, r.name)
				if method == "GET" {
					assert.Contains(t, string(body), "printed on its standard error", "%s %s (%s)", method, path, r.name)
					assert.NotContains(t, string(body), testToken, "the refusal tells no token")
				}
			}
		}
	}
	for _, rt := range routes {
		if rt.example == "/api/events" {
			continue // a stream: below
		}
		resp, _ := get(t, ts, "GET", rt.example, nil)
		assert.Equal(t, http.StatusOK, resp.StatusCode, "GET %s with the bearer token", rt.example)
		resp, _ = get(t, ts, "GET", rt.example, map[string]string{"Authorization": "", "Cookie": "gpudra-dashboard-" + port + "=" + testToken})
		assert.Equal(t, http.StatusOK, resp.StatusCode, "GET %s with the cookie", rt.example)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, "GET", ts.URL+"/api/events", nil)
	require.NoError(t, err)
	req.AddCookie(&http.Cookie{Name: "gpudra-dashboard-" + port, Value: testToken})
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode, "GET /api/events with the cookie")
	assert.Equal(t, "text/event-stream", resp.Header.Get("Content-Type"))
}

// TestTokenURLGivesACookie: the printed URL sets an HttpOnly, SameSite
// Strict cookie and sends the browser to the same URL without the token,
// other parameters kept; the cookie then opens every route.
func TestTokenURLGivesACookie(t *testing.T) {
	ts, _, _ := newTestServer(t, FixtureView(1, 1, 1))
	resp, _ := get(t, ts, "GET", "/?load=3&"+TokenParam+"="+testToken, map[string]string{"Authorization": ""})
	require.Equal(t, http.StatusSeeOther, resp.StatusCode)
	assert.Equal(t, "/?load=3", resp.Header.Get("Location"))
	cookies := resp.Cookies()
	require.Len(t, cookies, 1)
	c := cookies[0]
	assert.True(t, strings.HasPrefix(c.Name, "gpudra-dashboard-"), c.Name)
	assert.Equal(t, testToken, c.Value)
	assert.True(t, c.HttpOnly, "HttpOnly")
	assert.Equal(t, http.SameSiteStrictMode, c.SameSite)
	assert.Equal(t, "/", c.Path)

	// A client with a cookie jar, as a browser: the URL as printed.
	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	client := &http.Client{Jar: jar}
	resp, err = client.Get(pageURL(ts))
	require.NoError(t, err)
	page, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Contains(t, string(page), "<title>test &lt;fleet&gt;</title>")
	assert.Empty(t, resp.Request.URL.Query().Get(TokenParam), "the browser lands on the URL without the token")
	resp, err = client.Get(ts.URL + "/api/view")
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode, "/api/view with the cookie the page got")
}

// TestServePrintsATokenURL: gpudra dashboard's server (serve, as the CLI
// runs it) tells a URL with a fresh token, and that token is the only way
// in.
func TestServePrintsATokenURL(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	urls := make(chan string, 1)
	done := make(chan error, 1)
	go func() {
		done <- RunLocal(ctx, LocalRunConfig{
			ServeConfig: ServeConfig{Address: "127.0.0.1:0", Listening: func(u string) { urls <- u }},
			LocalConfig: LocalConfig{StateDir: t.TempDir(), Node: "box"},
		})
	}()
	defer func() {
		cancel()
		require.NoError(t, <-done)
	}()
	var printed string
	select {
	case printed = <-urls:
	case err := <-done:
		t.Fatalf("serve: %v", err)
	}
	u, err := url.Parse(printed)
	require.NoError(t, err)
	token := u.Query().Get(TokenParam)
	require.GreaterOrEqual(t, len(token), 26, "the printed URL %s carries a 128-bit token", printed)
	base := u.Scheme + "://" + u.Host
	for _, path := range []string{"/", "/api/view", "/healthz"} {
		resp, err := http.Get(base + path)
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, http.StatusUnauthorized, resp.StatusCode, "%s without the token", path)
	}
	req, err := http.NewRequest("GET", base+"/api/view", nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode, "/api/view with the printed token")
}
