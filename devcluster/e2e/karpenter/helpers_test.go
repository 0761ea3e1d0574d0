package karpenter_test

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/utils/ptr"

	"github.com/gpudra/gpudra/devcluster/autoscaler"
)

// namespace is a fresh namespace for the test, deleted after it.
func namespace(t *testing.T) string {
	t.Helper()
	name := "k-" + strings.ToLower(strings.NewReplacer("/", "-", "_", "-").Replace(t.Name()))
	if len(name) > 60 {
		name = name[:60]
	}
	name = strings.TrimRight(name, "-")
	_, err := cluster.Client.CoreV1().Namespaces().Create(context.Background(), &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = cluster.Client.CoreV1().Pods(name).DeleteCollection(context.Background(), metav1.DeleteOptions{GracePeriodSeconds: new(int64)}, metav1.ListOptions{})
	})
	return name
}

func apply(t *testing.T, ns string, paths ...string) {
	t.Helper()
	_, err := cluster.ApplyFiles(context.Background(), ns, paths...)
	require.NoError(t, err)
}

func example(name string) string { return filepath.Join(examples, name) }

// waitRunning waits for the pod to run, saying where it waits if not.
func waitRunning(t *testing.T, ns, name string, timeout time.Duration) *v1.Pod {
	t.Helper()
	var pod *v1.Pod
	err := wait.PollUntilContextTimeout(context.Background(), 250*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		p, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		pod = p
		return p.Status.Phase == v1.PodRunning, nil
	})
	if err != nil {
		claims, _ := cluster.Client.ResourceV1().ResourceClaims(ns).List(context.Background(), metav1.ListOptions{})
		var specs []string
		for _, c := range claims.Items {
			b, _ := json.Marshal(c.Spec)
			specs = append(specs, c.Name+": "+string(b))
		}
		t.Fatalf("pod %s/%s not running: %s\nIts claims: %s\nNodeClaims: %s\nKarpenter's log:\n%s", ns, name, describe(pod),
			strings.Join(specs, "; "), nodeClaimsSummary(t), karpenter.LogTail(6000))
	}
	return pod
}

func describe(pod *v1.Pod) string {
	if pod == nil {
		return "no pod"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "phase %s, node %q", pod.Status.Phase, pod.Spec.NodeName)
	for _, c := range pod.Status.Conditions {
		fmt.Fprintf(&b, "; %s=%s %s %s", c.Type, c.Status, c.Reason, c.Message)
	}
	return b.String()
}

func dyn(t *testing.T) dynamic.Interface {
	t.Helper()
	d, err := dynamic.NewForConfig(cluster.RESTConfig)
	require.NoError(t, err)
	return d
}

// nodeClaims are Karpenter's NodeClaims now.
func nodeClaims(t *testing.T) []unstructured.Unstructured {
	t.Helper()
	list, err := dyn(t).Resource(autoscaler.NodeClaims).List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	return list.Items
}

func nodeClaimsSummary(t *testing.T) string {
	var out []string
	for _, nc := range nodeClaims(t) {
		node, _, _ := unstructured.NestedString(nc.Object, "status", "nodeName")
		out = append(out, fmt.Sprintf("%s (pool %s, type %s, node %q)", nc.GetName(), nc.GetLabels()["karpenter.sh/nodepool"],
			nc.GetLabels()[v1.LabelInstanceTypeStable], node))
	}
	return strings.Join(out, ", ")
}

// nodeClaimOf is the NodeClaim whose node is node.
func nodeClaimOf(t *testing.T, node string) *unstructured.Unstructured {
	t.Helper()
	for _, nc := range nodeClaims(t) {
		if n, _, _ := unstructured.NestedString(nc.Object, "status", "nodeName"); n == node {
			return &nc
		}
	}
	t.Fatalf("no NodeClaim has node %s: %s", node, nodeClaimsSummary(t))
	return nil
}

// deleteNodeClaim deletes a NodeClaim and waits until Karpenter has
// terminated its machine and removed its Node.
func deleteNodeClaim(t *testing.T, name, node string) {
	t.Helper()
	ctx := context.Background()
	err := dyn(t).Resource(autoscaler.NodeClaims).Delete(ctx, name, metav1.DeleteOptions{})
	if !apierrors.IsNotFound(err) {
		require.NoError(t, err)
	}
	waitNodeGone(t, node, 2*time.Minute)
}

// waitNodeGone waits until the Node object and the cloud's machine are
// gone.
func waitNodeGone(t *testing.T, node string, timeout time.Duration) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 250*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		_, err := cluster.Client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if !apierrors.IsNotFound(err) {
			return false, nil
		}
		for _, m := range karpenter.Cloud.Machines() {
			if m.Name == node {
				return false, nil
			}
		}
		return cluster.Node(node) == nil, nil
	})
	require.NoError(t, err, "node %s still there; NodeClaims: %s\nKarpenter's log:\n%s", node, nodeClaimsSummary(t), karpenter.LogTail(4000))
}

// boughtTypes records the instance type of every NodeClaim Karpenter makes
// from now until the test ends (its return value reads them), however
// short-lived.
func boughtTypes(t *testing.T) func() map[string]string {
	t.Helper()
	var mu sync.Mutex
	seen := map[string]string{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
			list, err := dyn(t).Resource(autoscaler.NodeClaims).List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, nil
			}
			mu.Lock()
			for _, nc := range list.Items {
				if typ := nc.GetLabels()[v1.LabelInstanceTypeStable]; typ != "" {
					seen[nc.GetName()] = typ
				}
			}
			mu.Unlock()
			return false, nil
		})
	}()
	t.Cleanup(func() { cancel(); <-done })
	return func() map[string]string {
		mu.Lock()
		defer mu.Unlock()
		return maps.Clone(seen)
	}
}

// cleanUp deletes the namespace's pods, then every NodeClaim made since
// before, and waits for their nodes to go.
func cleanUp(t *testing.T, ns string, before map[string]bool) {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, cluster.Client.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}, metav1.ListOptions{}))
	for _, nc := range nodeClaims(t) {
		if before[nc.GetName()] {
			continue
		}
		node, _, _ := unstructured.NestedString(nc.Object, "status", "nodeName")
		if node == "" {
			node = nc.GetName()
		}
		deleteNodeClaim(t, nc.GetName(), node)
	}
}

// nodeClaimNames are the NodeClaims now, by name.
func nodeClaimNames(t *testing.T) map[string]bool {
	out := map[string]bool{}
	for _, nc := range nodeClaims(t) {
		out[nc.GetName()] = true
	}
	return out
}

// timeline is when each step of a scale-up was first seen, polling the API
// every 50 ms: the pods' creation, the first new NodeClaim, its Node, the
// node's first ResourceSlice, the pods bound, the pods running.
type timeline struct {
	mu                                     sync.Mutex
	start, nodeClaim, node, slice, running time.Time
	bound                                  time.Time
	// nodes and slices are first-seen times per new node.
	nodes, slices map[string]time.Time
}

// watchScaleUp starts watching; call it just before creating the pods.
func watchScaleUp(t *testing.T, ns string, pods []string) *timeline {
	t.Helper()
	before := nodeClaimNames(t)
	tl := &timeline{start: time.Now(), nodes: map[string]time.Time{}, slices: map[string]time.Time{}}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = wait.PollUntilContextCancel(ctx, 50*time.Millisecond, true, func(ctx context.Context) (bool, error) {
			now := time.Now()
			tl.mu.Lock()
			defer tl.mu.Unlock()
			if tl.nodeClaim.IsZero() {
				if list, err := dyn(t).Resource(autoscaler.NodeClaims).List(ctx, metav1.ListOptions{}); err == nil {
					for _, nc := range list.Items {
						if !before[nc.GetName()] {
							tl.nodeClaim = now
						}
					}
				}
			}
			if nodes, err := cluster.Client.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err == nil {
				for _, n := range nodes.Items {
					if _, seen := tl.nodes[n.Name]; !seen && !tl.nodeClaim.IsZero() && n.CreationTimestamp.After(tl.start.Add(-time.Second)) {
						tl.nodes[n.Name] = now
					}
				}
			}
			if slices, err := cluster.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{}); err == nil {
				for _, s := range slices.Items {
					if n := ptr.Deref(s.Spec.NodeName, ""); n != "" {
						if _, ours := tl.nodes[n]; ours {
							if _, seen := tl.slices[n]; !seen {
								tl.slices[n] = now
							}
						}
					}
				}
			}
			bound, running := 0, 0
			for _, name := range pods {
				p, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
				if err != nil {
					continue
				}
				if p.Spec.NodeName != "" {
					bound++
				}
				if p.Status.Phase == v1.PodRunning {
					running++
				}
			}
			if bound == len(pods) && tl.bound.IsZero() {
				tl.bound = now
			}
			if running == len(pods) && tl.running.IsZero() {
				tl.running = now
				return true, nil
			}
			return false, nil
		})
	}()
	t.Cleanup(func() { cancel(); <-done })
	return tl
}

// split is the scale-up's steps, each from the end of the one before:
// Karpenter's decision (pods created to NodeClaim), the machines' start
// (to the last new Node), the plugin's first slice (to the last new node's
// first ResourceSlice), Karpenter's initialization and the scheduler (to
// all pods bound), the pods' prepare and start (to all running).
func (tl *timeline) split(t *testing.T) string {
	t.Helper()
	tl.mu.Lock()
	defer tl.mu.Unlock()
	require.False(t, tl.running.IsZero(), "the pods ran")
	last := func(m map[string]time.Time) time.Time {
		var out time.Time
		for _, v := range m {
			if v.After(out) {
				out = v
			}
		}
		return out
	}
	tl.node, tl.slice = last(tl.nodes), last(tl.slices)
	steps := []struct {
		name     string
		from, to time.Time
	}{
		{"Karpenter's decision", tl.start, tl.nodeClaim},
		{"machine start (Node object)", tl.nodeClaim, tl.node},
		{"plugin's first slice", tl.node, tl.slice},
		{"initialization and binding", tl.slice, tl.bound},
		{"prepare and start", tl.bound, tl.running},
	}
	var b strings.Builder
	fmt.Fprintf(&b, "pending to running %v, %d machine(s):", tl.running.Sub(tl.start).Round(10*time.Millisecond), len(tl.nodes))
	for _, s := range steps {
		fmt.Fprintf(&b, " %s %v;", s.name, s.to.Sub(s.from).Round(10*time.Millisecond))
	}
	return b.String()
}

// waitTimeline waits until the timeline saw the pods run.
func waitTimeline(t *testing.T, tl *timeline) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		tl.mu.Lock()
		defer tl.mu.Unlock()
		return !tl.running.IsZero(), nil
	})
	require.NoError(t, err)
}
