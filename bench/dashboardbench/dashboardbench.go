// Package dashboardbench measures gpudra dashboard (issue 37) on a large
// fleet: devcluster's control plane with N API-only nodes of 8 whole H100s
// each (the scale benchmark's migoff nodes), half their GPUs held by
// allocated claims of bound pods, gpudra dashboard's own server
// (dashboard.RunCluster, in this process) on an admin's credentials, and a
// real headless Chromium. It reports the page's first paint (median and
// worst of several fresh tabs, the first request after a new revision
// among them), where that time goes (the browser's own resource timings),
// the /api/view body, how many GPU cards the page puts in the DOM, how long
// a claim allocated or deleted takes to show, and the server's heap.
package dashboardbench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	restclient "k8s.io/client-go/rest"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/bench/scalebench"
	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/internal/browser"
	"github.com/gpudra/gpudra/pkg/dashboard"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// Config is one benchmark run.
type Config struct {
	// Nodes is the fleet (default 1000), 8 GPUs each; half the GPUs of
	// each node (gpu-0..gpu-3) are held.
	Nodes int
	// Runs is how many fresh tabs are timed, and how many claims are
	// allocated and deleted for the update latency (default 5).
	Runs int
	// Chart is the chart whose identities and DeviceClasses the cluster
	// gets.
	Chart chart.Options
	// Dir is where the cluster keeps its files ("": a temporary
	// directory, removed at the end).
	Dir string
	// Out gets the Markdown results (nil: none).
	Out io.Writer
	// Workers write nodes, pods and claims in parallel (default 32).
	Workers int
}

// Namespaces hold the claims and their pods, round robin.
var Namespaces = []string{"training", "inference", "research", "batch", "eval"}

// gpusPerNode and heldPerNode: dgx-h100-nomig's 8 GPUs, gpu-0..gpu-3 held.
const (
	gpusPerNode = 8
	heldPerNode = 4
)

// Run measures the dashboard on cfg.Nodes nodes.
func Run(ctx context.Context, cfg Config) (res Result, err error) {
	if cfg.Nodes <= 0 {
		cfg.Nodes = 1000
	}
	if cfg.Runs <= 0 {
		cfg.Runs = 5
	}
	if cfg.Workers <= 0 {
		cfg.Workers = 32
	}
	logger := klog.FromContext(ctx)
	res = Result{Nodes: cfg.Nodes, GPUs: cfg.Nodes * gpusPerNode, Claims: cfg.Nodes * heldPerNode, CPUs: runtime.NumCPU()}
	dir := cfg.Dir
	if dir == "" {
		if dir, err = os.MkdirTemp("", "dashb"); err != nil {
			return res, err
		}
		defer os.RemoveAll(dir)
	}
	if err := os.MkdirAll(filepath.Join(dir, "c"), 0o750); err != nil {
		return res, err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	start := time.Now()
	cluster, err := devcluster.Start(ctx, devcluster.Options{Dir: filepath.Join(dir, "c"), Chart: cfg.Chart})
	if err != nil {
		return res, fmt.Errorf("devcluster: %w", err)
	}
	defer cluster.Stop()
	if err := scalebench.DeviceClasses(ctx, cluster, cfg.Chart, dir); err != nil {
		return res, err
	}
	res.Setup.Cluster = time.Since(start)
	logger.Info("Control plane ready", "elapsed", res.Setup.Cluster.Round(time.Millisecond))

	// One writer standing for every node's plugin and for the scheduler,
	// above the admin client's limits: the setup measures nothing.
	wcfg := restclient.CopyConfig(cluster.RESTConfig)
	wcfg.QPS, wcfg.Burst, wcfg.RateLimiter, wcfg.UserAgent = 1000, 2000, nil, "bench-dashboard/writer"
	writer, err := kubernetes.NewForConfig(wcfg)
	if err != nil {
		return res, err
	}
	start = time.Now()
	if err := scalebench.PublishFleet(ctx, writer, scalebench.MixMigOff, cfg.Nodes, cfg.Workers); err != nil {
		return res, fmt.Errorf("publishing %d nodes: %w", cfg.Nodes, err)
	}
	res.Setup.Fleet = time.Since(start)
	logger.Info("Fleet published", "nodes", cfg.Nodes, "elapsed", res.Setup.Fleet.Round(time.Millisecond))

	start = time.Now()
	for _, ns := range Namespaces {
		if _, err := writer.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
			return res, fmt.Errorf("namespace %s: %w", ns, err)
		}
	}
	var holders []holder
	for i := range cfg.Nodes {
		for k := range heldPerNode {
			holders = append(holders, holder{namespace: Namespaces[(i*heldPerNode+k)%len(Namespaces)],
				name: fmt.Sprintf("%s-gpu-%d", scalebench.FleetNodeName(i), k), node: scalebench.FleetNodeName(i), device: fmt.Sprintf("gpu-%d", k)})
		}
	}
	if err := parallel(ctx, cfg.Workers, holders, func(h holder) error { return h.create(ctx, writer) }); err != nil {
		return res, fmt.Errorf("allocating claims: %w", err)
	}
	res.Setup.Claims = time.Since(start)
	logger.Info("Claims allocated", "claims", len(holders), "elapsed", res.Setup.Claims.Round(time.Millisecond))

	// The process's live heap without the dashboard: the control plane
	// runs in this process too, so the dashboard's is the difference.
	heapBefore := liveHeap()

	start = time.Now()
	dashCtx, stopDash := context.WithCancel(ctx)
	urls := make(chan string, 1)
	dashDone := make(chan error, 1)
	go func() {
		dashDone <- dashboard.RunCluster(dashCtx, dashboard.ClusterRunConfig{
			ServeConfig: dashboard.ServeConfig{Address: "127.0.0.1:0", Listening: func(u string) { urls <- u }},
			RESTConfig:  cluster.RESTConfig, Context: "devcluster", NoUsage: true,
		})
	}()
	defer func() {
		stopDash()
		if derr := <-dashDone; derr != nil {
			err = errors.Join(err, fmt.Errorf("gpudra dashboard: %w", derr))
		}
	}()
	var printed string
	select {
	case printed = <-urls:
	case derr := <-dashDone:
		dashDone <- derr
		return res, fmt.Errorf("gpudra dashboard: %w", derr)
	}
	base, token, err := splitPrinted(printed)
	if err != nil {
		return res, err
	}
	api := newAPI(base, token)
	summary, rev, err := api.waitSummary(ctx, func(s dashboard.Summary) bool {
		return s.Nodes == cfg.Nodes && s.Allocated == len(holders)
	}, 5*time.Minute)
	if err != nil {
		return res, fmt.Errorf("the dashboard never showed %d nodes and %d GPUs allocated (last: %+v): %w", cfg.Nodes, len(holders), summary, err)
	}
	res.Setup.Synced = time.Since(start)
	res.Summary = summary
	logger.Info("Dashboard shows the fleet", "url", base, "revision", rev, "elapsed", res.Setup.Synced.Round(time.Millisecond))
	if res.ViewPlain, res.ViewGzip, err = api.sizes(ctx); err != nil {
		return res, err
	}
	events, err := watchRevisions(ctx, api)
	if err != nil {
		return res, err
	}

	bctx, closeBrowser, err := browser.New(ctx)
	if err != nil {
		return res, err
	}
	defer closeBrowser()
	b := &bench{cfg: cfg, base: base, api: api, events: events, bctx: bctx, writer: writer, fetched: map[uint64]bool{rev: true}}
	// The browser opens the printed URL once, for its cookie: the loads
	// timed below go to the base, without the token's redirect.
	if err := b.signIn(ctx, printed); err != nil {
		return res, err
	}
	if err := b.firstPaints(ctx, cluster.Client, &res); err != nil {
		return res, err
	}
	if err := b.updates(ctx, &res); err != nil {
		return res, err
	}
	closeBrowser()
	res.Heap = liveHeap() - heapBefore
	if err := buildTimes(ctx, cluster.Client, &res); err != nil {
		return res, err
	}
	if cfg.Out != nil {
		res.Markdown(cfg.Out)
	}
	return res, nil
}

// holder is one claim held by one bound pod.
type holder struct {
	namespace, name, node, device string
}

// create makes the pod (bound to its node, as the scheduler leaves it: no
// kubelet runs there), its claim, and the claim's allocation reserved for
// the pod, as the scheduler writes it. The pod must exist with the UID the
// claim names, or the ResourceClaim controller takes the reservation off.
func (h holder) create(ctx context.Context, c kubernetes.Interface) error {
	pod, err := c.CoreV1().Pods(h.namespace).Create(ctx, &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: h.name, Namespace: h.namespace},
		Spec: v1.PodSpec{NodeName: h.node, Containers: []v1.Container{{Name: "main", Image: "registry.k8s.io/pause:3.10",
			Resources: v1.ResourceRequirements{Requests: v1.ResourceList{v1.ResourceCPU: resource.MustParse("1")}}}}}}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("pod %s/%s: %w", h.namespace, h.name, err)
	}
	claim, err := c.ResourceV1().ResourceClaims(h.namespace).Create(ctx, &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: h.name, Namespace: h.namespace},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{Name: "gpu",
			Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: slicebuilder.DriverName}}}}}}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("claim %s/%s: %w", h.namespace, h.name, err)
	}
	h.allocate(claim, pod.UID)
	if _, err := c.ResourceV1().ResourceClaims(h.namespace).UpdateStatus(ctx, claim, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("allocating claim %s/%s: %w", h.namespace, h.name, err)
	}
	return nil
}

// allocate sets claim's status: h's device allocated, reserved for the pod.
func (h holder) allocate(claim *resourceapi.ResourceClaim, podUID types.UID) {
	claim.Status = resourceapi.ResourceClaimStatus{
		Allocation: &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{{
			Request: "gpu", Driver: slicebuilder.DriverName, Pool: h.node, Device: h.device}}},
			NodeSelector: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchFields: []v1.NodeSelectorRequirement{{
				Key: "metadata.name", Operator: v1.NodeSelectorOpIn, Values: []string{h.node}}}}}}},
		ReservedFor: []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: h.name, UID: podUID}}}
}

// parallel runs f on every item with workers goroutines; the first error
// stops it.
func parallel[T any](ctx context.Context, workers int, items []T, f func(T) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	next := make(chan T)
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
	)
	for range workers {
		wg.Go(func() {
			for it := range next {
				if err := f(it); err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
					cancel()
					return
				}
			}
		})
	}
feed:
	for _, it := range items {
		select {
		case next <- it:
		case <-ctx.Done():
			break feed
		}
	}
	close(next)
	wg.Wait()
	if first != nil {
		return first
	}
	return ctx.Err()
}

// liveHeap is the process's heap after a full collection.
func liveHeap() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// buildTimes times dashboard.Build over the objects the dashboard reads
// (listed once here) and the encoding the server does once per revision.
func buildTimes(ctx context.Context, c kubernetes.Interface, res *Result) error {
	nodes, err := c.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	sl, err := c.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	claims, err := c.ResourceV1().ResourceClaims("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	pods, err := c.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	classes, err := c.ResourceV1().DeviceClasses().List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	in := dashboard.ClusterInputs{Now: time.Now(), Context: "devcluster", Nodes: ptrs(nodes.Items), Slices: ptrs(sl.Items),
		Claims: ptrs(claims.Items), Pods: ptrs(pods.Items), DeviceClasses: ptrs(classes.Items)}
	var builds, encodes []time.Duration
	for range 5 {
		start := time.Now()
		v := dashboard.Build(in)
		builds = append(builds, time.Since(start))
		start = time.Now()
		if _, _, err := encode(v); err != nil {
			return err
		}
		encodes = append(encodes, time.Since(start))
	}
	res.Build, res.Encode = median(builds), median(encodes)
	return nil
}

func ptrs[T any](items []T) []*T {
	out := make([]*T, len(items))
	for i := range items {
		out[i] = &items[i]
	}
	return out
}

func median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}
