package dashboardbench

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/gpudra/gpudra/pkg/dashboard"
)

// api reads the dashboard's server as a client would, with the token
// of the URL it printed.
type api struct {
	base, token string
	client      *http.Client
}

func newAPI(base, token string) *api {
	// No transparent gzip: sizes are what goes over the wire.
	return &api{base: base, token: token, client: &http.Client{Transport: &http.Transport{DisableCompression: true}}}
}

// splitPrinted is the URL gpudra dashboard printed as its base (ending in
// "/") and its token.
func splitPrinted(printed string) (base, token string, err error) {
	u, err := url.Parse(printed)
	if err != nil {
		return "", "", fmt.Errorf("the dashboard's URL %q: %w", printed, err)
	}
	token = u.Query().Get(dashboard.TokenParam)
	if token == "" {
		return "", "", fmt.Errorf("the dashboard's URL %q carries no %s", printed, dashboard.TokenParam)
	}
	return u.Scheme + "://" + u.Host + "/", token, nil
}

func (a *api) get(ctx context.Context, path string, gz bool) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, a.base+path, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+a.token)
	if gz {
		req.Header.Set("Accept-Encoding", "gzip")
	}
	resp, err := a.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s: %s", path, resp.Status, bytes.TrimSpace(body))
	}
	if gz != (resp.Header.Get("Content-Encoding") == "gzip") {
		return nil, fmt.Errorf("GET %s (gzip %v): Content-Encoding %q", path, gz, resp.Header.Get("Content-Encoding"))
	}
	return body, nil
}

// waitSummary polls /api/view until ok holds for its summary.
func (a *api) waitSummary(ctx context.Context, ok func(dashboard.Summary) bool, timeout time.Duration) (dashboard.Summary, uint64, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var last struct {
		Revision uint64            `json:"revision"`
		Summary  dashboard.Summary `json:"summary"`
	}
	for {
		body, err := a.get(ctx, "api/view", false)
		if err == nil {
			err = json.Unmarshal(body, &last)
			if err == nil && ok(last.Summary) {
				return last.Summary, last.Revision, nil
			}
		}
		select {
		case <-ctx.Done():
			if err == nil {
				err = ctx.Err()
			}
			return last.Summary, last.Revision, err
		case <-time.After(time.Second):
		}
	}
}

// sizes are /api/view's body, plain and gzipped as served.
func (a *api) sizes(ctx context.Context) (plain, gz int, err error) {
	p, err := a.get(ctx, "api/view", false)
	if err != nil {
		return 0, 0, err
	}
	g, err := a.get(ctx, "api/view", true)
	if err != nil {
		return 0, 0, err
	}
	return len(p), len(g), nil
}

// encode is what the server does once per revision (pkg/dashboard's
// Server.encoded): JSON, then gzip at BestSpeed.
func encode(v *dashboard.View) (plain, gz []byte, err error) {
	if plain, err = json.Marshal(v); err != nil {
		return nil, nil, err
	}
	var buf bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&buf, gzip.BestSpeed)
	if _, err := zw.Write(plain); err != nil {
		return nil, nil, err
	}
	if err := zw.Close(); err != nil {
		return nil, nil, err
	}
	return plain, buf.Bytes(), nil
}

// revisions follows /api/events: the latest revision announced and when it
// arrived. Reading the events encodes nothing: which revisions are cold
// stays under the benchmark's control.
type revisions struct {
	mu      sync.Mutex
	rev     uint64
	at      time.Time
	changed chan struct{}
}

func watchRevisions(ctx context.Context, a *api) (*revisions, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, a.base+"api/events", nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+a.token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		resp.Body.Close()
		return nil, fmt.Errorf("GET /api/events: %s", resp.Status)
	}
	r := &revisions{changed: make(chan struct{})}
	first := make(chan struct{})
	go func() {
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		once := false
		for sc.Scan() {
			data, ok := strings.CutPrefix(sc.Text(), "data: ")
			if !ok {
				continue
			}
			n, err := strconv.ParseUint(data, 10, 64)
			if err != nil {
				continue
			}
			r.mu.Lock()
			r.rev, r.at = n, time.Now()
			close(r.changed)
			r.changed = make(chan struct{})
			r.mu.Unlock()
			if !once {
				once = true
				close(first)
			}
		}
	}()
	select {
	case <-first:
	case <-time.After(10 * time.Second):
		return nil, fmt.Errorf("no revision event from /api/events in 10 s")
	}
	return r, nil
}

// current is the latest revision announced and when it came.
func (r *revisions) current() (uint64, time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.rev, r.at
}

// after waits for a revision above rev and returns it with its arrival.
func (r *revisions) after(ctx context.Context, rev uint64, timeout time.Duration) (uint64, time.Time, error) {
	deadline := time.After(timeout)
	for {
		r.mu.Lock()
		n, at, ch := r.rev, r.at, r.changed
		r.mu.Unlock()
		if n > rev {
			return n, at, nil
		}
		select {
		case <-ch:
		case <-deadline:
			return n, at, fmt.Errorf("no revision after %d within %s", rev, timeout)
		case <-ctx.Done():
			return n, at, ctx.Err()
		}
	}
}

// quiet waits until no new revision came for d (the source's debounce
// leaves a burst of changes as one or two revisions).
func (r *revisions) quiet(ctx context.Context, d, timeout time.Duration) (uint64, error) {
	deadline := time.Now().Add(timeout)
	for {
		rev, _ := r.current()
		select {
		case <-ctx.Done():
			return rev, ctx.Err()
		case <-time.After(d):
		}
		if now, _ := r.current(); now == rev {
			return rev, nil
		}
		if time.Now().After(deadline) {
			return rev, fmt.Errorf("revisions kept coming for %s", timeout)
		}
	}
}
