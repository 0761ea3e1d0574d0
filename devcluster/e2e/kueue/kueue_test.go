package kueue_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	batchv1 "k8s.io/api/batch/v1"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/utils/ptr"

	"github.com/gpudra/gpudra/pkg/dashboard"
	"github.com/gpudra/gpudra/pkg/kueue"
)

// TestTwoTeamsUnderKueueQuota: two teams' ClusterQueues of 4 GPUs each in
// one cohort (examples/kueue), on one 8-GPU node. Team A runs 4 GPUs (its
// quota) and team B 2; team A's next job, a gang of 2 pods of 2 GPUs, must
// borrow 4 of team B's quota and only 2 are unused: Kueue keeps it
// suspended, with its reason. When team B's job ends, Kueue admits it on
// borrowed quota, and gpudra places its gang whole.
func TestTwoTeamsUnderKueueQuota(t *testing.T) {
	ctx := context.Background()
	alice := newResearcher(t, "alice", "team-a")
	bob := newResearcher(t, "bob", "team-b")

	alice.submit(t, "a1", 4, 4)
	bob.submit(t, "b1", 2, 2)
	t.Cleanup(func() { alice.cancel(t, "a1", "a2") })
	a1 := runningPods(t, "team-a", "a1", 1, 2*time.Minute)
	assert.Equal(t, 4, gpusOf(t, &a1[0]))
	b1 := runningPods(t, "team-b", "b1", 1, 2*time.Minute)
	assert.Equal(t, 2, gpusOf(t, &b1[0]))

	alice.submit(t, "a2", 4, 2)
	var status, reason, message string
	err := wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		status, reason, message = condition(workload(t, "team-a", "a2"), "QuotaReserved")
		return status == "False" && message != "", nil
	})
	require.NoError(t, err, "a2 waits for quota: QuotaReserved %s %s %q", status, reason, message)
	assert.Contains(t, message, "insufficient", "Kueue's reason")
	job, err := cluster.Client.BatchV1().Jobs("team-a").Get(ctx, "a2", metav1.GetOptions{})
	require.NoError(t, err)
	assert.True(t, ptr.Deref(job.Spec.Suspend, false), "Kueue holds the job suspended: no pod of it exists")
	pods, err := cluster.Client.CoreV1().Pods("team-a").List(ctx, metav1.ListOptions{LabelSelector: batchv1.JobNameLabel + "=a2"})
	require.NoError(t, err)
	assert.Empty(t, pods.Items)
	out, err := alice.gpudra(t, "jobs")
	require.NoError(t, err, out)
	assert.Regexp(t, `a2\s+Job\s+Waiting\s+0/2\s+kueue/gpus\s+-\s+KueuePending: couldn't assign flavors`, out, "gpudra jobs says Kueue holds it, and why")
	w := alice.dashboardKueue(t, "a2", dashboard.KueuePending)
	assert.Equal(t, "team-a", w.Kueue.ClusterQueue)
	assert.Contains(t, w.Kueue.Message, "insufficient unused quota for gpudra.dev/gpu", "the dashboard shows Kueue's reason")

	out, err = bob.gpudra(t, "cancel", "b1")
	require.NoError(t, err, out)
	a2 := runningPods(t, "team-a", "a2", 2, 2*time.Minute)
	for i := range a2 {
		assert.Equal(t, 2, gpusOf(t, &a2[i]), "pod %s: exactly its 2 GPUs", a2[i].Name)
	}
	status, _, _ = condition(workload(t, "team-a", "a2"), "Admitted")
	assert.Equal(t, "True", status)
}

// TestRayJobAdmittedByKueue: a RayJob from gpudra submit --ray
// --kueue-queue is Kueue's to admit (its ray.io/rayjob integration): Kueue
// suspends it at creation and admits it against team B's quota; KubeRay
// then makes its cluster, whose head and worker gpudra places as one
// gang, the worker on exactly its 2 GPUs.
func TestRayJobAdmittedByKueue(t *testing.T) {
	ctx := context.Background()
	carol := newResearcher(t, "carol", "team-b")
	out, err := carol.gpudra(t, "submit", "--ray", "--name", "ray-train", "--gpus", "2", "--kueue-queue", "gpus",
		"--image", image, "--", "python", "train.py")
	require.NoError(t, err, out)
	t.Cleanup(func() { carol.cancel(t, "ray-train") })

	w := rayWorkload(t, "team-b", "ray-train")
	err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		w = rayWorkload(t, "team-b", "ray-train")
		status, _, _ := condition(w, "Admitted")
		return status == "True", nil
	})
	require.NoError(t, err, "Kueue admits the RayJob: %v", w.Object["status"])
	var worker v1.Pod
	err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		pods, err := cluster.Client.CoreV1().Pods("team-b").List(ctx, metav1.ListOptions{LabelSelector: "ray.io/node-type in (head,worker)"})
		if err != nil || len(pods.Items) != 2 {
			return false, nil
		}
		for _, p := range pods.Items {
			if p.Status.Phase != v1.PodRunning {
				return false, nil
			}
			if p.Labels["ray.io/node-type"] == "worker" {
				worker = p
			}
		}
		return worker.Name != "", nil
	})
	require.NoError(t, err, "the RayJob's head and worker run")
	assert.Equal(t, 2, gpusOf(t, &worker), "the worker holds exactly its 2 GPUs")
	assert.Equal(t, "gpus", worker.Labels["kueue.x-k8s.io/queue-name"], "its gang is Kueue's: in no GpuQueue")
}

// TestAdmittedGangThatCannotBePlacedGivesQuotaBack is docs/queues.md's
// fourth rule: Kueue waits on quota, gpudra on devices, and neither holds
// what the other waits for. A job outside Kueue (in gpudra's own queue)
// holds 6 of the node's 8 GPUs; Kueue admits team A's 4-GPU job within
// its quota, but its gang cannot be placed: gpudra holds no device for it
// and says it is Kueue's, in no GpuQueue. After waitForPodsReady's timeout
// Kueue evicts it and takes its quota back.
func TestAdmittedGangThatCannotBePlacedGivesQuotaBack(t *testing.T) {
	ctx := context.Background()
	_, err := cluster.Client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "lab"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	dave := newResearcher(t, "dave", "lab")
	alice := newResearcher(t, "alice-2", "team-a")
	out, err := dave.gpudra(t, "submit", "--name", "hold", "--gpus", "6", "--image", image, "--", "python", "serve.py")
	require.NoError(t, err, out)
	t.Cleanup(func() { dave.cancel(t, "hold") })
	runningPods(t, "lab", "hold", 1, 2*time.Minute)
	// docs/queues.md, rule 5: without Kueue's label a job is gpudra's
	// alone: Kueue made no Workload of it, and it is in a GpuQueue.
	out, err = dave.gpudra(t, "jobs")
	require.NoError(t, err, out)
	assert.Regexp(t, `hold\s+Job\s+Running\s+1/1\s+default\s`, out)
	dyn, err := dynamic.NewForConfig(cluster.RESTConfig)
	require.NoError(t, err)
	ws, err := dyn.Resource(kueue.Workloads).Namespace("lab").List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	assert.Empty(t, ws.Items, "Kueue leaves a job without its label alone")

	alice.submit(t, "big", 4, 4)
	t.Cleanup(func() { alice.cancel(t, "big") })
	var pod v1.Pod
	err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		pods, err := cluster.Client.CoreV1().Pods("team-a").List(ctx, metav1.ListOptions{LabelSelector: batchv1.JobNameLabel + "=big"})
		if err != nil || len(pods.Items) != 1 {
			return false, nil
		}
		pod = pods.Items[0]
		for _, c := range pod.Status.Conditions {
			if c.Type == "gpudra.dev/GangAllocated" && c.Reason == "WaitingForDevices" {
				return true, nil
			}
		}
		return false, nil
	})
	require.NoError(t, err, "Kueue admitted big, and its gang waits for devices: %s", describePods([]v1.Pod{pod}))
	assert.Contains(t, gangMessage(&pod), "admitted by Kueue (LocalQueue gpus), in no GpuQueue")
	status, _, _ := condition(workload(t, "team-a", "big"), "Admitted")
	assert.Equal(t, "True", status)
	for _, s := range pod.Status.ResourceClaimStatuses {
		if s.ResourceClaimName == nil {
			continue
		}
		cl, err := cluster.Client.ResourceV1().ResourceClaims("team-a").Get(ctx, *s.ResourceClaimName, metav1.GetOptions{})
		require.NoError(t, err)
		assert.Nil(t, cl.Status.Allocation, "gpudra holds no device for a gang it cannot place whole")
	}

	var reason, message string
	err = wait.PollUntilContextTimeout(ctx, time.Second, podsReadyTimeout+time.Minute, true, func(ctx context.Context) (bool, error) {
		w := workload(t, "team-a", "big")
		status, reason, message = condition(w, "Evicted")
		reserved, _, _ := condition(w, "QuotaReserved")
		return status == "True" && reserved != "True", nil
	})
	require.NoError(t, err, "Kueue evicts big after waitForPodsReady's timeout and takes its quota back: Evicted %s %q", reason, message)
	assert.Equal(t, "PodsReadyTimeout", reason)
}
