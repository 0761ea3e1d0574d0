package scalebench

import (
	"context"
	"fmt"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/bench/prepbench"
)

// namespace holds every pod and template of the benchmark.
const namespace = "scale"

// The chart's DeviceClasses.
const (
	classGPU = "gpu.gpudra.dev"
	classMIG = "mig.gpudra.dev"
)

// workload is one kind of pod of a point: each pod has one claim from the
// template.
type workload struct {
	name string
	// gpus is what one pod takes of the general pool, for sizing: a MIG
	// device counts as a whole GPU, since pods spread over nodes may leave
	// one partly used GPU per pod.
	gpus     int
	template *resourceapi.ResourceClaimTemplate
}

func migSelector(profile string) []resourceapi.DeviceSelector {
	return []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
		Expression: fmt.Sprintf(`device.attributes["gpu.gpudra.dev"].migProfile == %q`, profile)}}}
}

func claimTemplate(name string, devices resourceapi.DeviceClaim) *resourceapi.ResourceClaimTemplate {
	return &resourceapi.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: resourceapi.ResourceClaimSpec{Devices: devices}}}
}

// workloads are the mix's workloads other than gangs, in the order they
// run: MIG claims where 1g.10gb devices are published, NVLink pairs where
// GPUs carry an NVLink domain.
func (m *mix) workloads() []workload {
	var out []workload
	if m.wholeGPUs > 0 {
		out = append(out, workload{name: "gpu", gpus: 1, template: claimTemplate("gpu", resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
			Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: classGPU}}}})})
	}
	if m.hasMig1g {
		out = append(out, workload{name: "mig-1g.10gb", gpus: 1, template: claimTemplate("mig-1g", resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
			Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: classMIG, Selectors: migSelector("1g.10gb")}}}})})
	}
	if m.hasNVLink && m.wholeGPUs >= 2 {
		out = append(out, workload{name: "nvlink-pair", gpus: 2, template: claimTemplate("nvlink-pair", resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: classGPU,
				AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 2}}},
			Constraints: []resourceapi.DeviceConstraint{{Requests: []string{"gpu"}, MatchAttribute: ptr.To(resourceapi.FullyQualifiedName("gpu.gpudra.dev/nvlinkDomain"))}}})})
	}
	// A whole GPU, else a 3g.40gb (examples/prioritized-list).
	if m.wholeGPUs == 0 && !m.has3g {
		return out
	}
	out = append(out, workload{name: "gpu-or-3g.40gb", gpus: 1, template: claimTemplate("gpu-or-3g", resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
		Name: "gpu", FirstAvailable: []resourceapi.DeviceSubRequest{
			{Name: "whole", DeviceClassName: classGPU},
			{Name: "mig-3g", DeviceClassName: classMIG, Selectors: migSelector("3g.40gb")}}}}})})
	return out
}

func gangTemplate(gpus int) *resourceapi.ResourceClaimTemplate {
	return claimTemplate(fmt.Sprintf("gang-%d-gpus", gpus), resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
		Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: classGPU,
			AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: int64(gpus)}}}})
}

// pod is a pod with one claim from template, on the nodes of pool.
func pod(name, template, pool string) *v1.Pod {
	return &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace},
		Spec: v1.PodSpec{RestartPolicy: v1.RestartPolicyNever, NodeSelector: map[string]string{poolLabel: pool},
			Containers: []v1.Container{{Name: "cuda", Image: "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04",
				Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu"}}}}},
			ResourceClaims: []v1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: ptr.To(template)}}}}
}

// gangPod is a pod of a gang of size pods: the gpudra.dev/gang label and
// size, which the controller's webhook gates and the controller plans.
func gangPod(name, gang string, size int, template, pool string) *v1.Pod {
	p := pod(name, template, pool)
	p.Labels = map[string]string{gpudrav1.LabelGang: gang}
	p.Annotations = map[string]string{gpudrav1.AnnotationGangSize: fmt.Sprint(size)}
	return p
}

// podWatch records when the harness first saw each pod bound to a node,
// by its monotonic clock: one watch of the namespace.
type podWatch struct {
	mu    sync.Mutex
	bound map[string]time.Time
	stop  chan struct{}
}

func watchPods(client kubernetes.Interface) (*podWatch, error) {
	w := &podWatch{bound: map[string]time.Time{}, stop: make(chan struct{})}
	lw := cache.NewListWatchFromClient(client.CoreV1().RESTClient(), "pods", namespace, fields.Everything())
	observe := func(obj any) {
		p, ok := obj.(*v1.Pod)
		if !ok || p.Spec.NodeName == "" {
			return
		}
		now := time.Now()
		w.mu.Lock()
		if _, seen := w.bound[p.Name]; !seen {
			w.bound[p.Name] = now
		}
		w.mu.Unlock()
	}
	_, informer := cache.NewInformerWithOptions(cache.InformerOptions{ListerWatcher: lw, ObjectType: &v1.Pod{},
		Handler: cache.ResourceEventHandlerFuncs{AddFunc: observe, UpdateFunc: func(_, obj any) { observe(obj) }}})
	go informer.Run(w.stop)
	if !cache.WaitForCacheSync(w.stop, informer.HasSynced) {
		close(w.stop)
		return nil, fmt.Errorf("pod informer did not sync")
	}
	return w, nil
}

// wait waits until every named pod was seen bound, or timeout; it returns
// when each was seen bound (zero: not bound).
func (w *podWatch) wait(ctx context.Context, names []string, timeout time.Duration) []time.Time {
	deadline := time.Now().Add(timeout)
	out := make([]time.Time, len(names))
	for {
		w.mu.Lock()
		missing := 0
		for i, n := range names {
			out[i] = w.bound[n]
			if out[i].IsZero() {
				missing++
			}
		}
		w.mu.Unlock()
		if missing == 0 || time.Now().After(deadline) || ctx.Err() != nil {
			return out
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// createPods creates the pods, 16 creates in flight (as the e2e
// benchmarks do), and returns when each create call was made.
func createPods(ctx context.Context, client kubernetes.Interface, pods []*v1.Pod) ([]time.Time, error) {
	created := make([]time.Time, len(pods))
	errs := make([]error, len(pods))
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for i, p := range pods {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			created[i] = time.Now()
			if _, err := client.CoreV1().Pods(namespace).Create(ctx, p, metav1.CreateOptions{}); err != nil {
				errs[i] = fmt.Errorf("create pod %s: %w", p.Name, err)
			}
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return created, err
		}
	}
	return created, nil
}

// Workload is what one workload of a point measured.
type Workload struct {
	Name string
	// Pods created, and Bound of them within the timeout.
	Pods, Bound int
	// Span is from the first create call to the last pod seen bound;
	// PodsPerSec is Bound over Span.
	Span       time.Duration
	PodsPerSec float64
	// Latencies are create call to seen bound, of the bound pods.
	Latencies []time.Duration
	// GangLast is, for gangs, the longest time from a gang's last create
	// call to all its pods seen bound.
	GangLast time.Duration
}

// P is the p-th percentile (0..1) of the latencies.
func (w Workload) P(p float64) time.Duration { return prepbench.Percentile(w.Latencies, p) }

// measure creates the pods and waits for them to be bound.
func measure(ctx context.Context, client kubernetes.Interface, watch *podWatch, name string, pods []*v1.Pod, timeout time.Duration) (Workload, error) {
	w := Workload{Name: name, Pods: len(pods)}
	names := make([]string, len(pods))
	for i, p := range pods {
		names[i] = p.Name
	}
	created, err := createPods(ctx, client, pods)
	if err != nil {
		return w, err
	}
	bound := watch.wait(ctx, names, timeout)
	first := created[0]
	var last time.Time
	for i, b := range bound {
		if created[i].Before(first) {
			first = created[i]
		}
		if b.IsZero() {
			continue
		}
		w.Bound++
		w.Latencies = append(w.Latencies, b.Sub(created[i]))
		if b.After(last) {
			last = b
		}
	}
	if w.Bound > 0 {
		w.Span = last.Sub(first)
		w.PodsPerSec = float64(w.Bound) / w.Span.Seconds()
	}
	// Gangs: pods are named <gang>-<i>; the gang's last create to its
	// last pod bound.
	type span struct {
		created, bound time.Time
		unbound        bool
	}
	gangs := map[string]*span{}
	for i, p := range pods {
		g, ok := p.Labels[gpudrav1.LabelGang]
		if !ok {
			continue
		}
		s := gangs[g]
		if s == nil {
			s = &span{}
			gangs[g] = s
		}
		if created[i].After(s.created) {
			s.created = created[i]
		}
		if bound[i].IsZero() {
			s.unbound = true
		} else if bound[i].After(s.bound) {
			s.bound = bound[i]
		}
	}
	for _, s := range gangs {
		if d := s.bound.Sub(s.created); !s.unbound && d > w.GangLast {
			w.GangLast = d
		}
	}
	return w, nil
}
