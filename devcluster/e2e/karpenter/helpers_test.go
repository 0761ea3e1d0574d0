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
