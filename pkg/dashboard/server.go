package dashboard

import (
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"html"
	"io/fs"
	"net"
	"net/http"
	"path"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/klog/v2"
)

//go:embed web
var webFS embed.FS

// ServerOptions are what the server needs beyond its Source.
type ServerOptions struct {
	// Addr is the address the server listens on, as the listener reports it
	// (so that a port 0 is resolved): the Host check allows only this
	// address and the loopback names on its port.
	Addr string
	// Title is the page's title (default "gpudra dashboard").
	Title string
	// Token is what every request must carry (tokenAuth); "": a new random
	// one, which Token returns.
	Token string
}

// securityHeaders are set on every response, errors included: the page
// runs only its own script and style, cannot be framed, sends no Referer
// (a kubectl command or a claim name in a URL stays on this machine).
var securityHeaders = map[string]string{
	"Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; " +
		"connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
	"X-Content-Type-Options": "nosniff",
	"Referrer-Policy":        "no-referrer",
	"X-Frame-Options":        "DENY",
}

// contentTypes of the embedded files, fixed here rather than read from the
// system's mime.types: with nosniff, a script served as text/plain would
// not run.
var contentTypes = map[string]string{
	".css": "text/css; charset=utf-8",
	".js":  "text/javascript; charset=utf-8",
	".svg": "image/svg+xml",
}

// defaultHeartbeat keeps an idle event stream alive through proxies and
// lets the server notice a viewer that went away.
const defaultHeartbeat = 15 * time.Second

// Server is the dashboard's HTTP handler: the page, its static files, the
// View as JSON and the revision events. It is read-only: only GET and HEAD.
type Server struct {
	src       Source
	hosts     hostCheck
	auth      tokenAuth
	token     string
	mux       *http.ServeMux
	index     asset
	static    map[string]asset
	heartbeat time.Duration

	// mu guards cached; an encode holds it, so that viewers asking for a
	// new revision at once wait for one encode instead of doing their own.
	mu     sync.Mutex
	cached *encodedView
	// encodes counts View encodings (tests: once per revision).
	encodes atomic.Int64
}

// asset is one embedded file, with the ETag of its content.
type asset struct {
	body        []byte
	etag        string
	contentType string
}

// encodedView is one revision's JSON, plain and gzipped.
type encodedView struct {
	revision uint64
	etag     string
	plain    []byte
	gzipped  []byte
}

// NewServer returns the dashboard's handler over src.
func NewServer(src Source, opts ServerOptions) *Server {
	if opts.Title == "" {
		opts.Title = "gpudra dashboard"
	}
	if opts.Token == "" {
		opts.Token = NewToken()
	}
	hosts := newHostCheck(opts.Addr)
	s := &Server{
		src:       src,
		hosts:     hosts,
		auth:      newTokenAuth(opts.Token, hosts.port),
		token:     opts.Token,
		static:    map[string]asset{},
		heartbeat: defaultHeartbeat,
		mux:       http.NewServeMux(),
	}
	for _, rt := range s.routes() {
		s.mux.HandleFunc(rt.pattern, rt.serve)
	}
	page, err := fs.ReadFile(webFS, "web/index.html")
	if err != nil {
		// The page is embedded: missing, the binary itself is broken.
		panic(fmt.Sprintf("dashboard: embedded index.html: %v", err))
	}
	page = bytes.ReplaceAll(page, []byte("{{title}}"), []byte(html.EscapeString(opts.Title)))
	s.index = newAsset(page, "text/html; charset=utf-8")
	entries, _ := fs.ReadDir(webFS, "web")
	for _, e := range entries {
		if e.IsDir() || e.Name() == "index.html" {
			continue
		}
		body, err := fs.ReadFile(webFS, "web/"+e.Name())
		if err != nil {
			panic(fmt.Sprintf("dashboard: embedded %s: %v", e.Name(), err))
		}
		ctype, ok := contentTypes[path.Ext(e.Name())]
		if !ok {
			ctype = "application/octet-stream"
		}
		s.static[e.Name()] = newAsset(body, ctype)
	}
	return s
}

func newAsset(body []byte, contentType string) asset {
	sum := sha256.Sum256(body)
	return asset{body: body, etag: `"` + hex.EncodeToString(sum[:8]) + `"`, contentType: contentType}
}

// Token is the token every request must carry.
func (s *Server) Token() string { return s.token }

// route is one path the server serves: pattern as http.ServeMux reads it.
type route struct {
	pattern string
	// example is a path the pattern serves (the tests ask each).
	example string
	serve   http.HandlerFunc
}

// routes are every path the server serves; ServeHTTP checks the Host, the
// token and the method before any of them.
func (s *Server) routes() []route {
	return []route{
		{pattern: "/{$}", example: "/", serve: func(w http.ResponseWriter, r *http.Request) { serveAsset(w, r, s.index) }},
		{pattern: "/static/", example: "/static/app.js", serve: s.serveStatic},
		{pattern: "/api/view", example: "/api/view", serve: s.serveView},
		{pattern: "/api/events", example: "/api/events", serve: s.serveEvents},
		{pattern: "/healthz", example: "/healthz", serve: func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "text/plain; charset=utf-8")
			_, _ = w.Write([]byte("ok\n"))
		}},
	}
}

// ServeHTTP implements http.Handler.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	for k, v := range securityHeaders {
		h.Set(k, v)
	}
	// The Host check comes first: a page on another name (DNS rebinding)
	// must learn nothing, not even which methods exist.
	if !s.hosts.allowed(r.Host) {
		http.Error(w, fmt.Sprintf("gpudra dashboard: Host %q is not this server's; open it as %s", r.Host, s.hosts.hint()), http.StatusForbidden)
		return
	}
	// Then the token, before any path or method is told apart.
	if !s.auth.authorize(w, r) {
		return
	}
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		h.Set("Allow", "GET, HEAD")
		http.Error(w, "gpudra dashboard is read-only: only GET and HEAD", http.StatusMethodNotAllowed)
		return
	}
	if strings.HasPrefix(r.URL.Path, "/api/") {
		h.Set("Cache-Control", "no-store")
	}
	s.mux.ServeHTTP(w, r)
}

func (s *Server) serveStatic(w http.ResponseWriter, r *http.Request) {
	a, ok := s.static[strings.TrimPrefix(r.URL.Path, "/static/")]
	if !ok {
		http.NotFound(w, r)
		return
	}
	serveAsset(w, r, a)
}

// serveAsset serves an embedded file. no-cache with an ETag: the browser
// revalidates each load (a 304 costs nothing) so that a new binary's page
// is never mixed with an old cached script.
func serveAsset(w http.ResponseWriter, r *http.Request, a asset) {
	h := w.Header()
	h.Set("ETag", a.etag)
	h.Set("Cache-Control", "no-cache")
	if r.Header.Get("If-None-Match") == a.etag {
		w.WriteHeader(http.StatusNotModified)
		return
	}
	h.Set("Content-Type", a.contentType)
	h.Set("Content-Length", strconv.Itoa(len(a.body)))
	if r.Method == http.MethodHead {
		return
	}
	_, _ = w.Write(a.body)
}

func (s *Server) serveView(w http.ResponseWriter, r *http.Request) {
	view, _ := s.src.Current()
	if view == nil {
		http.Error(w, "no view yet", http.StatusServiceUnavailable)
		return
	}
	enc, err := s.encoded(view)
	if err != nil {
		klog.FromContext(r.Context()).Error(err, "Encoding the dashboard view", "revision", view.Revision)
		http.Error(w, "encoding the view failed", http.StatusInternalServerError)
		return
	}
	h := w.Header()
	h.Set("ETag", enc.etag)
	h.Set("Vary", "Accept-Encoding")
	if r.Header.Get("If-None-Match") == enc.etag {
		w.WriteHeader(http.StatusNotModified)
		return
	}
	h.Set("Content-Type", "application/json")
	body := enc.plain
	if acceptsGzip(r) {
		h.Set("Content-Encoding", "gzip")
		body = enc.gzipped
	}
	h.Set("Content-Length", strconv.Itoa(len(body)))
	if r.Method == http.MethodHead {
		return
	}
	_, _ = w.Write(body)
}

// encoded returns view's encoding, made once per revision whatever the
// number of viewers: a 1,000-node View is megabytes of JSON.
func (s *Server) encoded(view *View) (*encodedView, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cached != nil && s.cached.revision == view.Revision {
		return s.cached, nil
	}
	plain, err := json.Marshal(view)
	if err != nil {
		return nil, fmt.Errorf("encoding revision %d: %w", view.Revision, err)
	}
	var buf bytes.Buffer
	// BestSpeed: a revision can come every few hundred milliseconds and a
	// 1,000-node View is megabytes; the default level costs several times
	// the CPU for a body about half the size, which on a loopback or a LAN
	// buys nothing.
	zw, _ := gzip.NewWriterLevel(&buf, gzip.BestSpeed)
	if _, err := zw.Write(plain); err != nil {
		return nil, fmt.Errorf("compressing revision %d: %w", view.Revision, err)
	}
	if err := zw.Close(); err != nil {
		return nil, fmt.Errorf("compressing revision %d: %w", view.Revision, err)
	}
	s.encodes.Add(1)
	s.cached = &encodedView{
		revision: view.Revision,
		etag:     `"` + strconv.FormatUint(view.Revision, 10) + `"`,
		plain:    plain,
		gzipped:  buf.Bytes(),
	}
	return s.cached, nil
}

func acceptsGzip(r *http.Request) bool {
	for _, part := range strings.Split(r.Header.Get("Accept-Encoding"), ",") {
		name, params, _ := strings.Cut(strings.TrimSpace(part), ";")
		if strings.TrimSpace(name) != "gzip" {
			continue
		}
		// "gzip;q=0" refuses it.
		q := strings.ReplaceAll(params, " ", "")
		return q != "q=0" && q != "q=0.0" && q != "q=0.00" && q != "q=0.000"
	}
	return false
}

// serveEvents streams the revisions: one event on connect, one per new
// revision, a comment every heartbeat. A viewer costs a goroutine waiting
// on the Source's channel, nothing on the cluster.
func (s *Server) serveEvents(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("X-Accel-Buffering", "no")
	if r.Method == http.MethodHead {
		return
	}
	rc := http.NewResponseController(w)
	// A server-wide WriteTimeout would cut the stream; this one has none.
	if err := rc.SetWriteDeadline(time.Time{}); err != nil && !errors.Is(err, http.ErrNotSupported) {
		klog.FromContext(r.Context()).V(4).Info("Clearing the event stream's write deadline", "err", err)
	}
	w.WriteHeader(http.StatusOK)
	// retry: a viewer whose server restarted is back within 2 s.
	if _, err := fmt.Fprint(w, "retry: 2000\n\n"); err != nil {
		return
	}
	heartbeat := time.NewTicker(s.heartbeat)
	defer heartbeat.Stop()
	var sent uint64
	for {
		view, changed := s.src.Current()
		if view != nil && view.Revision != sent {
			sent = view.Revision
			if _, err := fmt.Fprintf(w, "event: revision\ndata: %d\n\n", sent); err != nil {
				return
			}
		}
		if err := rc.Flush(); err != nil {
			return
		}
		select {
		case <-r.Context().Done():
			return
		case <-changed:
		case <-heartbeat.C:
			if _, err := fmt.Fprint(w, ": heartbeat\n\n"); err != nil {
				return
			}
		}
	}
}

// hostCheck guards against DNS rebinding: a page on attacker.example that
// resolves its name to 127.0.0.1 reaches this server with Host
// attacker.example, and is refused. An IP literal cannot be rebound, so
// when the server is bound to every interface (0.0.0.0, ::) any IP literal
// on its port is allowed; a name only when it is a loopback name.
type hostCheck struct {
	port     string
	bound    string // the bound host, lower case, without brackets
	anyIP    bool   // bound to an unspecified address
	loopback map[string]bool
}

func newHostCheck(addr string) hostCheck {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		host, port = addr, "80"
	}
	c := hostCheck{
		port:     port,
		bound:    strings.ToLower(host),
		loopback: map[string]bool{"localhost": true, "127.0.0.1": true, "::1": true},
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		c.anyIP = true
	}
	return c
}

func (c hostCheck) allowed(hostport string) bool {
	host, port, err := net.SplitHostPort(hostport)
	if err != nil {
		// No port: the browser omits the default one.
		host, port = strings.Trim(hostport, "[]"), "80"
	}
	host = strings.ToLower(strings.TrimSuffix(host, "."))
	if host == "" || port != c.port {
		return false
	}
	if c.loopback[host] || host == c.bound {
		return true
	}
	return c.anyIP && net.ParseIP(host) != nil
}

// hint is the address a refused viewer should use.
func (c hostCheck) hint() string {
	return "http://" + net.JoinHostPort("127.0.0.1", c.port) + "/?" + TokenParam + "=..."
}
