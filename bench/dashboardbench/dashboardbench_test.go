package dashboardbench

import (
	"bytes"
	"context"
	"errors"
	"testing"

	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/internal/browser"
)

// TestRun runs the benchmark small (40 nodes, 2 loads, 2 updates) so that
// make bench-dashboard keeps working: the page painted, its summary shows
// every claim created, and each allocation and deletion was seen. The
// figures are the benchmark's business. Without a browser it is skipped,
// or fails under GPUDRA_REQUIRE_BROWSER=1.
func TestRun(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a control plane and a browser")
	}
	if _, err := browser.Find(); err != nil {
		browser.SkipOrFail(t, err)
	}
	var out bytes.Buffer
	res, err := Run(context.Background(), Config{Nodes: 40, Runs: 2, Chart: chart.Default("../.."), Dir: t.TempDir(), Out: &out})
	t.Log("\n" + out.String())
	if errors.Is(err, browser.ErrNoBrowser) {
		browser.SkipOrFail(t, err)
	}
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Paints) != 2 {
		t.Fatalf("%d loads timed, want 2", len(res.Paints))
	}
	cold := 0
	for i, p := range res.Paints {
		if p.FirstPaint <= 0 {
			t.Errorf("load %d: first paint %v ms, want it measured", i+1, p.FirstPaint)
		}
		if p.Allocated != res.Claims {
			t.Errorf("load %d: the page's summary shows %d allocated, want the %d claims created", i+1, p.Allocated, res.Claims)
		}
		if p.Cards == 0 || p.Cards > res.GPUs {
			t.Errorf("load %d: %d GPU cards in the DOM, want 1..%d", i+1, p.Cards, res.GPUs)
		}
		if p.Cold {
			cold++
		}
	}
	if cold != 1 || !res.Paints[1].Cold {
		t.Errorf("cold loads %+v: want the last one only", res.Paints)
	}
	if len(res.Updates) != 2 {
		t.Fatalf("%d updates timed, want 2", len(res.Updates))
	}
	for i, u := range res.Updates {
		if !u.Seen || u.Appear <= 0 || u.Gone <= 0 {
			t.Errorf("update %d: %+v, want the holder seen drawn and gone", i+1, u)
		}
	}
	if res.ViewPlain == 0 || res.ViewGzip == 0 || res.ViewGzip >= res.ViewPlain {
		t.Errorf("/api/view: %d bytes plain, %d gzipped", res.ViewPlain, res.ViewGzip)
	}
}
