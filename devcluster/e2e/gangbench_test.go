package e2e

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpudra/gpudra/devcluster/nodeagent"
)

// addBenchNodes adds whole-GPU DGX nodes (MIG off, 8 H100s each) up to
// benchNodes.
func addBenchNodes(b *testing.B) {
	ctx := context.Background()
	for i := len(cluster.Nodes()); i < benchNodes; i++ {
		n, err := cluster.AddNode(ctx, nodeagent.NodeOptions{Name: fmt.Sprintf("bench-%02d", i), Machine: "dgx-h100-nomig"})
		if err != nil {
			b.Fatal(err)
		}
		if err := n.WaitForSlices(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

// createGangs creates gangs x size pods, each with a claim of perPod whole
// GPUs, all at once (16 creates in flight), and returns when the last create
// returned.
func createGangs(b *testing.B, ns string, gangs, size int, template string) time.Time {
	ctx := context.Background()
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for g := range gangs {
		for i := range size {
			wg.Add(1)
			sem <- struct{}{}
			go func() {
				defer wg.Done()
				defer func() { <-sem }()
				p := gangPod(fmt.Sprintf("g%02d-%d", g, i), fmt.Sprintf("g%02d", g), size, template, nil)
				// Keep off the MIG, fractional and device-plugin nodes.
				p.Spec.NodeSelector = map[string]string{"gpu.gpudra.dev/present": "true"}
				p.Spec.Affinity = &v1.Affinity{NodeAffinity: &v1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &v1.NodeSelector{
					NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchExpressions: []v1.NodeSelectorRequirement{{
						Key: "kubernetes.io/hostname", Operator: v1.NodeSelectorOpNotIn, Values: []string{"dgx-h100-0", fractionalNode, dpNode}}}}}}}}
				if _, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{}); err != nil {
					b.Error(err)
				}
			}()
		}
	}
	wg.Wait()
	return time.Now()
}

// benchGangNamespace makes a namespace with a template of perPod GPUs.
func benchGangNamespace(b *testing.B, perPod int64) string {
	ctx := context.Background()
	ns := fmt.Sprintf("bench-gang-%d", time.Now().UnixNano()%1000000)
	if _, err := cluster.Client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		b.Fatal(err)
	}
	if _, err := cluster.Client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, gpus("gpus", perPod), metav1.CreateOptions{}); err != nil {
		b.Fatal(err)
	}
	return ns
}

// endGangs deletes the namespace's pods and waits for their claims to go,
// so that the next run finds the devices free.
func endGangs(b *testing.B, ns string) {
	deleteAllPods(b, ns)
	err := wait.PollUntilContextTimeout(context.Background(), 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		claims, err := cluster.Client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
		return err == nil && len(claims.Items) == 0, nil
	})
	if err != nil {
		b.Fatalf("claims of %s not gone: %v", ns, err)
	}
}

// warmGangPath runs one gang of one pod through the path: after a mode
// change the new controller replicas elect a leader first (a 4 s lease in
// devcluster), which is no part of what a gang costs.
func warmGangPath(b *testing.B) {
	ns := benchGangNamespace(b, 1)
	pods := watchPods(b, ns)
	createGangs(b, ns, 1, 1, "gpus")
	pods.waitBound(b, 1, time.Minute)
	pods.stop()
	endGangs(b, ns)
}

// BenchmarkGang8x8GPUs: one gang of 8 pods with 8 whole H100s each (a whole
// 64-GPU training job on 8 DGX nodes), on each gang path. The metric is the
// time from the last pod's create call returning to all 8 pods seen bound
// by one watch: what the gang path adds (complete gang noticed, planned,
// handed over; the scheduler's one group cycle on the Workload API path,
// fence, settle, writes and gate lifts on the gate path) plus binding.
func BenchmarkGang8x8GPUs(b *testing.B) {
	addBenchNodes(b)
	for _, mode := range gangPaths {
		b.Run(mode, func(b *testing.B) {
			onGangPath(b, mode)
			warmGangPath(b)
			b.ResetTimer()
			var total time.Duration
			for range b.N {
				ns := benchGangNamespace(b, 8)
				pods := watchPods(b, ns)
				last := createGangs(b, ns, 1, 8, "gpus")
				seen := pods.waitBound(b, 8, 3*time.Minute)
				pods.stop()
				total += seen.Sub(last)
				endGangs(b, ns)
			}
			b.ReportMetric(float64(total.Milliseconds())/float64(b.N), "last-create-to-all-bound-ms")
			b.ReportMetric(0, "ns/op")
		})
	}
}

// BenchmarkGangAdmissions20Small: 20 gangs of 2 pods with one H100 each,
// all created at once, on each gang path; admissions per minute from the
// first create to the last gang's pods all bound.
func BenchmarkGangAdmissions20Small(b *testing.B) {
	addBenchNodes(b)
	const gangs = 20
	for _, mode := range gangPaths {
		b.Run(mode, func(b *testing.B) {
			onGangPath(b, mode)
			warmGangPath(b)
			b.ResetTimer()
			var total time.Duration
			for range b.N {
				ns := benchGangNamespace(b, 1)
				pods := watchPods(b, ns)
				start := time.Now()
				createGangs(b, ns, gangs, 2, "gpus")
				seen := pods.waitBound(b, 2*gangs, 5*time.Minute)
				pods.stop()
				total += seen.Sub(start)
				endGangs(b, ns)
			}
			b.ReportMetric(float64(gangs*b.N)/total.Minutes(), "gangs/min")
			b.ReportMetric(0, "ns/op")
		})
	}
}

// waitBound waits until n pods were seen bound to a node (or Running) and
// returns when the last of them was first seen so.
func (w *podWatch) waitBound(b *testing.B, n int, timeout time.Duration) time.Time {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		w.mu.Lock()
		var last time.Time
		count := 0
		for _, t := range w.at {
			at := t.bound
			if at.IsZero() {
				at = t.running
			}
			if at.IsZero() {
				continue
			}
			count++
			if at.After(last) {
				last = at
			}
		}
		w.mu.Unlock()
		if count >= n {
			return last
		}
		time.Sleep(5 * time.Millisecond)
	}
	b.Fatalf("fewer than %d pods bound after %s", n, timeout)
	return time.Time{}
}
