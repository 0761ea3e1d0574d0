package scalebench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/kubernetes"
	restclient "k8s.io/client-go/rest"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/chart"
)

// Point is what one node count of one mix measured.
type Point struct {
	Mix       string
	MigPolicy string
	Nodes     int
	// Devices and Slices are the whole cluster's; Publish is how long the
	// point's new nodes and slices took to write.
	Devices, Slices int
	Publish         time.Duration
	// Workloads, gangs last.
	Workloads []Workload
	// GangNodes is the pool the point's gangs had (0: no gangs).
	GangNodes int

	// The control plane process (etcd, kube-apiserver, kube-scheduler,
	// the controllers, and the harness): Go heap in use after a GC,
	// resident set now and at its peak so far, CPU over the idle window
	// (percent of one core), etcd's database file.
	CPHeap, CPRSS, CPPeak uint64
	CPIdleCPU             float64
	EtcdDB                int64

	// gpudra-controller: CPU over the idle window (percent of one core),
	// resident set at the end of the point and at its peak so far; the
	// gang plans of the point (count and mean time, from
	// gpudra_gang_plan_duration_seconds) and, where the controller exports
	// one, its mean round time.
	CtrlIdleCPU         float64
	CtrlRSS, CtrlPeak   uint64
	Plans               int
	PlanMean, RoundMean time.Duration
}

// General are the point's workloads other than gangs, as one.
func (p Point) General() Workload {
	all := Workload{Name: "all but gangs"}
	for _, w := range p.Workloads {
		if w.GangLast > 0 || isGang(w.Name) {
			continue
		}
		all.Pods += w.Pods
		all.Bound += w.Bound
		all.Span += w.Span
		all.Latencies = append(all.Latencies, w.Latencies...)
	}
	if all.Span > 0 {
		all.PodsPerSec = float64(all.Bound) / all.Span.Seconds()
	}
	return all
}

func isGang(name string) bool { return strings.HasPrefix(name, "gangs") }

// runMix starts a control plane and the controller, and runs the points.
func runMix(ctx context.Context, cfg Config, m *mix, dir string) ([]Point, error) {
	logger := klog.FromContext(ctx)
	if err := os.MkdirAll(filepath.Join(dir, "c"), 0o750); err != nil {
		return nil, err
	}
	cluster, err := devcluster.Start(ctx, devcluster.Options{Dir: filepath.Join(dir, "c"), Chart: cfg.Chart, ControlPlaneQPS: cfg.ControlPlaneQPS})
	if err != nil {
		return nil, err
	}
	defer cluster.Stop()
	ctrl, err := startController(ctx, cluster, cfg.ControllerBinary, dir)
	if err != nil {
		return nil, err
	}
	defer ctrl.stop()
	if err := DeviceClasses(ctx, cluster, cfg.Chart, dir); err != nil {
		return nil, err
	}
	if _, err := cluster.Client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}, metav1.CreateOptions{}); err != nil {
		return nil, err
	}
	templates := []string{}
	for _, w := range m.workloads() {
		if _, err := cluster.Client.ResourceV1().ResourceClaimTemplates(namespace).Create(ctx, w.template, metav1.CreateOptions{}); err != nil {
			return nil, fmt.Errorf("template %s: %w", w.template.Name, err)
		}
		templates = append(templates, w.template.Name)
	}
	gangTmpl := gangTemplate(cfg.GangGPUs)
	if _, err := cluster.Client.ResourceV1().ResourceClaimTemplates(namespace).Create(ctx, gangTmpl, metav1.CreateOptions{}); err != nil {
		return nil, fmt.Errorf("template %s: %w", gangTmpl.Name, err)
	}
	logger.V(1).Info("Control plane and gpudra-controller ready", "mix", m.name, "templates", templates)
	// The publisher stands for every node's plugin: one client of the
	// harness, above the admin client's limits so that writing 1,000
	// nodes' slices measures the API server rather than a rate limiter.
	pubCfg := restclient.CopyConfig(cluster.RESTConfig)
	pubCfg.QPS, pubCfg.Burst, pubCfg.RateLimiter, pubCfg.UserAgent = 500, 1000, nil, "bench-scale/publisher"
	publisher, err := kubernetes.NewForConfig(pubCfg)
	if err != nil {
		return nil, err
	}
	watch, err := watchPods(cluster.Client)
	if err != nil {
		return nil, err
	}
	defer close(watch.stop)

	s := &mixState{cfg: cfg, m: m, cluster: cluster, ctrl: ctrl, publisher: publisher, watch: watch, gangTemplate: gangTmpl.Name}
	var points []Point
	for _, n := range cfg.Nodes {
		p, err := s.point(ctx, n)
		points = append(points, p)
		printPoint(cfg.Stdout, p)
		if err != nil {
			return points, fmt.Errorf("%d nodes: %w", n, err)
		}
	}
	return points, nil
}

// mixState is what carries from one point of a mix to the next.
type mixState struct {
	cfg          Config
	m            *mix
	cluster      *devcluster.Cluster
	ctrl         *controllerProcess
	publisher    kubernetes.Interface
	watch        *podWatch
	gangTemplate string
	// nodes so far; generalGPUs in the general pool, usedGPUs of them by
	// earlier points (for sizing).
	nodes, generalGPUs, usedGPUs int
	plansSum, plansCount         float64
	roundsSum, roundsCount       float64
}

const gpusPerNode = 8

// point grows the cluster to n nodes and runs the workloads.
func (s *mixState) point(ctx context.Context, n int) (Point, error) {
	logger := klog.FromContext(ctx).WithValues("mix", s.m.name, "nodes", n)
	p := Point{Mix: s.m.name, MigPolicy: s.m.policyString(), Nodes: n, Devices: n * s.m.devicesPerNode, Slices: n * s.m.slicesPerNode}
	newNodes := n - s.nodes
	// The gangs' pool: whole nodes of this point's new ones, at most half
	// of them.
	gangs := min(s.cfg.Gangs, newNodes/2/s.cfg.GangSize)
	if s.m.wholeGPUs < s.cfg.GangGPUs {
		gangs = 0 // no node has that many whole GPUs
	}
	gangNodes := gangs * s.cfg.GangSize * s.cfg.GangGPUs / gpusPerNode
	p.GangNodes = gangNodes
	gangPool := "gang-" + strconv.Itoa(n)
	first := s.nodes
	start := time.Now()
	err := publish(ctx, s.publisher, s.m, first, n, func(i int) string {
		if i-first < gangNodes {
			return gangPool
		}
		return poolGeneral
	}, 8)
	p.Publish = time.Since(start)
	if err != nil {
		return p, err
	}
	s.nodes = n
	s.generalGPUs += (newNodes - gangNodes) * gpusPerNode
	logger.Info("Nodes published", "devices", p.Devices, "slices", p.Slices, "elapsed", p.Publish.Round(time.Millisecond))
	// The scheduler's informer must have the new slices before pods
	// come, or the first pods would meet a partial cluster.
	if err := s.waitSlicesSeen(ctx, p.Slices); err != nil {
		return p, err
	}

	workloads := s.m.workloads()
	demand := 0
	for _, w := range workloads {
		demand += w.gpus
	}
	if demand == 0 {
		return p, fmt.Errorf("mix %s publishes nothing the workloads can use", s.m.name)
	}
	pods := min(s.cfg.Pods, (s.generalGPUs*7/10-s.usedGPUs)/demand)
	if pods <= 0 {
		return p, fmt.Errorf("no room for pods: %d GPUs in the general pool, %d used", s.generalGPUs, s.usedGPUs)
	}
	prefix := fmt.Sprintf("n%d-", n)
	for _, w := range workloads {
		list := make([]*v1.Pod, pods)
		for i := range list {
			list[i] = pod(fmt.Sprintf("%s%s-%03d", prefix, w.template.Name, i), w.template.Name, poolGeneral)
		}
		res, err := measure(ctx, s.cluster.Client, s.watch, w.name, list, s.cfg.BoundTimeout)
		p.Workloads = append(p.Workloads, res)
		if err != nil {
			return p, err
		}
		s.usedGPUs += pods * w.gpus
		logger.Info("Workload bound", "workload", w.name, "pods", res.Pods, "bound", res.Bound, "podsPerSecond", fmt.Sprintf("%.1f", res.PodsPerSec),
			"p99", res.P(0.99).Round(time.Millisecond))
	}
	if gangs > 0 {
		var list []*v1.Pod
		for g := range gangs {
			for i := range s.cfg.GangSize {
				gang := fmt.Sprintf("%sg%d", prefix, g)
				list = append(list, gangPod(fmt.Sprintf("%s-%d", gang, i), gang, s.cfg.GangSize, s.gangTemplate, gangPool))
			}
		}
		name := fmt.Sprintf("gangs %dx%dx%d", gangs, s.cfg.GangSize, s.cfg.GangGPUs)
		res, err := measure(ctx, s.cluster.Client, s.watch, name, list, s.cfg.BoundTimeout)
		p.Workloads = append(p.Workloads, res)
		if err != nil {
			return p, err
		}
		logger.Info("Gangs bound", "pods", res.Pods, "bound", res.Bound, "lastCreateToAllBound", res.GangLast.Round(time.Millisecond))
	}
	return p, s.measureIdle(ctx, &p)
}

// waitSlicesSeen waits until the API server lists the slices (the
// scheduler's informer follows within moments).
func (s *mixState) waitSlicesSeen(ctx context.Context, want int) error {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		list, err := s.cluster.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{ResourceVersion: "0"})
		if err == nil && len(list.Items) >= want {
			return nil
		}
		if time.Now().After(deadline) {
			got := 0
			if list != nil {
				got = len(list.Items)
			}
			return fmt.Errorf("%d of %d ResourceSlices listed after 2m: %w", got, want, err)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// measureIdle measures, once the point's pods are bound, the memory and
// the CPU of the control plane process and of the controller over
// IdleWindow.
func (s *mixState) measureIdle(ctx context.Context, p *Point) error {
	// Let the last writes (claim status, gang conditions) settle.
	time.Sleep(2 * time.Second)
	ctrlPid := strconv.Itoa(s.ctrl.pid())
	cpu0, err1 := procCPU("self")
	ctrl0, err2 := procCPU(ctrlPid)
	if err := errors.Join(err1, err2); err != nil {
		return err
	}
	start := time.Now()
	select {
	case <-time.After(s.cfg.IdleWindow):
	case <-ctx.Done():
		return ctx.Err()
	}
	cpu1, err1 := procCPU("self")
	ctrl1, err2 := procCPU(ctrlPid)
	if err := errors.Join(err1, err2); err != nil {
		return err
	}
	window := time.Since(start)
	p.CPIdleCPU = 100 * (cpu1 - cpu0).Seconds() / window.Seconds()
	p.CtrlIdleCPU = 100 * (ctrl1 - ctrl0).Seconds() / window.Seconds()
	var err error
	if p.CtrlRSS, p.CtrlPeak, err = procMemory(ctrlPid); err != nil {
		return err
	}
	if p.CPRSS, p.CPPeak, err = procMemory("self"); err != nil {
		return err
	}
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	p.CPHeap = ms.HeapInuse
	if st, err := os.Stat(filepath.Join(s.cluster.Dir, "etcd", "member", "snap", "db")); err == nil {
		p.EtcdDB = st.Size()
	}
	metrics, err := s.ctrl.metrics(ctx)
	if err != nil {
		return fmt.Errorf("gpudra-controller metrics: %w", err)
	}
	sum, count := metrics["gpudra_gang_plan_duration_seconds_sum"], metrics["gpudra_gang_plan_duration_seconds_count"]
	if c := count - s.plansCount; c > 0 {
		p.Plans = int(c)
		p.PlanMean = time.Duration((sum - s.plansSum) / c * float64(time.Second))
	}
	s.plansSum, s.plansCount = sum, count
	// A round histogram, where the controller has one.
	for name, v := range metrics {
		if strings.HasSuffix(name, "_sum") && strings.HasPrefix(name, "gpudra_") && strings.Contains(name, "round") && strings.Contains(name, "seconds") {
			base := name[:len(name)-4]
			rs, rc := v, metrics[base+"_count"]
			if c := rc - s.roundsCount; c > 0 {
				p.RoundMean = time.Duration((rs - s.roundsSum) / c * float64(time.Second))
			}
			s.roundsSum, s.roundsCount = rs, rc
			break
		}
	}
	return nil
}

// DeviceClasses applies the DeviceClasses the chart ships, as rendered for
// devcluster (the scale and the dashboard benchmarks).
func DeviceClasses(ctx context.Context, c *devcluster.Cluster, opts chart.Options, dir string) error {
	rendered, err := chart.Render(ctx, opts, c.Dir)
	if err != nil {
		return err
	}
	f := filepath.Join(dir, "chart.yaml")
	if err := os.WriteFile(f, []byte(rendered), 0o600); err != nil {
		return err
	}
	objs, err := devcluster.Manifests(f)
	if err != nil {
		return err
	}
	var classes []*unstructured.Unstructured
	for _, o := range objs {
		if o.GetKind() == "DeviceClass" {
			classes = append(classes, o)
		}
	}
	if err := c.Apply(ctx, "", classes); err != nil {
		return fmt.Errorf("the chart's DeviceClasses: %w", err)
	}
	for _, name := range []string{classGPU, classMIG} {
		if _, err := c.Client.ResourceV1().DeviceClasses().Get(ctx, name, metav1.GetOptions{}); err != nil {
			if apierrors.IsNotFound(err) {
				return fmt.Errorf("the chart ships no DeviceClass %s", name)
			}
			return err
		}
	}
	return nil
}
