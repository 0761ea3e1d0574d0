package e2e

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/tools/cache"

	"github.com/gpudra/gpudra/devcluster"
)

const benchNodes, benchPods = 16, 100

// BenchmarkScheduleAndPrepare100Pods creates 100 pods with one whole-GPU
// claim each over 16 simulated DGX H100 nodes and measures, from the pod's
// creation to the kubelet reporting it Running (claim generated, allocated
// by the scheduler, reserved, prepared by the plugin over gRPC, CDI spec
// resolved), the latency per pod and the throughput.
func BenchmarkScheduleAndPrepare100Pods(b *testing.B) {
	ctx := context.Background()
	for i := len(cluster.Nodes()); i < benchNodes; i++ {
		n, err := cluster.AddNode(ctx, devcluster.NodeOptions{Name: fmt.Sprintf("bench-%02d", i), Machine: "dgx-h100-nomig"})
		if err != nil {
			b.Fatal(err)
		}
		if err := n.WaitForSlices(ctx); err != nil {
			b.Fatal(err)
		}
	}
	var lat []time.Duration
	var elapsed time.Duration
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
		running := watchRunning(b, ns)
		b.StartTimer()

		start := time.Now()
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
		ranAt := running.wait(b, benchPods, 5*time.Minute)
		var last time.Time
		for i := 0; i < benchPods; i++ {
			t := ranAt[fmt.Sprintf("pod-%03d", i)]
			lat = append(lat, t.Sub(created[i]))
			if t.After(last) {
				last = t
			}
		}
		elapsed += last.Sub(start)
		b.StopTimer()
		running.stop()
		deleteAllPods(b, ns)
		b.StartTimer()
	}
	b.StopTimer()
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	b.ReportMetric(float64(benchPods*b.N)/elapsed.Seconds(), "pods/s")
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99-ms")
	b.ReportMetric(0, "ns/op")
}

// runningWatch records when each pod of a namespace is first seen Running.
type runningWatch struct {
	mu    sync.Mutex
	at    map[string]time.Time
	close chan struct{}
}

func watchRunning(b *testing.B, ns string) *runningWatch {
	w := &runningWatch{at: map[string]time.Time{}, close: make(chan struct{})}
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

func (w *runningWatch) observe(obj any) {
	pod, ok := obj.(*v1.Pod)
	if !ok || pod.Status.Phase != v1.PodRunning {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if _, seen := w.at[pod.Name]; !seen {
		w.at[pod.Name] = time.Now()
	}
}

func (w *runningWatch) wait(b *testing.B, n int, timeout time.Duration) map[string]time.Time {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		w.mu.Lock()
		got := len(w.at)
		w.mu.Unlock()
		if got >= n {
			w.mu.Lock()
			defer w.mu.Unlock()
			out := make(map[string]time.Time, len(w.at))
			for k, v := range w.at {
				out[k] = v
			}
			return out
		}
		time.Sleep(5 * time.Millisecond)
	}
	b.Fatalf("only %d of %d pods running after %s", len(w.at), n, timeout)
	return nil
}

func (w *runningWatch) stop() { close(w.close) }
