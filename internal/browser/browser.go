// Package browser starts a headless Chromium for tests of gpudra's web
// pages (chromedp), finds what went wrong on the page (JS exceptions, CSP
// violations, console errors), and takes screenshots.
package browser

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"

	"github.com/chromedp/cdproto/log"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"
)

// ErrNoBrowser: no Chromium or Chrome was found.
var ErrNoBrowser = errors.New("no Chromium or Chrome found (Debian: apt-get install chromium, or set $CHROMIUM)")

// RequireEnv, set to 1, turns a missing browser from a skip into a failure
// (CI, where the browser tests must run).
const RequireEnv = "GPUDRA_REQUIRE_BROWSER"

// candidates are tried in order after $CHROMIUM.
var candidates = []string{"/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome", "google-chrome-stable"}

// Find returns the browser to run: $CHROMIUM, else the first candidate
// found.
func Find() (string, error) {
	if p := os.Getenv("CHROMIUM"); p != "" {
		found, err := exec.LookPath(p)
		if err != nil {
			return "", fmt.Errorf("$CHROMIUM=%s: %w: %w", p, ErrNoBrowser, err)
		}
		return found, nil
	}
	for _, c := range candidates {
		if p, err := exec.LookPath(c); err == nil {
			return p, nil
		}
	}
	return "", ErrNoBrowser
}

type options struct {
	width, height int
	execPath      string
}

// Option changes how New starts the browser.
type Option func(*options)

// WindowSize sets the window (default 1400x1000).
func WindowSize(width, height int) Option {
	return func(o *options) { o.width, o.height = width, height }
}

// ExecPath runs this browser instead of the one Find finds.
func ExecPath(path string) Option {
	return func(o *options) { o.execPath = path }
}

// New starts a headless browser and returns a chromedp context on its first
// tab; cancel stops the browser. More tabs: chromedp.NewContext(ctx).
// It returns ErrNoBrowser (wrapped) when none is installed.
func New(ctx context.Context, opts ...Option) (context.Context, context.CancelFunc, error) {
	o := options{width: 1400, height: 1000}
	for _, opt := range opts {
		opt(&o)
	}
	if o.execPath == "" {
		p, err := Find()
		if err != nil {
			return nil, nil, err
		}
		o.execPath = p
	}
	flags := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(o.execPath),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.WindowSize(o.width, o.height),
	)
	actx, cancelAlloc := chromedp.NewExecAllocator(ctx, flags...)
	bctx, cancelBrowser := chromedp.NewContext(actx)
	// Run with no action starts the browser, so that a browser that cannot
	// start fails here, with its reason, instead of in the first action.
	if err := chromedp.Do(bctx); err != nil {
		cancelBrowser()
		cancelAlloc()
		return nil, nil, fmt.Errorf("starting %s: %w", o.execPath, err)
	}
	return bctx, func() { cancelBrowser(); cancelAlloc() }, nil
}

// SkipOrFail ends a test that could not start a browser: a skip naming the
// package to install when none is there, a failure when RequireEnv is 1 or
// the browser is there but would not start.
func SkipOrFail(t testing.TB, err error) {
	t.Helper()
	if errors.Is(err, ErrNoBrowser) && os.Getenv(RequireEnv) != "1" {
		t.Skipf("browser test skipped: %v (set %s=1 to make this a failure)", err, RequireEnv)
	}
	t.Fatalf("browser: %v", err)
}

// Console collects what went wrong on a page: uncaught exceptions, console
// errors and the browser's own error entries, CSP violations among them.
type Console struct {
	mu   sync.Mutex
	errs []error
}

// CollectConsole listens on ctx's tab (opening it if need be) from now on;
// call it before navigating. It listens in the tab's own event loop, so an
// error the page reported before an action's reply is collected by the time
// that action returns.
func CollectConsole(ctx context.Context) (*Console, error) {
	c := &Console{}
	err := chromedp.Listen(ctx, func(ev any) {
		switch ev := ev.(type) {
		case *runtime.EventExceptionThrown:
			d := ev.ExceptionDetails
			msg := d.Text
			if d.Exception != nil && d.Exception.Description != "" {
				msg += ": " + d.Exception.Description
			}
			c.add(fmt.Errorf("exception at %s:%d: %s", d.URL, d.LineNumber+1, msg))
		case *runtime.EventConsoleAPICalled:
			if ev.Type != runtime.ConsoleAPICalledTypeError && ev.Type != runtime.ConsoleAPICalledTypeAssert {
				return
			}
			var parts []string
			for _, a := range ev.Args {
				if a.Description != "" {
					parts = append(parts, a.Description)
				} else {
					parts = append(parts, strings.Trim(string(a.Value), `"`))
				}
			}
			c.add(fmt.Errorf("console.%s: %s", ev.Type, strings.Join(parts, " ")))
		case *log.EventEntryAdded:
			// CSP violations, failed loads and the like are the browser's
			// own entries, not the page's console calls.
			if e := ev.Entry; e.Level == log.EntryLevelError {
				c.add(fmt.Errorf("%s error: %s (%s)", e.Source, e.Text, e.URL))
			}
		}
	})
	if err != nil {
		return nil, fmt.Errorf("listening to the console: %w", err)
	}
	return c, nil
}

func (c *Console) add(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.errs = append(c.errs, err)
}

// Errors returns what was collected so far.
func (c *Console) Errors() []error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]error(nil), c.errs...)
}

// Err joins what was collected so far; nil when nothing went wrong.
func (c *Console) Err() error {
	return errors.Join(c.Errors()...)
}

// Screenshot writes a full-page PNG of the tab to path.
func Screenshot(path string) chromedp.Action[chromedp.Void] {
	return chromedp.Func(func(ctx context.Context, t *chromedp.Target) error {
		png, err := chromedp.FullScreenshot(100)(ctx, t)
		if err != nil {
			return fmt.Errorf("screenshot: %w", err)
		}
		if err := os.WriteFile(path, png, 0o644); err != nil {
			return fmt.Errorf("screenshot: %w", err)
		}
		return nil
	})
}
