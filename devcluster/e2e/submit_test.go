package e2e

import (
	"context"
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	batchv1 "k8s.io/api/batch/v1"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/wait"
	restclient "k8s.io/client-go/rest"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/devcluster/e2e/tenant"
)

// TestSubmitAsEditUser: a researcher who holds only the default `edit`
// role in one namespace submits jobs with `gpudra submit`, with their own
// credentials. A 16-GPU job holds both DGX nodes' GPUs, so a 2-GPU job
// waits and `gpudra jobs` says why (gpudra's gang condition); cancelling
// the first frees the GPUs, and the 2-GPU job runs on exactly 2 GPUs, then
// completes (its container, the probe, exits 0 after a few seconds): the
// pod Succeeded, the Job Complete, its claims released and unprepared on
// the node. A researcher of another namespace sees none of it and cannot
// cancel it; `gpudra cancel` removes the Job, its pods and claims.
func TestSubmitAsEditUser(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t)
	other := namespace(t)
	editTenant(t, ns, "researcher-a")
	editTenant(t, other, "researcher-b")
	gpudra := func(user, userNS string, args ...string) (string, error) {
		cfg := restclient.CopyConfig(cluster.RESTConfig)
		cfg.Impersonate = restclient.ImpersonationConfig{UserName: user, Groups: []string{"system:authenticated"}}
		return tenant.Gpudra(ctx, cfg, userNS, args...)
	}
	jobPods := func(ctx context.Context, job string) []v1.Pod {
		pods, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "batch.kubernetes.io/job-name=" + job})
		if err != nil {
			return nil
		}
		return pods.Items
	}
	running := func(pods []v1.Pod, n int) bool {
		if len(pods) != n {
			return false
		}
		for _, p := range pods {
			if p.Status.Phase != v1.PodRunning {
				return false
			}
		}
		return true
	}

	// Both jobs in a queue of their own (FCFS), so that the 2-GPU job waits
	// whatever the rest of the suite holds: behind the 16-GPU job while that
	// waits for both DGX nodes, or for devices while it runs on them.
	const qname = "e2e-submit"
	q := &unstructured.Unstructured{Object: map[string]any{"apiVersion": gpudrav1.APIVersion, "kind": gpudrav1.KindGpuQueue,
		"metadata": map[string]any{"name": qname}, "spec": map[string]any{"policy": string(gpudrav1.FCFS)}}}
	_, err := dyn(t).Resource(gpudrav1.GpuQueues).Create(ctx, q, metav1.CreateOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = dyn(t).Resource(gpudrav1.GpuQueues).Delete(ctx, qname, metav1.DeleteOptions{}) })

	// The probe as the command runs until stopped; 16 GPUs are two pods of 8.
	out, err := gpudra("researcher-a", ns, "submit", "--gpus", "16", "--queue", qname, "--image", "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04",
		"--name", "hold", "--", "gpudra-probe")
	require.NoError(t, err, out)
	err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		return len(jobPods(ctx, "hold")) == 2, nil
	})
	require.NoError(t, err, "the 16-GPU job's two pods exist")

	// The probe exits 0 after 6 s: the job completes.
	out, err = gpudra("researcher-a", ns, "submit", "--gpus", "2", "--queue", qname, "--image", "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04",
		"--name", "train", "--", "gpudra-probe", "--exit-after=6s")
	require.NoError(t, err, out)
	assert.Contains(t, out, "train")
	waiting := regexp.MustCompile(`train\s+Job\s+Waiting\s+0/1\s+` + qname + `\s+\d+\s+(WaitingForDevices|BehindInQueue)`)
	err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		out, err = gpudra("researcher-a", ns, "jobs")
		return err == nil && waiting.MatchString(out), nil
	})
	require.NoError(t, err, "gpudra jobs shows the 2-GPU job waiting, with gpudra's reason: %s", out)

	out, err = gpudra("researcher-b", other, "jobs")
	require.NoError(t, err, out)
	assert.NotContains(t, out, "train", "another namespace's researcher sees none of it")
	_, err = gpudra("researcher-b", other, "cancel", "train")
	require.Error(t, err, "nor cancels it")
	_, err = gpudra("researcher-b", other, "jobs", "-n", ns)
	require.Error(t, err, "nor lists the namespace")

	out, err = gpudra("researcher-a", ns, "cancel", "hold")
	require.NoError(t, err, out)

	var pod v1.Pod
	err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		pods := jobPods(ctx, "train")
		if len(pods) == 1 {
			pod = pods[0]
		}
		return running(pods, 1), nil
	})
	require.NoError(t, err, "the job's pod runs once the GPUs are free: %s", describe(&pod))
	require.Len(t, pod.Spec.ResourceClaims, 1)
	claim := podClaim(t, &pod, pod.Spec.ResourceClaims[0].Name)
	require.NotNil(t, claim.Status.Allocation)
	assert.Len(t, claim.Status.Allocation.Devices.Results, 2, "exactly 2 GPUs")
	require.True(t, hasSpecFor(t, pod.Spec.NodeName, string(claim.UID)), "its claim is prepared on %s", pod.Spec.NodeName)

	out, err = gpudra("researcher-a", ns, "jobs")
	require.NoError(t, err, out)
	assert.Regexp(t, `train\s+Job\s+Running`, out)
	for _, r := range claim.Status.Allocation.Devices.Results {
		assert.Contains(t, out, r.Device, "the job's devices")
	}

	// It completes: the pod Succeeded with its container's exit, the Job
	// Complete, the claim released and unprepared.
	var job *batchv1.Job
	err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		job, err = cluster.Client.BatchV1().Jobs(ns).Get(ctx, "train", metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for _, c := range job.Status.Conditions {
			if c.Type == batchv1.JobComplete && c.Status == v1.ConditionTrue {
				return true, nil
			}
		}
		return false, nil
	})
	require.NoError(t, err, "the Job completes: %+v", job.Status)
	done, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, pod.Name, metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, v1.PodSucceeded, done.Status.Phase)
	if assert.Len(t, done.Status.ContainerStatuses, 1) && assert.NotNil(t, done.Status.ContainerStatuses[0].State.Terminated) {
		term := done.Status.ContainerStatuses[0].State.Terminated
		assert.Equal(t, int32(0), term.ExitCode)
		assert.Equal(t, "Completed", term.Reason)
	}
	out, err = gpudra("researcher-a", ns, "jobs")
	require.NoError(t, err, out)
	assert.Regexp(t, `train\s+Job\s+Succeeded\s+0/1`, out)
	// Within 20 s: the kubelet unprepares a terminated pod's claims at
	// once, not by the DRA manager's 60 s sweep.
	err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, 20*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, claim.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err) && !hasSpecFor(t, pod.Spec.NodeName, string(claim.UID)), nil
	})
	require.NoError(t, err, "the completed pod's claim is released (deleted) and nothing is left prepared on %s", pod.Spec.NodeName)

	out, err = gpudra("researcher-a", ns, "cancel", "train")
	require.NoError(t, err, out)
	err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := cluster.Client.BatchV1().Jobs(ns).Get(ctx, "train", metav1.GetOptions{})
		pods, perr := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		claims, cerr := cluster.Client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
		return apierrors.IsNotFound(err) && perr == nil && len(pods.Items) == 0 && cerr == nil && len(claims.Items) == 0, nil
	})
	require.NoError(t, err, "cancel removes the Jobs, their pods and their claims")
}
