package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/rest"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/internal/browser"
	"github.com/gpudra/gpudra/pkg/dashboard"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// The dashboard's end-to-end tests (issue 37): gpudra dashboard's server,
// run as the CLI runs it (dashboard.RunCluster) on a user's credentials,
// against devcluster, read in a real headless Chromium through the page's
// data-* hooks only.

// dashPage is one browser tab on a dashboard.
type dashPage struct {
	t   *testing.T
	ctx context.Context
	url string
}

// openDashboard serves the dashboard on cfg's credentials (usage through
// the plugins' metrics pods, as the chart's plugin pods are read) and
// opens it at fragment (the page's filter state, "" for none).
func openDashboard(t *testing.T, cfg *rest.Config, namespace, fallback, fragment string) *dashPage {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	urls := make(chan string, 1)
	done := make(chan error, 1)
	go func() {
		done <- dashboard.RunCluster(ctx, dashboard.ClusterRunConfig{
			ServeConfig: dashboard.ServeConfig{Address: "127.0.0.1:0", Listening: func(u string) { urls <- u }},
			RESTConfig:  cfg, Context: "devcluster", Namespace: namespace, FallbackNamespace: fallback,
			PluginNamespace: chart.PluginNamespace, UsageInterval: time.Second,
		})
	}()
	var base string
	select {
	case base = <-urls:
	case err := <-done:
		t.Fatalf("gpudra dashboard: %v", err)
	}
	t.Cleanup(func() {
		cancel()
		assert.NoError(t, <-done, "gpudra dashboard ends cleanly")
	})
	bctx, closeBrowser, err := browser.New(context.Background())
	if err != nil {
		browser.SkipOrFail(t, err)
	}
	t.Cleanup(closeBrowser)
	console, err := browser.CollectConsole(bctx)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, console.Err(), "the page reported JS exceptions or CSP violations") })
	tctx, cancelTab := context.WithTimeout(bctx, 5*time.Minute)
	t.Cleanup(cancelTab)
	p := &dashPage{t: t, ctx: tctx, url: base}
	p.navigate(fragment)
	return p
}

func (p *dashPage) navigate(fragment string) {
	p.t.Helper()
	u := p.url
	if fragment != "" {
		u += "#" + fragment
	}
	_, err := chromedp.Run(p.ctx, chromedp.Navigate(u))
	require.NoError(p.t, err)
	p.waitFor(`document.body.dataset.revision > "1" && !document.getElementById('notes').textContent.includes('reading the cluster')`, 60*time.Second)
}

// setHash changes the page's filter state as a link would.
func (p *dashPage) setHash(fragment string) {
	p.t.Helper()
	p.eval(fmt.Sprintf(`(() => { location.hash = %q; return true; })()`, fragment), nil)
	time.Sleep(100 * time.Millisecond)
}

func (p *dashPage) eval(js string, out any) {
	p.t.Helper()
	raw, err := chromedp.Run(p.ctx, chromedp.Evaluate[[]byte](js))
	require.NoError(p.t, err, js)
	if out != nil {
		require.NoError(p.t, json.Unmarshal(raw, out), js)
	}
}

func (p *dashPage) waitFor(cond string, timeout time.Duration) {
	p.t.Helper()
	_, err := chromedp.Run(p.ctx, chromedp.Poll[bool](cond, chromedp.WithPollingTimeout(timeout), chromedp.WithPollingInterval(20*time.Millisecond)))
	if err != nil {
		var state string
		p.eval(`JSON.stringify({revision: document.body.dataset.revision, connected: document.body.dataset.connected, hash: location.hash, notes: document.getElementById('notes').textContent, match: document.getElementById('match-count').textContent, search: document.getElementById('search').value, ns: document.getElementById('filter-namespace').value, cards: [...document.querySelectorAll('[data-testid="gpu"]')].map((c) => c.dataset.node + '/' + c.dataset.gpu + ':' + [...c.querySelectorAll('[data-testid="holder"]')].map((h) => h.dataset.claim).join('+'))})`, &state)
		p.t.Fatalf("waiting for %s: %v (page: %s)\nthe View: %s", cond, err, state, p.viewJSON())
	}
}

// viewJSON is the View the server sends now, for failure messages.
func (p *dashPage) viewJSON() string {
	raw, err := chromedp.Run(p.ctx, chromedp.Evaluate[string](`fetch('/api/view').then((r) => r.text())`, chromedp.EvalAwaitPromise))
	if err != nil {
		return err.Error()
	}
	var v dashboard.View
	if err := json.Unmarshal([]byte(raw), &v); err != nil {
		return err.Error()
	}
	// The queues and the held devices only: the whole View is long.
	type held struct {
		Node, GPU, Device string
		Holders           []dashboard.Holder
	}
	var hs []held
	for _, d := range v.Domains {
		for _, n := range d.Nodes {
			for _, g := range n.GPUs {
				if len(g.Holders) > 0 {
					hs = append(hs, held{n.Name, g.Name, "", g.Holders})
				}
				for _, pl := range g.Placements {
					if len(pl.Holders) > 0 {
						hs = append(hs, held{n.Name, g.Name, pl.Name, pl.Holders})
					}
				}
			}
		}
	}
	out, _ := json.Marshal(map[string]any{"queues": v.Queues, "held": hs, "notes": v.Notes})
	return string(out)
}

func (p *dashPage) screenshot(name string) {
	p.t.Helper()
	dir := os.Getenv("GPUDRA_SCREENSHOTS_DIR")
	if dir == "" {
		return
	}
	require.NoError(p.t, os.MkdirAll(dir, 0o755))
	time.Sleep(300 * time.Millisecond) // the last frame drawn
	_, err := chromedp.Run(p.ctx, browser.Screenshot(filepath.Join(dir, name)))
	require.NoError(p.t, err)
}

// shownHolder is a holder on the page and where it is drawn.
type shownHolder struct {
	Node      string `json:"node"`
	GPU       string `json:"gpu"`
	Device    string `json:"device"` // the MIG placement's, "" on a whole GPU
	Namespace string `json:"namespace"`
	Claim     string `json:"claim"`
	Pods      string `json:"pods"`
}

const readHolders = `[...document.querySelectorAll('#fleet [data-testid="holder"]')].map((h) => {
  const p = h.closest('[data-testid="placement"]'), c = h.closest('[data-testid="gpu"]');
  return {node: c ? c.dataset.node : '', gpu: c ? c.dataset.gpu : '', device: p ? p.dataset.device : '',
    namespace: h.dataset.namespace || '', claim: h.dataset.claim || '', pods: h.dataset.pods || ''};
})`

func (p *dashPage) holders() []shownHolder {
	p.t.Helper()
	var hs []shownHolder
	p.eval(readHolders, &hs)
	return hs
}

// holderCond is a JS condition: a holder of claim in namespace is drawn
// (want true) or none is (want false).
func holderCond(namespace, claim string, want bool) string {
	sel := fmt.Sprintf(`#fleet [data-testid="holder"][data-namespace=%q][data-claim=%q]`, namespace, claim)
	if want {
		return fmt.Sprintf(`document.querySelector(%q) !== null`, sel)
	}
	return fmt.Sprintf(`document.querySelector(%q) === null`, sel)
}

// wantCard is where a claim's device must be drawn: the GPU's card, and
// the placement on it for a MIG device.
func wantCard(t *testing.T, pool, name string) (gpu, placement string) {
	t.Helper()
	d := device(t, pool, name)
	if attr(d, "type") != slicebuilder.TypeMIG {
		return name, ""
	}
	parent := attr(d, "parentUUID")
	list, err := cluster.Client.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{
		FieldSelector: resourceapi.ResourceSliceSelectorNodeName + "=" + pool})
	require.NoError(t, err)
	for _, s := range list.Items {
		for _, g := range s.Spec.Devices {
			if attr(g, "type") == slicebuilder.TypeGPU && attr(g, "uuid") == parent {
				return g.Name, name
			}
		}
	}
	t.Fatalf("%s/%s: no GPU of UUID %s in the node's slices", pool, name, parent)
	return "", ""
}

// TestDashboardShowsTheDemo (issue 37, "Must show"): every running pod of
// the demo appears, with its claim, on the GPU (and MIG placement) its
// claim was allocated, and a pod without a claim on none. The screenshots
// of docs/dashboard.md are taken here (GPUDRA_SCREENSHOTS_DIR).
func TestDashboardShowsTheDemo(t *testing.T) {
	ns := namespace(t)
	ctx := context.Background()
	for _, f := range demoExamples {
		apply(t, ns, filepath.Join(examples, f))
	}
	plain := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "no-claim"}, Spec: v1.PodSpec{
		Containers: []v1.Container{{Name: "c", Image: "busybox", Command: []string{"sleep", "3600"}}}}}
	create(t, ns, nil, plain)
	notRunning, err := cluster.WaitForPods(ctx, ns, 2*time.Minute)
	require.NoError(t, err, "not running: %v", notRunning)
	pods, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	require.NoError(t, err)

	p := openDashboard(t, cluster.RESTConfig, "", "", "ns="+ns)
	checked := 0
	for _, pod := range pods.Items {
		if len(pod.Spec.ResourceClaims) == 0 {
			continue
		}
		// The card must be in view: the search narrows the fleet to it.
		p.setHash(url.Values{"q": {pod.Name}, "ns": {ns}}.Encode())
		for _, rc := range pod.Spec.ResourceClaims {
			claim := podClaim(t, &pod, rc.Name)
			require.NotNil(t, claim.Status.Allocation, "%s: claim %s allocated", pod.Name, claim.Name)
			p.waitFor(holderCond(ns, claim.Name, true), 10*time.Second)
			shown := p.holders()
			for _, r := range claim.Status.Allocation.Devices.Results {
				gpu, placement := wantCard(t, r.Pool, r.Device)
				assert.True(t, slices.ContainsFunc(shown, func(h shownHolder) bool {
					return h.Node == r.Pool && h.GPU == gpu && h.Device == placement && h.Namespace == ns && h.Claim == claim.Name &&
						slices.Contains(strings.Split(h.Pods, ","), pod.Name)
				}), "pod %s, claim %s: drawn on %s/%s %s; the page shows %+v", pod.Name, claim.Name, r.Pool, gpu, placement, shown)
				checked++
			}
			for _, h := range shown {
				if h.Claim != claim.Name || h.Namespace != ns {
					continue
				}
				assert.True(t, slices.ContainsFunc(claim.Status.Allocation.Devices.Results, func(r resourceapi.DeviceRequestAllocationResult) bool {
					gpu, placement := wantCard(t, r.Pool, r.Device)
					return h.Node == r.Pool && h.GPU == gpu && h.Device == placement
				}), "claim %s drawn on %s/%s %s, where it holds nothing", claim.Name, h.Node, h.GPU, h.Device)
			}
		}
	}
	assert.GreaterOrEqual(t, checked, 15, "the demo's devices were all checked")

	p.setHash(url.Values{"q": {"no-claim"}}.Encode())
	time.Sleep(500 * time.Millisecond)
	for _, h := range p.holders() {
		assert.NotContains(t, strings.Split(h.Pods, ","), "no-claim", "a pod without a claim is drawn on %s/%s", h.Node, h.GPU)
	}

	// The screenshots: the fleet of the demo (the MIG node first), the
	// queues and the allocation.
	p.setHash(url.Values{"node": {"dgx-h100-0"}}.Encode())
	p.screenshot("dashboard-fleet-mig.png")
	p.setHash("")
	p.screenshot("dashboard-fleet.png")
	p.setHash("tab=queues")
	p.screenshot("dashboard-queues.png")
	p.setHash("tab=allocation")
	p.screenshot("dashboard-allocation.png")
}

// TestDashboardLiveClaims (issue 37, "Must show"): a new claim appears
// within 2 seconds of its allocation, and a deleted one disappears, pushed
// to an open page.
func TestDashboardLiveClaims(t *testing.T) {
	ns := namespace(t)
	ctx := context.Background()
	p := openDashboard(t, cluster.RESTConfig, "", "", url.Values{"ns": {ns}}.Encode())
	create(t, ns, gpus("one", 1), gpuPod("live", "one"))
	var claim *resourceapi.ResourceClaim
	var allocatedAt time.Time
	require.NoError(t, wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		list, err := cluster.Client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
		if err != nil || len(list.Items) == 0 || list.Items[0].Status.Allocation == nil {
			return false, nil
		}
		claim, allocatedAt = &list.Items[0], time.Now()
		return true, nil
	}))
	p.waitFor(holderCond(ns, claim.Name, true), 2*time.Second)
	t.Logf("claim drawn %v after the test saw its allocation", time.Since(allocatedAt).Round(time.Millisecond))

	require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(ctx, "live", metav1.DeleteOptions{}))
	require.NoError(t, wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, claim.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	}))
	p.waitFor(holderCond(ns, claim.Name, false), 2*time.Second)
}

// queueRow is a queue item on the page.
type queueRow struct {
	Queue     string `json:"queue"`
	Kind      string `json:"kind"`
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	Position  string `json:"position"`
	Reason    string `json:"reason"`
}

func (p *dashPage) queueRows(queue string) []queueRow {
	p.t.Helper()
	var rows []queueRow
	p.eval(fmt.Sprintf(`[...document.querySelectorAll('[data-testid="queue-item"][data-queue=%q]')].map((r) => ({
  queue: r.dataset.queue, kind: r.dataset.kind, namespace: r.dataset.namespace, name: r.dataset.name,
  position: r.dataset.position, reason: r.dataset.reason}))`, queue), &rows)
	return rows
}

// TestDashboardQueue (issue 37, "Must show"): a queued gang shows its
// position and why it waits, and moves up when the gang ahead of it is
// admitted.
func TestDashboardQueue(t *testing.T) {
	ctx := context.Background()
	qname := "e2e-dashboard"
	q := &unstructured.Unstructured{Object: map[string]any{"apiVersion": gpudrav1.APIVersion, "kind": gpudrav1.KindGpuQueue,
		"metadata": map[string]any{"name": qname}, "spec": map[string]any{"policy": string(gpudrav1.FCFS)}}}
	_, err := dyn(t).Resource(gpudrav1.GpuQueues).Create(ctx, q, metav1.CreateOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = dyn(t).Resource(gpudrav1.GpuQueues).Delete(ctx, qname, metav1.DeleteOptions{}) })
	ns := namespace(t)
	create(t, ns, gpus("four", 4))
	create(t, ns, gpus("eight", 8))
	blocker := gpuPod("blocker", "eight")
	pinned(nomigNode)(blocker)
	create(t, ns, nil, blocker)
	waitRunning(t, ns, "blocker")
	for _, g := range []string{"a", "b"} {
		for i := range 2 {
			p := gangPod(fmt.Sprintf("%s-%d", g, i), g, 2, "four", pinned(nomigNode))
			p.Annotations[gpudrav1.AnnotationQueue] = qname
			create(t, ns, nil, p)
		}
		gangCondition(t, ns, g+"-0", v1.ConditionFalse, "")
		time.Sleep(1100 * time.Millisecond) // b is later than a
	}
	gangCondition(t, ns, "b-0", v1.ConditionFalse, gpudrav1.ReasonBehindInQueue)

	p := openDashboard(t, cluster.RESTConfig, "", "", "tab=queues")
	rowCond := func(name, position, reason string) string {
		return fmt.Sprintf(`document.querySelector('[data-testid="queue-item"][data-queue=%q][data-namespace=%q][data-name=%q][data-position=%q][data-reason=%q]') !== null`,
			qname, ns, name, position, reason)
	}
	p.waitFor(rowCond("a", "1", gpudrav1.ReasonWaitingForDevices), 10*time.Second)
	p.waitFor(rowCond("b", "2", gpudrav1.ReasonBehindInQueue), 10*time.Second)
	rows := p.queueRows(qname)
	require.Len(t, rows, 2, "the queue's two gangs: %+v", rows)
	assert.Equal(t, []string{"a", "b"}, []string{rows[0].Name, rows[1].Name}, "in queue order")
	for _, r := range rows {
		assert.Equal(t, "Gang", r.Kind)
	}
	p.screenshot("dashboard-queue-gangs.png")

	require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(ctx, "blocker", metav1.DeleteOptions{}))
	waitRunning(t, ns, "a-0")
	p.waitFor(rowCond("b", "1", gpudrav1.ReasonWaitingForDevices), 30*time.Second)
	rows = p.queueRows(qname)
	require.Len(t, rows, 1, "a admitted, b alone: %+v", rows)
}

// TestDashboardTenantSeesOnlyItsNamespace (issue 37, "Must show"): a user
// with the default edit role in one namespace sees that namespace's
// claims and pods on the page, and nothing of another's; what it may not
// read is said, not drawn as empty.
func TestDashboardTenantSeesOnlyItsNamespace(t *testing.T) {
	mine, theirs := namespace(t), namespace(t)
	for _, ns := range []string{mine, theirs} {
		create(t, ns, gpus("one", 1), gpuPod("job", "one"))
		waitRunning(t, ns, "job")
	}
	user := "dashboard-tenant"
	editTenant(t, mine, user)
	cfg := rest.CopyConfig(cluster.RESTConfig)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: user, Groups: []string{"system:authenticated"}}

	p := openDashboard(t, cfg, "", mine, "")
	mineClaim := podClaim(t, waitRunning(t, mine, "job"), "gpu")
	theirClaim := podClaim(t, waitRunning(t, theirs, "job"), "gpu")
	p.waitFor(holderCond(mine, mineClaim.Name, true), 30*time.Second)
	for _, h := range p.holders() {
		assert.Equal(t, mine, h.Namespace, "the tenant sees a holder of another namespace: %+v", h)
	}
	p.setHash(url.Values{"q": {theirClaim.Name}}.Encode())
	p.waitFor(holderCond(theirs, theirClaim.Name, false), 5*time.Second)
	var notes string
	p.eval(`document.getElementById('notes').textContent`, &notes)
	assert.Contains(t, notes, "forbidden", "what the tenant may not read is said")
	var view dashboard.View
	raw, err := chromedp.Run(p.ctx, chromedp.Evaluate[string](`fetch('/api/view').then((r) => r.text())`, chromedp.EvalAwaitPromise))
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal([]byte(raw), &view))
	assert.NotEmpty(t, view.Notes, "the View says what could not be read")
	assert.NotContains(t, raw, theirs, "the other namespace appears nowhere in what the tenant's page is sent")
	var free int
	p.eval(`document.querySelectorAll('[data-testid="gpu"][data-state="free"]').length`, &free)
	assert.Zero(t, free, "no GPU shows as free to a tenant who cannot read every claim")

	// Bound to the chart's fleet-viewer role (dashboard.fleetViewerRole),
	// the same tenant sees every GPU and who holds it, free GPUs as free,
	// and still no pod of another namespace beyond the claim's own record.
	ctx := context.Background()
	rendered, err := chart.Render(ctx, chart.Default("../.."), t.TempDir(), "--set", "dashboard.fleetViewerRole=true")
	require.NoError(t, err)
	role := slices.IndexFunc(objectsFrom(t, rendered), func(o *unstructured.Unstructured) bool {
		return o.GetKind() == "ClusterRole" && strings.HasSuffix(o.GetName(), "-fleet-viewer")
	})
	require.GreaterOrEqual(t, role, 0, "the chart renders the fleet-viewer ClusterRole")
	roleObj := objectsFrom(t, rendered)[role]
	roleObj.SetName(roleObj.GetName() + "-" + mine) // one per test: cluster-scoped
	require.NoError(t, cluster.Apply(ctx, "", []*unstructured.Unstructured{roleObj}))
	binding := &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: roleObj.GetName()},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: roleObj.GetName()},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: user}}}
	_, err = cluster.Client.RbacV1().ClusterRoleBindings().Create(ctx, binding, metav1.CreateOptions{})
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = cluster.Client.RbacV1().ClusterRoleBindings().Delete(context.Background(), binding.Name, metav1.DeleteOptions{})
		_ = cluster.Client.RbacV1().ClusterRoles().Delete(context.Background(), roleObj.GetName(), metav1.DeleteOptions{})
	})
	fleet := openDashboard(t, cfg, "", mine, url.Values{"q": {theirClaim.Name}}.Encode())
	fleet.waitFor(holderCond(theirs, theirClaim.Name, true), 30*time.Second)
	fleet.setHash("")
	fleet.waitFor(`document.querySelector('[data-testid="gpu"][data-state="free"]') !== null`, 10*time.Second)
	var unknown int
	fleet.eval(`document.querySelectorAll('[data-testid="gpu"][data-state="unknown"]').length`, &unknown)
	assert.Zero(t, unknown, "every claim read: no GPU is unknown")
}
