package ray_test

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"

	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/devcluster/noderuntime"
	"github.com/gpudra/gpudra/devcluster/rayoperator"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// KubeRay's labels on the pods it makes.
const (
	clusterLabel = "ray.io/cluster"
	groupLabel   = "ray.io/group"
)

// The example's RayCluster and worker groups (examples/ray/raycluster.yaml).
const (
	rayClusterName = "ray-gpus"
	trainGroup     = "train-8gpu"
	migGroup       = "small-mig"
	serveGroup     = "serve-share"
	workerName     = "ray-worker"
)

// namespace is a fresh namespace for the test. No namespace controller
// runs: at the end the test's RayCluster goes, and with it (the garbage
// collector, then the claim controller) its pods and their claims.
func namespace(t *testing.T) string {
	t.Helper()
	name := "ray-" + strings.ToLower(strings.NewReplacer("/", "-", "_", "-").Replace(strings.TrimPrefix(t.Name(), "TestRay")))
	if len(name) > 60 {
		name = name[:60]
	}
	name = strings.TrimRight(name, "-")
	_, err := cluster.Client.CoreV1().Namespaces().Create(context.Background(), &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	require.NoError(t, err)
	return name
}

// applyExample creates examples/ray/raycluster.yaml in ns and, at the test's end, deletes
// the RayCluster and waits until its pods and their claims are gone and
// no claim of it is left prepared on any node.
func applyExample(t *testing.T, ns string) {
	t.Helper()
	_, err := cluster.ApplyFiles(context.Background(), ns, filepath.Join(examples, "ray", "raycluster.yaml"))
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx := context.Background()
		seen := claimUIDsByNode(t, ns)
		require.NoError(t, rayClusters(t, ns).Delete(ctx, rayClusterName, metav1.DeleteOptions{}))
		err := wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
			pods, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
			if err != nil || len(pods.Items) > 0 {
				return false, nil
			}
			claims, err := cluster.Client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
			return err == nil && len(claims.Items) == 0, nil
		})
		require.NoError(t, err, "the RayCluster's pods and claims outlived it")
		for node, uids := range seen {
			waitUnprepared(t, node, uids...)
		}
	})
}

func dyn(t *testing.T) dynamic.Interface {
	t.Helper()
	d, err := dynamic.NewForConfig(cluster.RESTConfig)
	require.NoError(t, err)
	return d
}

func rayClusters(t *testing.T, ns string) dynamic.ResourceInterface {
	return dyn(t).Resource(rayoperator.RayClusters).Namespace(ns)
}

// groupPods are the live (not terminating) pods of one of the RayCluster
// rc's groups ("headgroup" for the head), by name.
func groupPods(t *testing.T, ns, rc, group string) []v1.Pod {
	t.Helper()
	pods, err := cluster.Client.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{
		LabelSelector: clusterLabel + "=" + rc + "," + groupLabel + "=" + group})
	require.NoError(t, err)
	var out []v1.Pod
	for _, p := range pods.Items {
		if p.DeletionTimestamp == nil {
			out = append(out, p)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// waitGroup waits until the example RayCluster's group has exactly n pods,
// all running.
func waitGroup(t *testing.T, ns, group string, n int) []v1.Pod {
	t.Helper()
	return waitClusterGroup(t, ns, rayClusterName, group, n)
}

// waitClusterGroup waits until the group of RayCluster rc has exactly n
// pods, all running.
func waitClusterGroup(t *testing.T, ns, rc, group string, n int) []v1.Pod {
	t.Helper()
	var pods []v1.Pod
	err := wait.PollUntilContextTimeout(context.Background(), 250*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		pods = groupPods(t, ns, rc, group)
		if len(pods) != n {
			return false, nil
		}
		for _, p := range pods {
			if p.Status.Phase != v1.PodRunning {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		var states []string
		for _, p := range pods {
			states = append(states, p.Name+": "+describe(p))
		}
		t.Fatalf("group %s of %s/%s: want %d running pods, have %d: %s\nKubeRay's log:\n%s", group, ns, rc, n, len(pods),
			strings.Join(states, "\n"), operator.LogTail(4000))
	}
	return pods
}

func describe(pod v1.Pod) string {
	var b strings.Builder
	fmt.Fprintf(&b, "phase %s, node %q", pod.Status.Phase, pod.Spec.NodeName)
	for _, c := range pod.Status.Conditions {
		fmt.Fprintf(&b, "; %s=%s %s %s", c.Type, c.Status, c.Reason, c.Message)
	}
	return b.String()
}

// claimOf is the allocated ResourceClaim behind the pod's claim podClaim:
// one made for this pod from its template, reserved for it.
func claimOf(t *testing.T, pod v1.Pod, podClaim string) *resourceapi.ResourceClaim {
	t.Helper()
	var name string
	for _, s := range pod.Status.ResourceClaimStatuses {
		if s.Name == podClaim && s.ResourceClaimName != nil {
			name = *s.ResourceClaimName
		}
	}
	require.NotEmpty(t, name, "pod %s: claim %s not made from its template", pod.Name, podClaim)
	claim, err := cluster.Client.ResourceV1().ResourceClaims(pod.Namespace).Get(context.Background(), name, metav1.GetOptions{})
	require.NoError(t, err)
	require.NotNil(t, claim.Status.Allocation, "claim %s of pod %s is not allocated", name, pod.Name)
	owned := false
	for _, o := range claim.OwnerReferences {
		owned = owned || o.UID == pod.UID
	}
	require.True(t, owned, "claim %s is pod %s's own", name, pod.Name)
	reserved := false
	for _, r := range claim.Status.ReservedFor {
		reserved = reserved || r.UID == pod.UID
	}
	require.True(t, reserved, "claim %s is reserved for pod %s", name, pod.Name)
	return claim
}

// device is a published device of gpudra's by pool and name, and the node
// of its slice.
func device(t *testing.T, pool, name string) (resourceapi.Device, string) {
	t.Helper()
	slices, err := cluster.Client.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	for _, s := range slices.Items {
		if s.Spec.Pool.Name != pool || s.Spec.Driver != slicebuilder.DriverName {
			continue
		}
		for _, d := range s.Spec.Devices {
			if d.Name == name {
				node := ""
				if s.Spec.NodeName != nil {
					node = *s.Spec.NodeName
				}
				return d, node
			}
		}
	}
	t.Fatalf("device %s/%s is not published", pool, name)
	return resourceapi.Device{}, ""
}

func attr(d resourceapi.Device, name string) string {
	a, ok := d.Attributes[resourceapi.QualifiedName(slicebuilder.DriverName+"/"+name)]
	if !ok {
		a = d.Attributes[resourceapi.QualifiedName(name)] // the driver's own domain, unqualified
	}
	switch {
	case a.StringValue != nil:
		return *a.StringValue
	case a.VersionValue != nil:
		return *a.VersionValue
	case a.IntValue != nil:
		return fmt.Sprint(*a.IntValue)
	case a.BoolValue != nil:
		return fmt.Sprint(*a.BoolValue)
	}
	return ""
}

// visibleGPUs are the GPU and MIG UUIDs the devcluster kubelet gave the
// pod's container, from its device nodes.
func visibleGPUs(t *testing.T, pod v1.Pod, container string) []string {
	t.Helper()
	var views map[string]noderuntime.ContainerView
	require.NoError(t, json.Unmarshal([]byte(pod.Annotations[nodeagent.ContainersAnnotation]), &views), "pod %s", pod.Name)
	view, ok := views[container]
	require.True(t, ok, "pod %s has no view of container %s", pod.Name, container)
	return view.VisibleGPUs()
}

// claimUIDsByNode are the UIDs of the namespace's allocated claims, by the
// node of their devices.
func claimUIDsByNode(t *testing.T, ns string) map[string][]types.UID {
	t.Helper()
	claims, err := cluster.Client.ResourceV1().ResourceClaims(ns).List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	out := map[string][]types.UID{}
	for _, c := range claims.Items {
		if c.Status.Allocation != nil && len(c.Status.Allocation.Devices.Results) > 0 {
			node := c.Status.Allocation.Devices.Results[0].Pool // one pool per node, named after it
			out[node] = append(out[node], c.UID)
		}
	}
	return out
}

// hasSpecFor says whether the node's plugin has a CDI spec for the claim:
// the claim is prepared there.
func hasSpecFor(t *testing.T, node string, uid types.UID) bool {
	t.Helper()
	n := cluster.Node(node)
	require.NotNil(t, n, "node %s", node)
	files, err := filepath.Glob(filepath.Join(n.CDIDir(), "*"))
	require.NoError(t, err)
	for _, f := range files {
		if strings.Contains(filepath.Base(f), string(uid)) {
			return true
		}
	}
	return false
}

// waitUnprepared waits until the node's plugin holds no CDI spec for any
// of the claims: they were unprepared.
func waitUnprepared(t *testing.T, node string, uids ...types.UID) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 250*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		for _, uid := range uids {
			if hasSpecFor(t, node, uid) {
				return false, nil
			}
		}
		return true, nil
	})
	require.NoError(t, err, "claims %v still prepared on %s", uids, node)
}

// waitClaimGone waits until the claim is deleted.
func waitClaimGone(t *testing.T, claim *resourceapi.ResourceClaim) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 250*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := cluster.Client.ResourceV1().ResourceClaims(claim.Namespace).Get(ctx, claim.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	})
	require.NoError(t, err, "claim %s/%s outlived its worker", claim.Namespace, claim.Name)
}

// rayClusterStatus is the RayCluster's status.state and readyWorkerReplicas.
func rayClusterStatus(t *testing.T, ns string) (string, int64) {
	t.Helper()
	rc, err := rayClusters(t, ns).Get(context.Background(), rayClusterName, metav1.GetOptions{})
	require.NoError(t, err)
	state, _, _ := unstructured.NestedString(rc.Object, "status", "state")
	ready, _, _ := unstructured.NestedInt64(rc.Object, "status", "readyWorkerReplicas")
	return state, ready
}
