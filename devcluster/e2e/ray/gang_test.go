package ray_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/rayoperator"
	"github.com/gpudra/gpudra/pkg/controller/gang"
)

const gangLabel = "gpudra.dev/gang"

// rayJob is examples/ray/rayjob-gang.yaml with the RayJob and its gang
// named name, in InteractiveMode: KubeRay makes the cluster, sees it
// ready, and then waits for a job to be submitted to Ray's dashboard,
// which the probe does not serve. (In K8sJobMode KubeRay would create the
// submitter Job, whose `ray job submit` needs that dashboard, and ask the
// absent dashboard for the job's state.)
func rayJob(t *testing.T, name string) []*unstructured.Unstructured {
	t.Helper()
	objs, err := devcluster.Manifests(filepath.Join(examples, "ray", "rayjob-gang.yaml"))
	require.NoError(t, err)
	for _, o := range objs {
		if o.GetKind() != "RayJob" {
			continue
		}
		o.SetName(name)
		require.NoError(t, unstructured.SetNestedField(o.Object, "InteractiveMode", "spec", "submissionMode"))
		require.NoError(t, unstructured.SetNestedField(o.Object, name, "spec", "rayClusterSpec", "headGroupSpec", "template", "metadata", "labels", gangLabel))
		groups, _, err := unstructured.NestedSlice(o.Object, "spec", "rayClusterSpec", "workerGroupSpecs")
		require.NoError(t, err)
		for _, g := range groups {
			require.NoError(t, unstructured.SetNestedField(g.(map[string]any), name, "template", "metadata", "labels", gangLabel))
		}
		require.NoError(t, unstructured.SetNestedSlice(o.Object, groups, "spec", "rayClusterSpec", "workerGroupSpecs"))
	}
	return objs
}

// rayJobCluster waits for the RayJob's RayCluster and returns its name.
func rayJobCluster(t *testing.T, ns, job string) string {
	t.Helper()
	var name string
	err := wait.PollUntilContextTimeout(context.Background(), 250*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		rj, err := dyn(t).Resource(rayoperator.RayJobs).Namespace(ns).Get(ctx, job, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		name, _, _ = unstructured.NestedString(rj.Object, "status", "rayClusterName")
		return name != "", nil
	})
	require.NoError(t, err, "RayJob %s/%s has no RayCluster", ns, job)
	return name
}

func gangCondition(pod v1.Pod) *v1.PodCondition {
	for i, c := range pod.Status.Conditions {
		if c.Type == gang.PodConditionGang {
			return &pod.Status.Conditions[i]
		}
	}
	return nil
}

// TestRayJobGang: a RayJob's head and workers are one gpudra gang. The
// first job's three pods are admitted together, each worker on eight GPUs
// of one NVLink domain, and KubeRay sees its cluster ready. A second such
// job, whose 16 GPUs do not fit beside the first's, waits whole: its head,
// which needs no GPU, is not scheduled either, and none of its claims is
// allocated. When the first job goes, the second's gang is admitted.
// Not shown: Ray running the job (no Ray process runs in devcluster).
func TestRayJobGang(t *testing.T) {
	ns := namespace(t)
	ctx := context.Background()
	jobs := dyn(t).Resource(rayoperator.RayJobs).Namespace(ns)
	require.NoError(t, cluster.Apply(ctx, ns, rayJob(t, "ray-train")))
	first := rayJobCluster(t, ns, "ray-train")
	head := waitClusterGroup(t, ns, first, "headgroup", 1)
	workers := waitClusterGroup(t, ns, first, trainGroup, 2)
	for _, pod := range append(head, workers...) {
		c := gangCondition(pod)
		require.NotNil(t, c, "%s: admitted by gpudra's gang controller", pod.Name)
		assert.Equal(t, v1.ConditionTrue, c.Status, "%s: %s %s", pod.Name, c.Reason, c.Message)
		assert.Equal(t, "ray-train", pod.Labels[gangLabel], "KubeRay copies the gang label onto %s", pod.Name)
	}
	assert.NotEqual(t, workers[0].Spec.NodeName, workers[1].Spec.NodeName, "one 8-GPU worker per DGX")
	for _, pod := range workers {
		assertEightGPUWorker(t, pod)
	}
	err := wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		rj, err := jobs.Get(ctx, "ray-train", metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		s, _, _ := unstructured.NestedString(rj.Object, "status", "jobDeploymentStatus")
		return s == "Waiting", nil
	})
	require.NoError(t, err, "KubeRay sees the RayJob's cluster ready and waits for its job")

	// The second gang does not fit beside the first: both DGX with MIG off
	// are the first's, and its claims ask for GPUs with MIG off.
	require.NoError(t, cluster.Apply(ctx, ns, rayJob(t, "ray-train-2")))
	second := rayJobCluster(t, ns, "ray-train-2")
	var waiting []v1.Pod
	err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, 60*time.Second, true, func(context.Context) (bool, error) {
		waiting = append(groupPods(t, ns, second, "headgroup"), groupPods(t, ns, second, trainGroup)...)
		if len(waiting) != 3 {
			return false, nil
		}
		for _, p := range waiting {
			if c := gangCondition(p); c == nil || c.Status != v1.ConditionFalse {
				return false, nil
			}
		}
		return true, nil
	})
	require.NoError(t, err, "the second gang's three pods, each told why they wait: %v", waiting)
	// A moment more, for anything let through alone to be scheduled.
	time.Sleep(2 * time.Second)
	for _, p := range append(groupPods(t, ns, second, "headgroup"), groupPods(t, ns, second, trainGroup)...) {
		assert.Empty(t, p.Spec.NodeName, "%s is not scheduled outside its gang", p.Name)
		c := gangCondition(p)
		require.NotNil(t, c, p.Name)
		assert.Equal(t, v1.ConditionFalse, c.Status, p.Name)
		t.Logf("%s waits: %s: %s", p.Name, c.Reason, c.Message)
		for _, s := range p.Status.ResourceClaimStatuses {
			if s.ResourceClaimName == nil {
				continue
			}
			claim, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, *s.ResourceClaimName, metav1.GetOptions{})
			if err == nil {
				assert.Nil(t, claim.Status.Allocation, "%s: claim %s holds no GPU while its gang waits", p.Name, claim.Name)
			}
		}
	}

	// The first job goes (its cluster, pods and claims with it); the second
	// gang is admitted whole.
	require.NoError(t, jobs.Delete(ctx, "ray-train", metav1.DeleteOptions{}))
	head = waitClusterGroup(t, ns, second, "headgroup", 1)
	workers = waitClusterGroup(t, ns, second, trainGroup, 2)
	for _, pod := range append(head, workers...) {
		c := gangCondition(pod)
		require.NotNil(t, c, pod.Name)
		assert.Equal(t, v1.ConditionTrue, c.Status, "%s: %s %s", pod.Name, c.Reason, c.Message)
	}
	for _, pod := range workers {
		assertEightGPUWorker(t, pod)
	}

	seen := claimUIDsByNode(t, ns)
	require.NoError(t, jobs.Delete(ctx, "ray-train-2", metav1.DeleteOptions{}))
	err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		pods, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil || len(pods.Items) > 0 {
			return false, nil
		}
		claims, err := cluster.Client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
		return err == nil && len(claims.Items) == 0, nil
	})
	require.NoError(t, err, "the RayJobs' pods and claims outlived them")
	for node, uids := range seen {
		waitUnprepared(t, node, uids...)
	}
}
