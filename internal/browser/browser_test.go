package browser

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
)

func TestFindHonoursChromiumEnv(t *testing.T) {
	t.Setenv("CHROMIUM", filepath.Join(t.TempDir(), "no-such-browser"))
	if _, err := Find(); !errors.Is(err, ErrNoBrowser) {
		t.Fatalf("Find with $CHROMIUM missing: %v, want ErrNoBrowser", err)
	}
	if _, _, err := New(context.Background()); !errors.Is(err, ErrNoBrowser) {
		t.Fatalf("New with $CHROMIUM missing: %v, want ErrNoBrowser", err)
	}
}

// TestConsoleCatchesWhatTheDashboardMustNotDo serves pages under the
// dashboard's CSP: each fault must be collected, and a clean page must
// collect nothing, or a test asserting "no console errors" proves nothing.
func TestConsoleCatchesWhatTheDashboardMustNotDo(t *testing.T) {
	const csp = "default-src 'none'; script-src 'self'; style-src 'self'; img-src data:"
	pages := map[string]string{
		"/clean":         `<p id="ok">fine</p><script src="/ok.js"></script>`,
		"/inline-script": `<script>document.title = "ran"</script>`,
		"/inline-style":  `<p style="color: red">red</p>`,
		"/throws":        `<script src="/throw.js"></script>`,
		"/console-error": `<script src="/error.js"></script>`,
	}
	scripts := map[string]string{
		"/ok.js":    `document.getElementById("ok").style.color = "green";`, // CSSOM: allowed
		"/throw.js": `null.boom;`,
		"/error.js": `console.error("something broke");`,
	}
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Security-Policy", csp)
		if js, ok := scripts[r.URL.Path]; ok {
			w.Header().Set("Content-Type", "text/javascript")
			_, _ = w.Write([]byte(js))
			return
		}
		if page, ok := pages[r.URL.Path]; ok {
			w.Header().Set("Content-Type", "text/html")
			_, _ = w.Write([]byte(`<!doctype html><html><head><link rel="icon" href="data:,"></head><body>` + page + `</body></html>`))
			return
		}
		http.NotFound(w, r)
	}))
	defer ts.Close()

	bctx, cancel, err := New(context.Background())
	if err != nil {
		SkipOrFail(t, err)
	}
	defer cancel()
	for _, tc := range []struct {
		path string
		want string // "" for no error
	}{
		{"/clean", ""},
		{"/inline-script", "Content Security Policy"},
		{"/inline-style", "Content Security Policy"},
		{"/throws", "exception"},
		{"/console-error", "something broke"},
	} {
		t.Run(strings.TrimPrefix(tc.path, "/"), func(t *testing.T) {
			tab, closeTab := chromedp.NewContext(bctx)
			defer closeTab()
			console, err := CollectConsole(tab)
			if err != nil {
				t.Fatal(err)
			}
			ctx, stop := context.WithTimeout(tab, 30*time.Second)
			defer stop()
			if err := chromedp.Do(ctx, chromedp.Navigate(ts.URL+tc.path), chromedp.Sleep(300*time.Millisecond)); err != nil {
				t.Fatal(err)
			}
			got := console.Err()
			switch {
			case tc.want == "" && got != nil:
				t.Fatalf("a clean page reported: %v", got)
			case tc.want != "" && (got == nil || !strings.Contains(got.Error(), tc.want)):
				t.Fatalf("want an error with %q, got %v", tc.want, got)
			}
		})
	}

	t.Run("screenshot", func(t *testing.T) {
		tab, closeTab := chromedp.NewContext(bctx)
		defer closeTab()
		path := filepath.Join(t.TempDir(), "shot.png")
		ctx, stop := context.WithTimeout(tab, 30*time.Second)
		defer stop()
		if err := chromedp.Do(ctx, chromedp.Navigate(ts.URL+"/clean"), Screenshot(path)); err != nil {
			t.Fatal(err)
		}
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.HasPrefix(data, []byte("\x89PNG")) {
			t.Fatalf("%s is not a PNG (%d bytes)", path, len(data))
		}
	})
}
