package dashboard

import (
	"bufio"
	"compress/gzip"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// testToken is the test servers' token.
const testToken = "test-token-0123456789"

// pageURL is the URL gpudra dashboard would print for ts.
func pageURL(ts *httptest.Server) string { return ts.URL + "/?" + TokenParam + "=" + testToken }

// newTestServer serves a Publisher's Views over a real listener, with the
// listener's address as the bound one, as gpudra dashboard does.
func newTestServer(t testing.TB, initial *View) (*httptest.Server, *Server, *Publisher) {
	t.Helper()
	pub := NewPublisher(initial)
	ts := httptest.NewUnstartedServer(nil)
	srv := NewServer(pub, ServerOptions{Addr: ts.Listener.Addr().String(), Title: "test <fleet>", Token: testToken})
	ts.Config.Handler = srv
	ts.Start()
	t.Cleanup(ts.Close)
	return ts, srv, pub
}

// get asks ts with the token as a bearer header, unless header sets
// Authorization ("": none).
func get(t *testing.T, ts *httptest.Server, method, path string, header map[string]string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, ts.URL+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+testToken)
	for k, v := range header {
		if k == "Authorization" && v == "" {
			req.Header.Del(k)
			continue
		}
		if k == "Host" {
			req.Host = v
			continue
		}
		req.Header.Set(k, v)
	}
	// A Transport that does not gunzip for us: the test counts the bytes;
	// redirects are the test's to see.
	// A stream served where a refusal was due ends the test, not hangs it.
	client := &http.Client{Transport: &http.Transport{DisableCompression: true}, Timeout: 10 * time.Second,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, body
}

func TestSecurityHeadersOnEveryResponse(t *testing.T) {
	ts, _, _ := newTestServer(t, FixtureView(2, 2, 1))
	for _, tc := range []struct {
		name, method, path, host string
		status                   int
		noStore                  bool
	}{
		{name: "page", method: "GET", path: "/", status: 200},
		{name: "script", method: "GET", path: "/static/app.js", status: 200},
		{name: "style", method: "GET", path: "/static/app.css", status: 200},
		{name: "view", method: "GET", path: "/api/view", status: 200, noStore: true},
		{name: "healthz", method: "GET", path: "/healthz", status: 200},
		{name: "not found", method: "GET", path: "/nope", status: 404},
		{name: "missing static", method: "GET", path: "/static/nope.js", status: 404},
		{name: "post", method: "POST", path: "/api/view", status: 405},
		{name: "foreign host", method: "GET", path: "/", host: "evil.example", status: 403},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := map[string]string{}
			if tc.host != "" {
				h["Host"] = tc.host
			}
			resp, _ := get(t, ts, tc.method, tc.path, h)
			if resp.StatusCode != tc.status {
				t.Fatalf("status %d, want %d", resp.StatusCode, tc.status)
			}
			for k, want := range securityHeaders {
				if got := resp.Header.Get(k); got != want {
					t.Errorf("%s = %q, want %q", k, got, want)
				}
			}
			for _, must := range []string{"default-src 'none'", "script-src 'self'", "style-src 'self'", "frame-ancestors 'none'"} {
				if !strings.Contains(resp.Header.Get("Content-Security-Policy"), must) {
					t.Errorf("CSP lacks %q", must)
				}
			}
			if got := resp.Header.Get("Cache-Control"); tc.noStore && got != "no-store" {
				t.Errorf("Cache-Control = %q, want no-store", got)
			}
		})
	}
}

func TestOnlyGetAndHead(t *testing.T) {
	ts, _, _ := newTestServer(t, FixtureView(1, 1, 1))
	for _, method := range []string{"POST", "PUT", "PATCH", "DELETE", "OPTIONS"} {
		for _, path := range []string{"/", "/api/view", "/api/events"} {
			resp, _ := get(t, ts, method, path, nil)
			if resp.StatusCode != http.StatusMethodNotAllowed {
				t.Errorf("%s %s: status %d, want 405", method, path, resp.StatusCode)
			}
			if got := resp.Header.Get("Allow"); got != "GET, HEAD" {
				t.Errorf("%s %s: Allow %q", method, path, got)
			}
		}
	}
	resp, body := get(t, ts, "HEAD", "/api/view", nil)
	if resp.StatusCode != 200 || len(body) != 0 || resp.Header.Get("Content-Length") == "" {
		t.Errorf("HEAD /api/view: status %d, %d bytes, Content-Length %q", resp.StatusCode, len(body), resp.Header.Get("Content-Length"))
	}
}

func TestHostCheck(t *testing.T) {
	for _, tc := range []struct {
		bound   string
		allowed []string
		refused []string
	}{{
		bound:   "127.0.0.1:8080",
		allowed: []string{"127.0.0.1:8080", "localhost:8080", "LOCALHOST:8080", "[::1]:8080"},
		refused: []string{"evil.example:8080", "attacker.localhost.evil:8080", "127.0.0.1:8081", "localhost", "", "10.0.0.1:8080", "127.0.0.1.nip.io:8080"},
	}, {
		bound:   "[::1]:9000",
		allowed: []string{"[::1]:9000", "localhost:9000", "127.0.0.1:9000"},
		refused: []string{"evil.example:9000", "[::1]:9001"},
	}, {
		bound:   "10.1.2.3:8080",
		allowed: []string{"10.1.2.3:8080", "localhost:8080"},
		refused: []string{"10.1.2.4:8080", "evil.example:8080", "10.1.2.3:80"},
	}, {
		bound:   "dash.internal:8080",
		allowed: []string{"dash.internal:8080", "DASH.internal.:8080"},
		refused: []string{"other.internal:8080"},
	}, {
		// Every interface: an IP literal cannot be rebound, a name can.
		bound:   "0.0.0.0:8080",
		allowed: []string{"192.168.1.5:8080", "[fe80::1]:8080", "localhost:8080"},
		refused: []string{"evil.example:8080", "192.168.1.5:8081"},
	}, {
		bound:   ":8080",
		allowed: []string{"192.168.1.5:8080"},
		refused: []string{"evil.example:8080"},
	}, {
		bound:   "127.0.0.1:80",
		allowed: []string{"localhost", "127.0.0.1:80"},
		refused: []string{"evil.example"},
	}} {
		s := NewServer(NewPublisher(FixtureView(1, 1, 1)), ServerOptions{Addr: tc.bound, Token: testToken})
		check := func(host string, want int) {
			t.Helper()
			req := httptest.NewRequest("GET", "/healthz", nil)
			req.Header.Set("Authorization", "Bearer "+testToken)
			req.Host = host
			rec := httptest.NewRecorder()
			s.ServeHTTP(rec, req)
			if rec.Code != want {
				t.Errorf("bound %s, Host %q: status %d, want %d", tc.bound, host, rec.Code, want)
			}
			if want == http.StatusForbidden && !strings.Contains(rec.Body.String(), `"`+host+`"`) {
				t.Errorf("bound %s, Host %q: the refusal does not name the Host: %q", tc.bound, host, rec.Body.String())
			}
		}
		for _, h := range tc.allowed {
			check(h, http.StatusOK)
		}
		for _, h := range tc.refused {
			check(h, http.StatusForbidden)
		}
	}
}

func TestViewEncodedOncePerRevision(t *testing.T) {
	ts, srv, pub := newTestServer(t, FixtureView(20, 8, 1))
	gz := map[string]string{"Accept-Encoding": "gzip"}
	var first []byte
	for i := range 3 {
		resp, body := get(t, ts, "GET", "/api/view", gz)
		if resp.Header.Get("Content-Encoding") != "gzip" {
			t.Fatalf("request %d: Content-Encoding %q, want gzip", i, resp.Header.Get("Content-Encoding"))
		}
		if resp.Header.Get("ETag") != `"1"` {
			t.Fatalf("request %d: ETag %q, want \"1\"", i, resp.Header.Get("ETag"))
		}
		if i == 0 {
			first = body
		} else if string(body) != string(first) {
			t.Fatalf("request %d: a different body for the same revision", i)
		}
	}
	if n := srv.encodes.Load(); n != 1 {
		t.Fatalf("%d encodes for one revision, want 1", n)
	}
	zr, err := gzip.NewReader(strings.NewReader(string(first)))
	if err != nil {
		t.Fatal(err)
	}
	plainFromGzip, _ := io.ReadAll(zr)
	var got View
	if err := json.Unmarshal(plainFromGzip, &got); err != nil {
		t.Fatalf("gzipped body: %v", err)
	}
	if got.Revision != 1 || got.Summary.GPUs != 160 {
		t.Fatalf("revision %d with %d GPUs, want 1 with 160", got.Revision, got.Summary.GPUs)
	}

	// Without gzip: the same JSON, still from the one encode.
	resp, plain := get(t, ts, "GET", "/api/view", nil)
	if resp.Header.Get("Content-Encoding") != "" || string(plain) != string(plainFromGzip) {
		t.Fatalf("plain response: encoding %q, same JSON %v", resp.Header.Get("Content-Encoding"), string(plain) == string(plainFromGzip))
	}
	resp, _ = get(t, ts, "GET", "/api/view", map[string]string{"If-None-Match": `"1"`})
	if resp.StatusCode != http.StatusNotModified {
		t.Fatalf("If-None-Match the current revision: status %d, want 304", resp.StatusCode)
	}
	if n := srv.encodes.Load(); n != 1 {
		t.Fatalf("%d encodes for one revision, want 1", n)
	}

	pub.Publish(FixtureView(20, 8, 2))
	for range 2 {
		resp, _ = get(t, ts, "GET", "/api/view", gz)
		if resp.Header.Get("ETag") != `"2"` {
			t.Fatalf("after Publish: ETag %q, want \"2\"", resp.Header.Get("ETag"))
		}
	}
	if n := srv.encodes.Load(); n != 2 {
		t.Fatalf("%d encodes for two revisions, want 2", n)
	}
}

func TestAcceptsGzip(t *testing.T) {
	for header, want := range map[string]bool{
		"":                  false,
		"gzip":              true,
		"deflate, gzip;q=1": true,
		"br, gzip, deflate": true,
		"gzip;q=0":          false,
		"identity":          false,
		"xgzip":             false,
	} {
		req := httptest.NewRequest("GET", "/api/view", nil)
		req.Header.Set("Accept-Encoding", header)
		if got := acceptsGzip(req); got != want {
			t.Errorf("Accept-Encoding %q: %v, want %v", header, got, want)
		}
	}
}

func TestPageAndStatic(t *testing.T) {
	ts, _, _ := newTestServer(t, FixtureView(1, 1, 1))
	resp, body := get(t, ts, "GET", "/", nil)
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/html") {
		t.Errorf("page Content-Type %q", ct)
	}
	if !strings.Contains(string(body), "<title>test &lt;fleet&gt;</title>") {
		t.Errorf("the title is not set, escaped: %s", body[:min(len(body), 300)])
	}
	for path, ctype := range map[string]string{"/static/app.js": "text/javascript", "/static/app.css": "text/css", "/static/favicon.svg": "image/svg+xml"} {
		resp, body := get(t, ts, "GET", path, nil)
		if !strings.HasPrefix(resp.Header.Get("Content-Type"), ctype) || len(body) == 0 {
			t.Errorf("%s: Content-Type %q, %d bytes", path, resp.Header.Get("Content-Type"), len(body))
		}
		etag := resp.Header.Get("ETag")
		resp, body = get(t, ts, "GET", path, map[string]string{"If-None-Match": etag})
		if etag == "" || resp.StatusCode != http.StatusNotModified || len(body) != 0 {
			t.Errorf("%s revalidated with ETag %q: status %d, %d bytes", path, etag, resp.StatusCode, len(body))
		}
	}
}

// TestNoInlineScriptOrStyle: the CSP would block them in the browser; this
// says which file has one without starting a browser.
func TestNoInlineScriptOrStyle(t *testing.T) {
	inlineScript := regexp.MustCompile(`<script(?:\s[^>]*)?>[^<\s]`)
	for _, tc := range []struct {
		file string
		bad  []*regexp.Regexp
	}{
		{"web/index.html", []*regexp.Regexp{inlineScript, regexp.MustCompile(`<style`), regexp.MustCompile(`\sstyle=`), regexp.MustCompile(`\son[a-z]+=`), regexp.MustCompile(`https?://`)}},
		{"web/app.js", []*regexp.Regexp{regexp.MustCompile(`innerHTML|outerHTML|insertAdjacentHTML|document\.write`), regexp.MustCompile(`setAttribute\(['"]style`), regexp.MustCompile(`\beval\(|new Function`), regexp.MustCompile(`https?://(?:[^w]|w[^w])`)}},
	} {
		data, err := os.ReadFile(filepath.FromSlash(tc.file))
		if err != nil {
			t.Fatal(err)
		}
		for _, re := range tc.bad {
			if loc := re.FindIndex(data); loc != nil {
				t.Errorf("%s has %q (CSP: no inline script or style, nothing from elsewhere)", tc.file, data[loc[0]:loc[1]])
			}
		}
	}
}

func TestEventsSendRevisions(t *testing.T) {
	ts, srv, pub := newTestServer(t, FixtureView(1, 1, 1))
	srv.heartbeat = 50 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", ts.URL+"/api/events", nil)
	req.Header.Set("Authorization", "Bearer "+testToken)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("Content-Type %q", ct)
	}
	if cc := resp.Header.Get("Cache-Control"); cc != "no-store" {
		t.Fatalf("Cache-Control %q", cc)
	}
	lines := make(chan string)
	go func() {
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			select {
			case lines <- sc.Text():
			case <-ctx.Done():
				return
			}
		}
		close(lines)
	}()
	// next returns the next event's data, counting heartbeats on the way.
	heartbeats := 0
	next := func() string {
		t.Helper()
		event := ""
		for {
			select {
			case line, ok := <-lines:
				if !ok {
					t.Fatal("the stream ended")
				}
				switch {
				case line == ": heartbeat":
					heartbeats++
				case strings.HasPrefix(line, "event: "):
					event = strings.TrimPrefix(line, "event: ")
				case strings.HasPrefix(line, "data: "):
					if event != "revision" {
						t.Fatalf("data for event %q", event)
					}
					return strings.TrimPrefix(line, "data: ")
				}
			case <-ctx.Done():
				t.Fatal("no event in time")
			}
		}
	}
	if got := next(); got != "1" {
		t.Fatalf("on connect: revision %s, want 1", got)
	}
	time.Sleep(200 * time.Millisecond)
	pub.Publish(FixtureView(1, 1, 2))
	if got := next(); got != "2" {
		t.Fatalf("after Publish: revision %s, want 2", got)
	}
	if heartbeats == 0 {
		t.Fatal("no heartbeat in 200 ms at a 50 ms heartbeat")
	}
	pub.Publish(FixtureView(1, 1, 3))
	pub.Publish(FixtureView(1, 1, 4))
	// Revisions published faster than sent may coalesce: the latest wins.
	for got := next(); got != "4"; got = next() {
		if got != "3" {
			t.Fatalf("revision %s after 2, want 3 or 4", got)
		}
	}
}

func TestEventsEndWhenTheViewerGoes(t *testing.T) {
	srv := NewServer(NewPublisher(FixtureView(1, 1, 1)), ServerOptions{Addr: "127.0.0.1:1", Token: testToken})
	ctx, cancel := context.WithCancel(context.Background())
	req := httptest.NewRequest("GET", "/api/events", nil).WithContext(ctx)
	req.Host = "127.0.0.1:1"
	req.Header.Set("Authorization", "Bearer "+testToken)
	rec := httptest.NewRecorder()
	done := make(chan struct{})
	go func() {
		srv.ServeHTTP(rec, req)
		close(done)
	}()
	select {
	case <-done:
		t.Fatal("the stream ended while the viewer was there")
	case <-time.After(100 * time.Millisecond):
	}
	cancel()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("the stream goes on after the viewer left")
	}
	if !strings.Contains(rec.Body.String(), "event: revision\ndata: 1\n\n") {
		t.Fatalf("stream: %q", rec.Body.String())
	}
}
