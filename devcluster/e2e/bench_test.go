package e2e

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/tools/cache"
)

const benchNodes, benchPods = 16, 100

// BenchmarkScheduleAndPrepare100Pods creates 100 pods with one whole-GPU
// claim each over 16 simulated DGX H100 nodes and measures, per pod, the
// time from the create call to the kubelet reporting it Running, split where
// the pod is bound to its node:
//   - the cluster's share, create to bound: the ResourceClaim controller
//     generates the claim, the scheduler allocates and reserves it and
//     binds the pod;
//   - the driver's share, bound to Running: the kubelet's DRA manager reads
//     the claim, the plugin prepares it over gRPC, the CDI spec is resolved
//     and the status written (devcluster's stand-in kubelet does the
//     container part).
//
// Both instants are seen through one watch of the benchmark's and stamped
// with the local monotonic clock: the PodScheduled condition's time has
// only second resolution. The throughput is pods per second from the first
// create to the last Running. The scheduler's and the controllers' client
// limits are those they ship with unless DEVCLUSTER_CONTROL_PLANE_QPS
// (and _BURST) say otherwise (main_test.go).
func BenchmarkScheduleAndPrepare100Pods(b *testing.B) {
	ctx := context.Background()
	b.Logf("control plane clients: %s", cluster.ControlPlaneClients)
	addBenchNodes(b)
	var total, clusterShare, driverShare []time.Duration
	var elapsed, cpu time.Duration
	boundUnseen := 0
	b.ResetTimer()
	for iter := 0; iter < b.N; iter++ {
		b.StopTimer()
		ns := fmt.Sprintf("bench-%d-%d", iter, time.Now().UnixNano()%100000)
		if _, err := cluster.Client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
			b.Fatal(err)
		}
		if _, err := cluster.Client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, template("one-gpu",
			resourceapi.DeviceRequest{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.gpudra.dev"}}, nil, nil),
			metav1.CreateOptions{}); err != nil {
			b.Fatal(err)
		}
		pods := watchPods(b, ns)
		b.StartTimer()

		start, cpuStart := time.Now(), processCPU(b)
		created := make([]time.Time, benchPods)
		var wg sync.WaitGroup
		sem := make(chan struct{}, 16)
		for i := 0; i < benchPods; i++ {
			wg.Add(1)
			sem <- struct{}{}
			go func(i int) {
				defer wg.Done()
				defer func() { <-sem }()
				created[i] = time.Now()
				if _, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, gpuPod(fmt.Sprintf("pod-%03d", i), "one-gpu"), metav1.CreateOptions{}); err != nil {
					b.Error(err)
				}
			}(i)
		}
		wg.Wait()
		seen := pods.wait(b, benchPods, 5*time.Minute)
		cpu += processCPU(b) - cpuStart
		var last time.Time
		for i := 0; i < benchPods; i++ {
			at := seen[fmt.Sprintf("pod-%03d", i)]
			if at.bound.IsZero() {
				// Bound and Running in one event: the share cannot be
				// split for this pod; it counts as all cluster.
				boundUnseen++
				at.bound = at.running
			}
			total = append(total, at.running.Sub(created[i]))
			clusterShare = append(clusterShare, at.bound.Sub(created[i]))
			driverShare = append(driverShare, at.running.Sub(at.bound))
			if at.running.After(last) {
				last = at.running
			}
		}
		elapsed += last.Sub(start)
		b.StopTimer()
		pods.stop()
		deleteAllPods(b, ns)
		b.StartTimer()
	}
	b.StopTimer()
	if boundUnseen > 0 {
		b.Logf("%d pods were seen bound and Running at once; their driver share counts as 0", boundUnseen)
	}
	b.ReportMetric(float64(benchPods*b.N)/elapsed.Seconds(), "pods/s")
	reportPercentiles(b, "", total)
	reportPercentiles(b, "cluster-", clusterShare)
	reportPercentiles(b, "driver-", driverShare)
	// Everything runs in this process: how much of the machine it used
	// tells a CPU-bound run from one that waits (rate limits, queues).
	b.ReportMetric(cpu.Seconds()/elapsed.Seconds(), "cores-used")
	b.ReportMetric(0, "ns/op")
}

// processCPU is the CPU time this process has used, user and system.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// reportPercentiles reports the p50 and p99 of d in milliseconds.
func reportPercentiles(b *testing.B, prefix string, d []time.Duration) {
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	b.ReportMetric(float64(d[len(d)/2].Microseconds())/1000, prefix+"p50-ms")
	b.ReportMetric(float64(d[len(d)*99/100].Microseconds())/1000, prefix+"p99-ms")
}

// podTimes are when the benchmark first saw a pod bound to a node and
// Running, by the local monotonic clock.
type podTimes struct{ bound, running time.Time }

// podWatch records podTimes for each pod of a namespace.
type podWatch struct {
	mu    sync.Mutex
	at    map[string]podTimes
	close chan struct{}
}

func watchPods(b *testing.B, ns string) *podWatch {
	w := &podWatch{at: map[string]podTimes{}, close: make(chan struct{})}
	lw := cache.NewListWatchFromClient(cluster.Client.CoreV1().RESTClient(), "pods", ns, fields.Everything())
	_, informer := cache.NewInformerWithOptions(cache.InformerOptions{
		ListerWatcher: lw, ObjectType: &v1.Pod{},
		Handler: cache.ResourceEventHandlerFuncs{
			AddFunc:    func(obj any) { w.observe(obj) },
			UpdateFunc: func(_, obj any) { w.observe(obj) },
		},
	})
	go informer.Run(w.close)
	if !cache.WaitForCacheSync(w.close, informer.HasSynced) {
		b.Fatal("pod informer did not sync")
	}
	return w
}

func (w *podWatch) observe(obj any) {
	pod, ok := obj.(*v1.Pod)
	if !ok || pod.Spec.NodeName == "" {
		return
	}
	now := time.Now()
	w.mu.Lock()
	defer w.mu.Unlock()
	t := w.at[pod.Name]
	if t.bound.IsZero() && pod.Status.Phase != v1.PodRunning {
		t.bound = now
	}
	if t.running.IsZero() && pod.Status.Phase == v1.PodRunning {
		t.running = now
	}
	w.at[pod.Name] = t
}

// running counts the pods seen Running; w.mu is held.
func (w *podWatch) running() int {
	n := 0
	for _, t := range w.at {
		if !t.running.IsZero() {
			n++
		}
	}
	return n
}

func (w *podWatch) wait(b *testing.B, n int, timeout time.Duration) map[string]podTimes {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		w.mu.Lock()
		if w.running() >= n {
			out := make(map[string]podTimes, len(w.at))
			for k, v := range w.at {
				out[k] = v
			}
			w.mu.Unlock()
			return out
		}
		w.mu.Unlock()
		time.Sleep(5 * time.Millisecond)
	}
	w.mu.Lock()
	got := w.running()
	w.mu.Unlock()
	b.Fatalf("only %d of %d pods running after %s", got, n, timeout)
	return nil
}

func (w *podWatch) stop() { close(w.close) }
