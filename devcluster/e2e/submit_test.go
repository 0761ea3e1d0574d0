package e2e

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	restclient "k8s.io/client-go/rest"

	"github.com/gpudra/gpudra/pkg/submit/cli"
)

// TestSubmitAsEditUser: a researcher who holds only the default `edit`
// role in one namespace submits a 2-GPU job with `gpudra submit`, with
// their own credentials. The Job controller makes its pod, gpudra admits
// it as a gang, it runs on exactly 2 GPUs; `gpudra jobs` shows it running
// with its devices; a researcher of another namespace sees none of it and
// cannot cancel it; `gpudra cancel` removes the Job, its pod and claims.
func TestSubmitAsEditUser(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t)
	other := namespace(t)
	editTenant(t, ns, "researcher-a")
	editTenant(t, other, "researcher-b")
	gpudra := func(user, userNS string, args ...string) (string, error) {
		cfg := restclient.CopyConfig(cluster.RESTConfig)
		cfg.Impersonate = restclient.ImpersonationConfig{UserName: user, Groups: []string{"system:authenticated"}}
		clients := func(string, string) (cli.Clients, error) { return cli.ClientsFor(cfg, userNS, nil) }
		for _, c := range cli.Commands(clients) {
			if c.Name() == args[0] {
				var out bytes.Buffer
				c.SetOut(&out)
				c.SetErr(&out)
				c.SetArgs(args[1:])
				err := c.ExecuteContext(ctx)
				return out.String(), err
			}
		}
		t.Fatalf("no command %s", args[0])
		return "", nil
	}

	out, err := gpudra("researcher-a", ns, "submit", "--gpus", "2", "--image", "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04",
		"--name", "train", "--", "nvidia-smi", "-L")
	require.NoError(t, err, out)
	assert.Contains(t, out, "train")

	var pod v1.Pod
	err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		pods, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "batch.kubernetes.io/job-name=train"})
		if err != nil || len(pods.Items) != 1 {
			return false, nil
		}
		pod = pods.Items[0]
		return pod.Status.Phase == v1.PodRunning, nil
	})
	require.NoError(t, err, "the job's pod runs: %s", describe(&pod))
	require.Len(t, pod.Spec.ResourceClaims, 1)
	claim := podClaim(t, &pod, pod.Spec.ResourceClaims[0].Name)
	require.NotNil(t, claim.Status.Allocation)
	assert.Len(t, claim.Status.Allocation.Devices.Results, 2, "exactly 2 GPUs")

	out, err = gpudra("researcher-a", ns, "jobs")
	require.NoError(t, err, out)
	assert.Regexp(t, `train\s+Running`, out)
	for _, r := range claim.Status.Allocation.Devices.Results {
		assert.Contains(t, out, r.Device, "the job's devices")
	}

	out, err = gpudra("researcher-b", other, "jobs")
	require.NoError(t, err, out)
	assert.NotContains(t, out, "train", "another namespace's researcher sees none of it")
	_, err = gpudra("researcher-b", other, "cancel", "train")
	require.Error(t, err, "nor cancels it")
	_, err = gpudra("researcher-b", other, "jobs", "-n", ns)
	require.Error(t, err, "nor lists the namespace")

	out, err = gpudra("researcher-a", ns, "cancel", "train")
	require.NoError(t, err, out)
	err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := cluster.Client.BatchV1().Jobs(ns).Get(ctx, "train", metav1.GetOptions{})
		pods, perr := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		claims, cerr := cluster.Client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
		return apierrors.IsNotFound(err) && perr == nil && len(pods.Items) == 0 && cerr == nil && len(claims.Items) == 0, nil
	})
	require.NoError(t, err, "cancel removes the Job, its pod and its claims")
}
