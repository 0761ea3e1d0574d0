package ray_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	restclient "k8s.io/client-go/rest"

	"github.com/gpudra/gpudra/devcluster/e2e/tenant"
	"github.com/gpudra/gpudra/pkg/dashboard"
	"github.com/gpudra/gpudra/pkg/submit"
)

// grantEdit gives user the default `edit` role in ns, as aggregated in a
// cluster (again after an admin aggregated more into it), and returns the
// user's client configuration.
func grantEdit(t *testing.T, ns, user string) *restclient.Config {
	t.Helper()
	cfg, err := tenant.Grant(context.Background(), cluster, ns, user, "edit")
	require.NoError(t, err)
	return cfg
}

// TestSubmitRayAsEditUser: a researcher with `edit` in one namespace runs
// `gpudra submit --ray --gpus 2`. Without examples/ray/edit-rayjobs.yaml
// `edit` has no RayJobs (KubeRay's CRDs aggregate into no default role):
// refused, nothing created. With it, the RayJob's head and worker run as
// one gpudra gang, the worker on exactly its 2 claimed GPUs; `gpudra
// jobs` shows the RayJob running with those devices; `gpudra cancel`
// leaves no RayJob, pod, claim or claim template.
func TestSubmitRayAsEditUser(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t)
	const user = "researcher-ray"
	cfg := grantEdit(t, ns, user)
	gpudra := func(args ...string) (string, error) { return tenant.Gpudra(ctx, cfg, ns, args...) }
	submitArgs := []string{"submit", "--ray", "--gpus", "2", "--image", "rayproject/ray:2.46.0-gpu", "--name", "train", "--",
		"python", "train.py", "--epochs", "1"}

	out, err := gpudra(submitArgs...)
	require.Error(t, err, "edit alone may not create RayJobs: %s", out)
	assert.True(t, apierrors.IsForbidden(err), "forbidden: %v", err)
	tmpls, err := cluster.Client.ResourceV1().ResourceClaimTemplates(ns).List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	assert.Empty(t, tmpls.Items, "a refused submission creates nothing")

	_, err = cluster.ApplyFiles(ctx, "", filepath.Join(examples, "ray", "edit-rayjobs.yaml"))
	require.NoError(t, err)
	grantEdit(t, ns, user)
	out, err = gpudra(submitArgs...)
	require.NoError(t, err, out)
	assert.Contains(t, out, "RayJob "+ns+"/train submitted: 2 GPU(s)")

	rc := rayJobCluster(t, ns, "train")
	head := waitClusterGroup(t, ns, rc, "headgroup", 1)
	workers := waitClusterGroup(t, ns, rc, submit.RayWorkerGroupName, 1)
	for _, pod := range append(head, workers...) {
		c := gangCondition(pod)
		require.NotNil(t, c, "%s: admitted by gpudra's gang controller", pod.Name)
		assert.Equal(t, v1.ConditionTrue, c.Status, "%s: %s %s", pod.Name, c.Reason, c.Message)
		assert.Equal(t, "train", pod.Labels[gangLabel], pod.Name)
		assert.Equal(t, "2", pod.Annotations["gpudra.dev/gang-size"], "%s: the head and its worker, one gang", pod.Name)
	}
	worker := workers[0]
	claim, devs := assertWorkerClaim(t, worker, submit.ClaimName, 2)
	claimed := map[string]bool{}
	for _, d := range devs {
		claimed[attr(d, "uuid")] = true
	}
	visible := visibleGPUs(t, worker, submit.RayWorkerContainer)
	require.Len(t, visible, 2, "%s is given 2 devices", worker.Name)
	for _, uuid := range visible {
		if !claimed[uuid] {
			// A whole-GPU claim on a GPU in MIG mode is given an instance
			// spanning it: its parent is the claimed GPU.
			_, parent := migInstance(t, worker.Spec.NodeName, uuid)
			assert.True(t, claimed[parent], "%s: %s is one of its claimed GPUs %v", worker.Name, uuid, claimed)
		}
	}

	out, err = gpudra("jobs")
	require.NoError(t, err, out)
	assert.Regexp(t, `train\s+RayJob\s+Running\s+2/2`, out)
	for _, r := range claim.Status.Allocation.Devices.Results {
		assert.Contains(t, out, r.Pool+"/"+r.Device, "the worker's devices")
	}

	// The dashboard, with the user's credentials, shows the RayJob as one
	// group: its cluster, the head, and the worker with its devices.
	assertDashboardGroup(t, ns, user, worker.Name, claim)

	seen := claimUIDsByNode(t, ns)
	out, err = gpudra("cancel", "train")
	require.NoError(t, err, out)
	err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := dyn(t).Resource(submit.RayJobs).Namespace(ns).Get(ctx, "train", metav1.GetOptions{})
		pods, perr := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		claims, cerr := cluster.Client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
		tmpls, terr := cluster.Client.ResourceV1().ResourceClaimTemplates(ns).List(ctx, metav1.ListOptions{})
		return apierrors.IsNotFound(err) && perr == nil && len(pods.Items) == 0 && cerr == nil && len(claims.Items) == 0 &&
			terr == nil && len(tmpls.Items) == 0, nil
	})
	require.NoError(t, err, "cancel removes the RayJob, its pods, their claims and the claim template")
	for node, uids := range seen {
		waitUnprepared(t, node, uids...)
	}
}

// assertDashboardGroup runs gpudra dashboard's source as user, on ns, and
// waits for the RayJob train's group: KubeRay's state, its RayCluster,
// its head and its worker with the claim's devices.
func assertDashboardGroup(t *testing.T, ns, user, worker string, claim *resourceapi.ResourceClaim) {
	t.Helper()
	cfg := restclient.CopyConfig(cluster.RESTConfig)
	cfg.Impersonate = restclient.ImpersonationConfig{UserName: user, Groups: []string{"system:authenticated"}}
	kube, err := kubernetes.NewForConfig(cfg)
	require.NoError(t, err)
	dc, err := dynamic.NewForConfig(cfg)
	require.NoError(t, err)
	src := dashboard.NewClusterSource(dashboard.ClusterConfig{Client: kube, Dynamic: dc, Namespace: ns, Debounce: 50 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx) }()
	defer func() { cancel(); require.NoError(t, <-done) }()
	var want []string
	for _, r := range claim.Status.Allocation.Devices.Results {
		want = append(want, r.Pool+"/"+r.Device)
	}
	var last []dashboard.Workload
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		v, changed := src.Current()
		last = v.Workloads
		for _, w := range v.Workloads {
			if w.Kind != "RayJob" || w.Name != "train" || w.RayCluster == "" || len(w.Pods) != 2 {
				continue
			}
			head, wk := w.Pods[0], w.Pods[1]
			if head.Role == "head" && wk.Name == worker && len(wk.Claims) == 1 && assert.ObjectsAreEqual(want, wk.Claims[0].Devices) {
				t.Logf("dashboard: %s %s/%s (%s), cluster %s (%s), pods %+v", w.Kind, w.Namespace, w.Name, w.State, w.RayCluster, w.ClusterState, w.Pods)
				return
			}
		}
		select {
		case <-changed:
		case <-time.After(time.Second):
		}
	}
	t.Fatalf("the dashboard shows no RayJob group train with its head and worker %s on %v: %+v", worker, want, last)
}
