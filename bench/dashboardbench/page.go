package dashboardbench

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"github.com/gpudra/gpudra/bench/scalebench"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// bench is the browser half of a run.
type bench struct {
	cfg    Config
	base   string
	api    *api
	events *revisions
	bctx   context.Context
	writer kubernetes.Interface
	// fetched are the revisions some client asked /api/view for: the
	// server has encoded those (it encodes the current revision on its
	// first request).
	fetched map[uint64]bool
}

// pageTimings is what the page and Chrome say about one load (ms since
// navigation start).
type pageTimings struct {
	FirstPaint float64 `json:"firstPaint"`
	Revision   uint64  `json:"revision"`
	Cards      int     `json:"cards"`
	Allocated  int     `json:"allocated"`
	// The document's and app.js's responses, DOMContentLoaded (app.js is
	// deferred: it has run by then).
	DocEnd, ScriptEnd, DOMContentLoaded float64
	// /api/view: request start, first byte, last byte, bytes on the wire
	// and decoded.
	ViewStart, ViewFirstByte, ViewEnd float64
	ViewTransfer, ViewDecoded         int
	// Painted is after the frame that first shows the fleet rows (a
	// requestAnimationFrame, then a task, once the first card is in the
	// DOM): gpudraFirstPaint is when the rows are appended, before the
	// browser lays them out and paints them.
	Painted float64
	// LongTasks are the main thread's tasks over 50 ms up to Painted:
	// [start, duration] each.
	LongTasks [][2]float64
}

// probeScript runs in each new document before the page's own script
// (the page's CSP does not apply to it): it records the long tasks and
// when the frame after the first card was drawn.
const probeScript = `(() => {
  window.benchLong = [];
  try {
    new PerformanceObserver((l) => { for (const e of l.getEntries()) window.benchLong.push([e.startTime, e.duration]); }).observe({type: 'longtask'});
  } catch (e) { /* no long task timing */ }
  new MutationObserver((m, o) => {
    if (!document.querySelector('[data-testid="gpu"]')) return;
    o.disconnect();
    requestAnimationFrame(() => setTimeout(() => { window.benchPainted = performance.now(); }));
  }).observe(document, {subtree: true, childList: true});
})()`

// viewParse times, in the page, fetching /api/view to a string and
// JSON.parse of it, three times.
const viewParse = `(async () => {
  const out = [];
  for (let i = 0; i < 3; i++) {
    const t0 = performance.now();
    const r = await fetch('/api/view', {cache: 'no-store'});
    const text = await r.text();
    const t1 = performance.now();
    JSON.parse(text);
    out.push([t1 - t0, performance.now() - t1]);
  }
  return out;
})()`

const readTimings = `(() => {
  const nav = performance.getEntriesByType('navigation')[0] || {};
  const res = performance.getEntriesByType('resource');
  const find = (s) => res.find((e) => e.name.includes(s)) || {};
  const v = find('/api/view'), js = find('/static/app.js');
  const chip = document.querySelector('#summary .st-allocated b');
  return {firstPaint: window.gpudraFirstPaint, revision: Number(document.body.dataset.revision),
    cards: document.querySelectorAll('[data-testid="gpu"]').length,
    allocated: chip ? Number(chip.textContent) : -1,
    DocEnd: nav.responseEnd || 0, ScriptEnd: js.responseEnd || 0, DOMContentLoaded: nav.domContentLoadedEventEnd || 0,
    ViewStart: v.startTime || 0, ViewFirstByte: v.responseStart || 0, ViewEnd: v.responseEnd || 0,
    ViewTransfer: v.transferSize || 0, ViewDecoded: v.decodedBodySize || 0,
    Painted: window.benchPainted || 0, LongTasks: (window.benchLong || []).filter(([s]) => s <= (window.benchPainted || Infinity))};
})()`

// firstPaints loads the page in R fresh tabs. All but the last find the
// current revision encoded already (warm); before the last a node changes,
// so that its load is the new revision's first request (cold).
func (b *bench) firstPaints(ctx context.Context, admin kubernetes.Interface, res *Result) error {
	logger := klog.FromContext(ctx)
	for i := range b.cfg.Runs {
		coldRun := i == b.cfg.Runs-1
		if coldRun {
			before, _ := b.events.current()
			patch := fmt.Sprintf(`{"metadata":{"annotations":{"bench.gpudra.dev/touch":"%d"}}}`, i)
			if _, err := admin.CoreV1().Nodes().Patch(ctx, scalebench.FleetNodeName(0), types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
				return fmt.Errorf("touching a node for a new revision: %w", err)
			}
			if _, _, err := b.events.after(ctx, before, 30*time.Second); err != nil {
				return err
			}
		}
		rev, err := b.events.quiet(ctx, time.Second, time.Minute)
		if err != nil {
			return err
		}
		if !coldRun && !b.fetched[rev] {
			// A revision of the source's own (its history ticks every
			// minute): encode it first, so that this run is warm.
			if _, err := b.api.get(ctx, "api/view", true); err != nil {
				return err
			}
			b.fetched[rev] = true
		}
		tm, err := b.load(ctx, b.base)
		if err != nil {
			return fmt.Errorf("first paint, run %d: %w", i+1, err)
		}
		run := PaintRun{pageTimings: tm, Cold: !b.fetched[tm.Revision]}
		b.fetched[tm.Revision] = true
		res.Paints = append(res.Paints, run)
		logger.Info("First paint", "run", i+1, "ms", tm.FirstPaint, "cold", run.Cold, "revision", tm.Revision, "cards", tm.Cards,
			"viewFetch", tm.ViewEnd-tm.ViewStart, "afterView", tm.FirstPaint-tm.ViewEnd, "painted", tm.Painted, "longTasks", tm.LongTasks)
	}
	// JSON.parse of the body alone, in a page: what of "after the body"
	// is parsing, what is drawing.
	tab, closeTab := chromedp.NewContext(b.bctx)
	defer closeTab()
	tctx, cancel := context.WithTimeout(tab, time.Minute)
	defer cancel()
	if err := chromedp.Do(tctx, chromedp.Navigate(b.base+"healthz")); err != nil {
		return err
	}
	pairs, err := chromedp.Run(tctx, chromedp.Evaluate[[][2]float64](viewParse, chromedp.EvalAwaitPromise))
	if err != nil {
		return fmt.Errorf("timing JSON.parse of /api/view: %w", err)
	}
	var fetches, parses []float64
	for _, p := range pairs {
		fetches, parses = append(fetches, p[0]), append(parses, p[1])
	}
	res.ViewFetchText, res.ViewParse = medianF(fetches), medianF(parses)
	return nil
}

// load opens url in a new tab and waits for the first fleet rows.
func (b *bench) load(ctx context.Context, url string) (pageTimings, error) {
	var tm pageTimings
	tab, closeTab := chromedp.NewContext(b.bctx)
	defer closeTab()
	tctx, cancel := context.WithTimeout(tab, 90*time.Second)
	defer cancel()
	probe := chromedp.Func(func(ctx context.Context, t *chromedp.Target) error {
		_, err := cdp.Call(ctx, t, page.AddScriptToEvaluateOnNewDocument, page.AddScriptToEvaluateOnNewDocumentParams{Source: probeScript})
		return err
	})
	if err := chromedp.Do(tctx, probe, chromedp.Navigate(url)); err != nil {
		return tm, err
	}
	if _, err := chromedp.Run(tctx, chromedp.Poll[bool](`window.gpudraFirstPaint !== undefined && window.benchPainted !== undefined`,
		chromedp.WithPollingTimeout(60*time.Second), chromedp.WithPollingInterval(20*time.Millisecond))); err != nil {
		return tm, fmt.Errorf("waiting for window.gpudraFirstPaint: %w", err)
	}
	raw, err := chromedp.Run(tctx, chromedp.Evaluate[[]byte](readTimings))
	if err != nil {
		return tm, err
	}
	if err := json.Unmarshal(raw, &tm); err != nil {
		return tm, fmt.Errorf("the page's timings %s: %w", raw, err)
	}
	return tm, nil
}

// watchHolder records in the page (Date.now(), this machine's clock) when
// the holder element of claim first appears and when it goes again: a
// MutationObserver sees the DOM change itself, whatever the polling.
func watchHolder(claim string) string {
	return fmt.Sprintf(`(() => {
  const sel = '[data-testid="holder"][data-claim="%s"]';
  window.benchSeen = 0; window.benchGone = 0;
  const check = () => {
    const found = !!document.querySelector(sel);
    if (found && !window.benchSeen) window.benchSeen = Date.now();
    if (!found && window.benchSeen && !window.benchGone) window.benchGone = Date.now();
  };
  new MutationObserver(check).observe(document.body, {subtree: true, childList: true, attributes: true});
  check();
  return window.benchSeen === 0;
})()`, claim)
}

// updates allocates a claim to a free GPU in the middle of the fleet with
// a tab open on a search for it, and times until its holder is in the
// page; then deletes it and times until it is gone.
func (b *bench) updates(ctx context.Context, res *Result) error {
	logger := klog.FromContext(ctx)
	for i := range b.cfg.Runs {
		node := scalebench.FleetNodeName((b.cfg.Nodes/2 + i) % b.cfg.Nodes)
		h := holder{namespace: Namespaces[i%len(Namespaces)], name: fmt.Sprintf("probe-%d", i), node: node,
			device: fmt.Sprintf("gpu-%d", heldPerNode+i%(gpusPerNode-heldPerNode))}
		u, err := b.update(ctx, h)
		if err != nil {
			return fmt.Errorf("update run %d (%s on %s/%s): %w", i+1, h.name, h.node, h.device, err)
		}
		res.Updates = append(res.Updates, u)
		logger.Info("Update", "run", i+1, "claim", h.name, "appearMs", u.Appear.Milliseconds(), "goneMs", u.Gone.Milliseconds(),
			"revisionMs", u.Revision.Milliseconds())
	}
	return nil
}

// signIn opens the URL gpudra dashboard printed, whose token the server
// exchanges for a cookie that the browser's later tabs send.
func (b *bench) signIn(ctx context.Context, printed string) error {
	tab, closeTab := chromedp.NewContext(b.bctx)
	defer closeTab()
	tctx, cancel := context.WithTimeout(tab, time.Minute)
	defer cancel()
	if err := chromedp.Do(tctx, chromedp.Navigate(printed)); err != nil {
		return fmt.Errorf("opening the dashboard's URL: %w", err)
	}
	return nil
}

func (b *bench) update(ctx context.Context, h holder) (UpdateRun, error) {
	var u UpdateRun
	c := b.writer
	tab, closeTab := chromedp.NewContext(b.bctx)
	defer closeTab()
	tctx, cancel := context.WithTimeout(tab, 2*time.Minute)
	defer cancel()
	if err := chromedp.Do(tctx, chromedp.Navigate(b.base+"#q="+h.name)); err != nil {
		return u, err
	}
	waitPage := func(cond string) error {
		_, err := chromedp.Run(tctx, chromedp.Poll[bool](cond, chromedp.WithPollingTimeout(60*time.Second), chromedp.WithPollingInterval(20*time.Millisecond)))
		if err != nil {
			return fmt.Errorf("waiting for %s: %w (page: %s)", cond, err, pageState(tctx))
		}
		return nil
	}
	if err := waitPage(`document.body.dataset.connected === "true" && document.body.dataset.revision !== "0"`); err != nil {
		return u, err
	}
	pod, err := c.CoreV1().Pods(h.namespace).Create(ctx, &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: h.name, Namespace: h.namespace},
		Spec: v1.PodSpec{NodeName: h.node, Containers: []v1.Container{{Name: "main", Image: "registry.k8s.io/pause:3.10"}}}}, metav1.CreateOptions{})
	if err != nil {
		return u, err
	}
	defer func() {
		_ = c.CoreV1().Pods(h.namespace).Delete(context.WithoutCancel(ctx), h.name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)})
	}()
	claim, err := c.ResourceV1().ResourceClaims(h.namespace).Create(ctx, &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: h.name, Namespace: h.namespace},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{Name: "gpu",
			Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: slicebuilder.DriverName}}}}}}, metav1.CreateOptions{})
	if err != nil {
		return u, err
	}
	// The pod and the unallocated claim are drawn (nothing matches the
	// search yet) before the clock starts.
	rev, err := b.events.quiet(ctx, time.Second, time.Minute)
	if err != nil {
		return u, err
	}
	if err := waitPage(fmt.Sprintf(`Number(document.body.dataset.revision) >= %d`, rev)); err != nil {
		return u, err
	}
	var fresh bool
	if fresh, err = chromedp.Run(tctx, chromedp.Evaluate[bool](watchHolder(h.name))); err != nil {
		return u, err
	}
	if !fresh {
		return u, fmt.Errorf("the holder of %s is in the page before its claim is allocated", h.name)
	}
	h.allocate(claim, pod.UID)
	if _, err := c.ResourceV1().ResourceClaims(h.namespace).UpdateStatus(ctx, claim, metav1.UpdateOptions{}); err != nil {
		return u, err
	}
	t0 := time.Now()
	if err := waitPage(`window.benchSeen > 0`); err != nil {
		return u, err
	}
	seen, err := chromedp.Run(tctx, chromedp.Evaluate[int64](`window.benchSeen`))
	if err != nil {
		return u, err
	}
	u.Appear = time.UnixMilli(seen).Sub(t0)
	if _, at, err := b.events.after(ctx, rev, 10*time.Second); err == nil {
		u.Revision = at.Sub(t0)
	}
	var where string
	if where, err = chromedp.Run(tctx, chromedp.Evaluate[string](fmt.Sprintf(
		`(() => { const e = document.querySelector('[data-testid="holder"][data-claim="%s"]'); const c = e && e.closest('[data-testid="gpu"]'); return c ? c.dataset.node + '/' + c.dataset.gpu : ''; })()`, h.name))); err != nil {
		return u, err
	}
	if want := h.node + "/" + h.device; where != want {
		return u, fmt.Errorf("the holder of %s is drawn on %q, want %s", h.name, where, want)
	}
	u.Seen = true

	if err := c.ResourceV1().ResourceClaims(h.namespace).Delete(ctx, h.name, metav1.DeleteOptions{}); err != nil {
		return u, err
	}
	t1 := time.Now()
	if err := waitPage(`window.benchGone > 0`); err != nil {
		return u, err
	}
	gone, err := chromedp.Run(tctx, chromedp.Evaluate[int64](`window.benchGone`))
	if err != nil {
		return u, err
	}
	u.Gone = time.UnixMilli(gone).Sub(t1)
	return u, nil
}

// pageState is for failure messages.
func pageState(ctx context.Context) string {
	s, err := chromedp.Run(ctx, chromedp.Evaluate[string](`JSON.stringify({revision: document.body.dataset.revision, connected: document.body.dataset.connected, hash: location.hash})`))
	if err != nil {
		return err.Error()
	}
	return strings.TrimSpace(s)
}
