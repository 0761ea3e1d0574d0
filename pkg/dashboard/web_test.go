package dashboard

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http/httptest"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/utils/ptr"

	"github.com/gpudra/gpudra/internal/browser"
)

// The page's tests run a real Chromium against the real Server over
// httptest. One browser for all of them (starting one costs seconds); a
// tab each.

// hooks is what the page's data-* hooks say about one GPU card.
type cardHooks struct {
	Node       string            `json:"node"`
	GPU        string            `json:"gpu"`
	State      string            `json:"state"`
	Holders    []holderHooks     `json:"holders"`
	Placements []placementHooks  `json:"placements"`
	Extra      map[string]string `json:"extra,omitempty"`
}

type placementHooks struct {
	Node    string        `json:"node"`
	GPU     string        `json:"gpu"`
	Device  string        `json:"device"`
	State   string        `json:"state"`
	Holders []holderHooks `json:"holders"`
}

type holderHooks struct {
	Namespace string `json:"namespace"`
	Claim     string `json:"claim"`
	Pods      string `json:"pods"`
	User      string `json:"user"`
	Local     string `json:"local"`
}

type queueHooks struct {
	Queue     string `json:"queue"`
	Kind      string `json:"kind"`
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	Position  string `json:"position"`
	Reason    string `json:"reason"`
	Holding   string `json:"holding"`
}

// readCards reads every card in the DOM through the hooks only, as the e2e
// suite does.
const readCards = `[...document.querySelectorAll('[data-testid="gpu"]')].map((c) => {
  const holder = (h) => ({namespace: h.dataset.namespace, claim: h.dataset.claim, pods: h.dataset.pods, user: h.dataset.user, local: h.dataset.local});
  return {
    node: c.dataset.node, gpu: c.dataset.gpu, state: c.dataset.state,
    holders: [...c.querySelectorAll('[data-testid="holder"]')].filter((h) => !h.closest('[data-testid="placement"]')).map(holder),
    placements: [...c.querySelectorAll('[data-testid="placement"]')].map((p) => ({
      node: p.dataset.node, gpu: p.dataset.gpu, device: p.dataset.device, state: p.dataset.state,
      holders: [...p.querySelectorAll('[data-testid="holder"]')].map(holder)})),
  };
})`

const readQueueItems = `[...document.querySelectorAll('[data-testid="queue-item"]')].map((r) => ({
  queue: r.dataset.queue, kind: r.dataset.kind, namespace: r.dataset.namespace, name: r.dataset.name,
  position: r.dataset.position, reason: r.dataset.reason, holding: r.dataset.holding}))`

func wantHolders(hs []Holder) []holderHooks {
	out := []holderHooks{}
	for _, h := range hs {
		out = append(out, holderHooks{Namespace: h.Namespace, Claim: h.Claim, Pods: strings.Join(h.Pods, ","), User: h.User, Local: h.Local})
	}
	return out
}

// wantCards is what the hooks must say for the GPUs keep selects, in page
// order, placements by name.
func wantCards(v *View, keep func(Node, GPU) bool) []cardHooks {
	out := []cardHooks{}
	for _, d := range v.Domains {
		for _, n := range d.Nodes {
			for _, g := range n.GPUs {
				if !keep(n, g) {
					continue
				}
				c := cardHooks{Node: n.Name, GPU: g.Name, State: g.State, Holders: wantHolders(g.Holders), Placements: []placementHooks{}}
				// A GPU in MIG mode held whole shows its holder, not its strip.
				if g.MIG && len(g.Holders) > 0 {
					out = append(out, c)
					continue
				}
				for _, p := range g.Placements {
					c.Placements = append(c.Placements, placementHooks{Node: n.Name, GPU: g.Name, Device: p.Name, State: p.State, Holders: wantHolders(p.Holders)})
				}
				out = append(out, c)
			}
		}
	}
	return out
}

func sortPlacements(cards []cardHooks) []cardHooks {
	for _, c := range cards {
		slices.SortFunc(c.Placements, func(a, b placementHooks) int { return strings.Compare(a.Device, b.Device) })
	}
	return cards
}

func all(Node, GPU) bool { return true }

// page is one tab on the dashboard, collecting its console.
type page struct {
	t       *testing.T
	ctx     context.Context
	console *browser.Console
}

func openPage(t *testing.T, bctx context.Context, url string) *page {
	t.Helper()
	tab, closeTab := chromedp.NewContext(bctx)
	t.Cleanup(closeTab)
	console, err := browser.CollectConsole(tab)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(tab, 60*time.Second)
	t.Cleanup(cancel)
	p := &page{t: t, ctx: ctx, console: console}
	p.do(chromedp.Navigate(url))
	t.Cleanup(p.noConsoleErrors)
	return p
}

func (p *page) do(actions ...chromedp.Action[chromedp.Void]) {
	p.t.Helper()
	if err := chromedp.Do(p.ctx, actions...); err != nil {
		p.t.Fatal(err)
	}
}

// eval runs js and decodes its JSON result into out.
func (p *page) eval(js string, out any) {
	p.t.Helper()
	raw, err := chromedp.Run(p.ctx, chromedp.Evaluate[[]byte](js))
	if err != nil {
		p.t.Fatalf("%s: %v", js, err)
	}
	if out != nil {
		if err := json.Unmarshal(raw, out); err != nil {
			p.t.Fatalf("%s: %v", js, err)
		}
	}
}

// waitFor polls a JS condition until it holds, failing after timeout.
func (p *page) waitFor(cond string, timeout time.Duration) {
	p.t.Helper()
	if _, err := chromedp.Run(p.ctx, chromedp.Poll[bool](cond, chromedp.WithPollingTimeout(timeout), chromedp.WithPollingInterval(20*time.Millisecond))); err != nil {
		var state string
		p.eval(`JSON.stringify({revision: document.body.dataset.revision, connected: document.body.dataset.connected, hash: location.hash})`, &state)
		p.t.Fatalf("waiting for %s: %v (page: %s)", cond, err, state)
	}
}

func (p *page) setFilter(id, value string) {
	p.t.Helper()
	p.eval(fmt.Sprintf(`(() => { const e = document.getElementById(%q); e.value = %q; e.dispatchEvent(new Event(e.tagName === 'SELECT' ? 'change' : 'input')); return true; })()`, id, value), nil)
}

func (p *page) cards() []cardHooks {
	p.t.Helper()
	var got []cardHooks
	p.eval(readCards, &got)
	return sortPlacements(got)
}

func (p *page) noConsoleErrors() {
	if err := p.console.Err(); err != nil {
		p.t.Errorf("the page reported errors (JS exceptions, CSP violations): %v", err)
	}
}

func startBrowser(t testing.TB) context.Context {
	t.Helper()
	bctx, cancel, err := browser.New(context.Background())
	if err != nil {
		browser.SkipOrFail(t, err)
	}
	t.Cleanup(cancel)
	return bctx
}

func TestPage(t *testing.T) {
	bctx := startBrowser(t)

	t.Run("cards, placements, holders and queues carry the hooks", func(t *testing.T) {
		v := FixtureView(3, 8, 2)
		want := sortPlacements(wantCards(v, all))
		if !slices.ContainsFunc(want, func(c cardHooks) bool {
			return c.State == StatePartial && slices.ContainsFunc(c.Placements, func(p placementHooks) bool { return len(p.Holders) > 0 })
		}) || !slices.ContainsFunc(want, func(c cardHooks) bool { return len(c.Holders) > 0 && strings.Contains(c.Holders[0].Pods, ",") }) {
			t.Fatal("the fixture lacks a MIG GPU with a held placement or a claim with two pods: pick another seed")
		}
		ts, _, _ := newTestServer(t, v)
		p := openPage(t, bctx, pageURL(ts))
		p.waitFor(`document.body.dataset.revision === "1"`, 20*time.Second)
		var search string
		p.eval(`location.search`, &search)
		if search != "" {
			t.Errorf("the address bar keeps %q after the first load, want the URL without the token", search)
		}
		if got := p.cards(); !reflect.DeepEqual(got, want) {
			gotJSON, _ := json.MarshalIndent(got, "", " ")
			wantJSON, _ := json.MarshalIndent(want, "", " ")
			t.Fatalf("cards:\n%s\nwant:\n%s", gotJSON, wantJSON)
		}
		var idle []string
		p.eval(`[...document.querySelectorAll('[data-testid="gpu"].idle')].map((c) => c.dataset.node + '/' + c.dataset.gpu)`, &idle)
		var wantIdle []string
		for _, c := range wantCards(v, func(_ Node, g GPU) bool { return g.IdleClaimed }) {
			wantIdle = append(wantIdle, c.Node+"/"+c.GPU)
		}
		if len(wantIdle) == 0 || !slices.Equal(idle, wantIdle) {
			t.Errorf("idle-claimed cards %v, want %v", idle, wantIdle)
		}
		var notesHidden bool
		p.eval(`document.getElementById('notes').hidden`, &notesHidden)
		if !notesHidden {
			t.Error("the notes banner shows with no notes")
		}

		p.do(chromedp.Click("#tab-queues"))
		var queuesShown bool
		p.eval(`getComputedStyle(document.getElementById('queues')).display !== 'none' && getComputedStyle(document.getElementById('fleet')).display === 'none'`, &queuesShown)
		if !queuesShown {
			t.Error("#tab-queues does not show the queues instead of the fleet")
		}
		var items []queueHooks
		p.eval(readQueueItems, &items)
		var wantItems []queueHooks
		for _, q := range v.Queues {
			for _, it := range q.Items {
				wantItems = append(wantItems, queueHooks{Queue: q.Name, Kind: it.Kind, Namespace: it.Namespace, Name: it.Name,
					Position: fmt.Sprint(it.Position), Reason: it.Reason, Holding: fmt.Sprint(it.Holding)})
			}
		}
		if !reflect.DeepEqual(items, wantItems) {
			t.Errorf("queue items %+v, want %+v", items, wantItems)
		}
		var hash string
		p.eval(`location.hash`, &hash)
		if hash != "#tab=queues" {
			t.Errorf("hash %q after opening the queues, want #tab=queues", hash)
		}
		p.do(chromedp.Click("#tab-allocation"))
		var lines int
		p.eval(`document.querySelectorAll('#allocation svg polyline.allocated').length`, &lines)
		if lines != len(v.Allocation.Series) {
			t.Errorf("%d allocation lines, want one per owner: %d", lines, len(v.Allocation.Series))
		}
	})

	t.Run("Ray clusters, RayJobs and Kueue workloads, grouped with their pods and claims", func(t *testing.T) {
		ts, _, _ := newTestServer(t, FixtureView(2, 8, 2))
		p := openPage(t, bctx, pageURL(ts))
		p.waitFor(`document.body.dataset.revision === "1"`, 20*time.Second)
		var hidden bool
		p.eval(`document.getElementById('tab-workloads').hidden`, &hidden)
		if !hidden {
			t.Error("the Workloads tab shows on a cluster with no Ray or Kueue workload")
		}

		v := FixtureView(2, 8, 2)
		v.Workloads = fixtureWorkloads(t)
		v.Filters.Namespaces = append(v.Filters.Namespaces, "research", "team-b")
		ts, _, _ = newTestServer(t, v)
		p = openPage(t, bctx, pageURL(ts)+"#tab=workloads")
		p.waitFor(`document.body.dataset.revision === "1"`, 20*time.Second)
		p.eval(`document.getElementById('tab-workloads').hidden || document.getElementById('workloads').hidden`, &hidden)
		if hidden {
			t.Fatal("#tab=workloads does not show the workloads")
		}
		var got []workloadHooks
		p.eval(readWorkloads, &got)
		want := []workloadHooks{
			{Kind: "RayJob", Namespace: "research", Name: "train", State: "Running/RUNNING", RayCluster: "train-abcde", KueueState: KueueAdmitted, ClusterQueue: "team-a-cq",
				Pods: []string{"train-abcde-head-q head dgx-1 ", "train-abcde-gpus-worker-z worker dgx-1 dgx-1/gpu-0,dgx-1/gpu-1"}},
			{Kind: "Job", Namespace: "team-b", Name: "big", KueueState: KueuePending, ClusterQueue: "team-b-cq", KueueReason: "Pending",
				KueueMessage: "couldn't assign flavors to pod set main: insufficient unused quota for gpu.gpudra.dev in flavor default, 8 more needed",
				Pods:         []string{"big-0-xyz   "}},
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("workloads %+v,\nwant %+v", got, want)
		}
		p.setFilter("filter-namespace", "team-b")
		p.eval(readWorkloads, &got)
		if len(got) != 1 || got[0].Name != "big" {
			t.Errorf("filtered by namespace team-b: %+v", got)
		}
	})

	t.Run("filters, search and the URL hash", func(t *testing.T) {
		v := FixtureView(3, 8, 2)
		ts, _, _ := newTestServer(t, v)
		p := openPage(t, bctx, pageURL(ts))
		p.waitFor(`document.body.dataset.revision === "1"`, 20*time.Second)

		inNamespace := func(ns string) func(Node, GPU) bool {
			return func(_ Node, g GPU) bool {
				for _, h := range holdersOfGPU(g) {
					if h.Namespace == ns {
						return true
					}
				}
				return false
			}
		}
		// A pod of a claim on a MIG placement: search must look inside.
		var pod string
		for _, c := range wantCards(v, all) {
			for _, pl := range c.Placements {
				if len(pl.Holders) > 0 && pod == "" {
					pod = pl.Holders[0].Pods
				}
			}
		}
		holdsPod := func(_ Node, g GPU) bool {
			for _, h := range holdersOfGPU(g) {
				if slices.Contains(h.Pods, pod) {
					return true
				}
			}
			return false
		}
		both := func(a, b func(Node, GPU) bool) func(Node, GPU) bool {
			return func(n Node, g GPU) bool { return a(n, g) && b(n, g) }
		}
		isState := func(s string) func(Node, GPU) bool { return func(_ Node, g GPU) bool { return g.State == s } }
		for _, tc := range []struct {
			name     string
			filters  map[string]string
			keep     func(Node, GPU) bool
			wantHash string
		}{
			{"state", map[string]string{"filter-state": StateAllocated}, isState(StateAllocated), "#state=allocated"},
			{"namespace", map[string]string{"filter-namespace": "training"}, inNamespace("training"), "#ns=training"},
			{"class", map[string]string{"filter-class": "mig.gpudra.dev"}, func(_ Node, g GPU) bool { return g.MIG }, "#class=mig.gpudra.dev"},
			{"node", map[string]string{"filter-node": "node-0001"}, func(n Node, _ GPU) bool { return n.Name == "node-0001" }, "#node=node-0001"},
			{"search a pod on a MIG device", map[string]string{"search": pod}, holdsPod, "#q=" + pod},
			{"search a UUID", map[string]string{"search": "gpu-00000002-0003"}, func(n Node, g GPU) bool { return n.Name == "node-0002" && g.Name == "gpu-3" }, "#q=gpu-00000002-0003"},
			{"namespace and state", map[string]string{"filter-namespace": "training", "filter-state": StatePartial}, both(inNamespace("training"), isState(StatePartial)), "#ns=training&state=partial"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				want := sortPlacements(wantCards(v, tc.keep))
				if len(want) == 0 || len(want) == v.Summary.GPUs {
					t.Fatalf("the fixture makes this filter keep %d of %d GPUs: it would prove nothing", len(want), v.Summary.GPUs)
				}
				for _, id := range []string{"search", "filter-node", "filter-class", "filter-namespace", "filter-state"} {
					p.setFilter(id, tc.filters[id])
				}
				if got := p.cards(); !reflect.DeepEqual(got, want) {
					t.Fatalf("%d cards %v, want %d", len(got), cardNames(got), len(want))
				}
				var hash string
				p.eval(`location.hash`, &hash)
				if hash != tc.wantHash {
					t.Fatalf("hash %q, want %q", hash, tc.wantHash)
				}
				// The link reproduces the filter in a fresh page.
				linked := openPage(t, bctx, pageURL(ts)+hash)
				linked.waitFor(`document.body.dataset.revision === "1"`, 20*time.Second)
				if got := linked.cards(); !reflect.DeepEqual(got, want) {
					t.Fatalf("the link %s draws %v, want %v", hash, cardNames(got), cardNames(want))
				}
				var values map[string]string
				linked.eval(`Object.fromEntries(['search', 'filter-node', 'filter-class', 'filter-namespace', 'filter-state'].map((id) => [id, document.getElementById(id).value]).filter(([, v]) => v))`, &values)
				if !maps.Equal(values, tc.filters) {
					t.Fatalf("the link %s sets the inputs to %v, want %v", hash, values, tc.filters)
				}
			})
		}
	})

	t.Run("a new revision is drawn within 2 s", func(t *testing.T) {
		v := FixtureView(3, 8, 2)
		ts, _, pub := newTestServer(t, v)
		p := openPage(t, bctx, pageURL(ts))
		p.waitFor(`document.body.dataset.revision === "1" && document.body.dataset.connected === "true"`, 20*time.Second)

		next := FixtureView(3, 8, 2)
		g := &next.Domains[0].Nodes[0].GPUs[0]
		if g.State == StateAllocated {
			t.Fatal("fixture: node-0000 gpu-0 is allocated already; pick a seed where it is not")
		}
		g.State = StateAllocated
		g.MIG, g.Placements = false, nil
		g.Holders = []Holder{{Namespace: "fresh", Claim: "fresh-claim", Pods: []string{"fresh-pod"}}}
		next.Notes = []string{"ResourceSlices: forbidden (you see only the devices of your claims)"}
		start := time.Now()
		pub.Publish(next)
		p.waitFor(`document.body.dataset.revision === "2" && !!document.querySelector('[data-testid="gpu"][data-node="node-0000"][data-gpu="gpu-0"][data-state="allocated"] [data-testid="holder"][data-claim="fresh-claim"][data-pods="fresh-pod"]')`, 2*time.Second)
		t.Logf("revision 2 drawn %v after Publish", time.Since(start))
		var notes string
		p.eval(`document.getElementById('notes').hidden ? '' : document.getElementById('notes').textContent`, &notes)
		if !strings.Contains(notes, "ResourceSlices: forbidden") {
			t.Errorf("notes banner %q, want the View's note", notes)
		}
	})

	t.Run("1,000 nodes x 8 GPUs draw only the rows in view", func(t *testing.T) {
		v := FixtureView(1000, 8, 1)
		ts, _, _ := newTestServer(t, v)
		p := openPage(t, bctx, pageURL(ts))
		p.waitFor(`window.gpudraFirstPaint !== undefined && document.body.dataset.revision === "1"`, 30*time.Second)
		var firstPaint float64
		p.eval(`window.gpudraFirstPaint`, &firstPaint)
		t.Logf("first paint at %.0f ms", firstPaint)

		count := func() (cards int, first, last string) {
			var r struct {
				Cards       int
				First, Last string
			}
			p.eval(`(() => { const c = document.querySelectorAll('[data-testid="gpu"]'); return {cards: c.length, first: c.length ? c[0].dataset.node : '', last: c.length ? c[c.length - 1].dataset.node : ''}; })()`, &r)
			return r.Cards, r.First, r.Last
		}
		const most = 400
		cards, first, _ := count()
		if cards == 0 || cards > most || first != "node-0000" {
			t.Fatalf("at the top: %d cards from %q, want 1..%d from node-0000 (of %d GPUs)", cards, first, most, v.Summary.GPUs)
		}
		p.eval(`(() => { const f = document.getElementById('fleet'); f.scrollTop = f.scrollHeight; return true; })()`, nil)
		p.waitFor(`!!document.querySelector('[data-testid="gpu"][data-node="node-0999"]')`, 5*time.Second)
		cards, first, last := count()
		if cards == 0 || cards > most || first == "node-0000" || last != "node-0999" {
			t.Fatalf("at the bottom: %d cards from %q to %q, want 1..%d ending at node-0999", cards, first, last, most)
		}
		p.eval(`(() => { const f = document.getElementById('fleet'); f.scrollTop = f.scrollHeight / 2; return true; })()`, nil)
		p.waitFor(`!document.querySelector('[data-testid="gpu"][data-node="node-0999"]') && document.querySelectorAll('[data-testid="gpu"]').length > 0`, 5*time.Second)
		if cards, _, _ := count(); cards > most {
			t.Fatalf("in the middle: %d cards, want at most %d", cards, most)
		}
	})
}

func holdersOfGPU(g GPU) []Holder {
	hs := slices.Clone(g.Holders)
	for _, p := range g.Placements {
		hs = append(hs, p.Holders...)
	}
	return hs
}

func cardNames(cards []cardHooks) []string {
	var out []string
	for _, c := range cards {
		out = append(out, c.Node+"/"+c.GPU)
	}
	return out
}

// BenchmarkFirstPaint1000Nodes loads the page on a 1,000-node fleet of 8
// GPUs each and reports when its first fleet rows were drawn, from the
// navigation's start (the page's window.gpudraFirstPaint).
func BenchmarkFirstPaint1000Nodes(b *testing.B) {
	bctx := startBrowser(b)
	pub := NewPublisher(FixtureView(1000, 8, 1))
	ts := httptest.NewUnstartedServer(nil)
	ts.Config.Handler = NewServer(pub, ServerOptions{Addr: ts.Listener.Addr().String(), Token: testToken})
	ts.Start()
	defer ts.Close()
	tab, closeTab := chromedp.NewContext(bctx)
	defer closeTab()
	var total, worst float64
	n := 0
	for b.Loop() {
		if err := chromedp.Do(tab, chromedp.Navigate(fmt.Sprintf("%s&load=%d", pageURL(ts), n))); err != nil {
			b.Fatal(err)
		}
		ms, err := chromedp.Run(tab, chromedp.Poll[float64](`window.gpudraFirstPaint`, chromedp.WithPollingTimeout(30*time.Second)))
		if err != nil {
			b.Fatal(err)
		}
		n++
		total += ms
		worst = max(worst, ms)
	}
	b.ReportMetric(total/float64(n), "ms/firstpaint")
	b.ReportMetric(worst, "ms/worst-firstpaint")
}

// workloadHooks are a workload group's data-* hooks; Pods "name role node
// devices" each.
type workloadHooks struct {
	Kind, Namespace, Name, State, RayCluster            string
	KueueState, ClusterQueue, KueueReason, KueueMessage string
	Pods                                                []string
}

const readWorkloads = `[...document.querySelectorAll('[data-testid="workload"]')].map((w) => ({
	Kind: w.dataset.kind, Namespace: w.dataset.namespace, Name: w.dataset.name, State: w.dataset.state, RayCluster: w.dataset.rayCluster,
	KueueState: w.dataset.kueueState, ClusterQueue: w.dataset.clusterQueue, KueueReason: w.dataset.kueueReason,
	KueueMessage: (w.querySelector('[data-testid="kueue-message"]') || {}).textContent || '',
	Pods: [...w.querySelectorAll('[data-testid="workload-pod"]')].map((p) => [p.dataset.pod, p.dataset.role, p.dataset.node, p.dataset.devices].join(' ')),
}))`

// fixtureWorkloads are the real-shaped objects of workloads_test.go
// grouped: a RayJob Kueue admitted, with its head and GPU worker, and a
// Job Kueue holds pending for quota.
func fixtureWorkloads(t *testing.T) []Workload {
	claims := map[string]*resourceapi.ResourceClaim{
		"research/w-0-gpus-x": {ObjectMeta: metav1.ObjectMeta{Name: "w-0-gpus-x", Namespace: "research"},
			Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{
				Results: []resourceapi.DeviceRequestAllocationResult{{Pool: "dgx-1", Device: "gpu-0"}, {Pool: "dgx-1", Device: "gpu-1"}}}}}},
	}
	jobPod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "big-0-xyz", Namespace: "team-b",
		OwnerReferences: []metav1.OwnerReference{{APIVersion: "batch/v1", Kind: "Job", Name: "big", UID: "job-1", Controller: ptr.To(true)}}}}
	return workloads(WorkloadInputs{
		RayJobs:        []*unstructured.Unstructured{obj(t, rayJobYAML)},
		RayClusters:    []*unstructured.Unstructured{obj(t, rayJobClusterYAML)},
		KueueWorkloads: []*unstructured.Unstructured{obj(t, admittedWorkloadYAML), obj(t, pendingWorkloadYAML)},
		LocalQueues:    []*unstructured.Unstructured{obj(t, localQueueYAML)},
	}, []*corev1.Pod{
		rayPod("train-abcde-gpus-worker-z", "train-abcde", "worker", "gpus", "dgx-1", "w-0-gpus-x"),
		rayPod("train-abcde-head-q", "train-abcde", "head", "headgroup", "dgx-1", ""),
		jobPod,
	}, claims)
}
