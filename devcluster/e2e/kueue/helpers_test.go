package kueue_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	restclient "k8s.io/client-go/rest"

	"github.com/gpudra/gpudra/devcluster/e2e/tenant"
	"github.com/gpudra/gpudra/pkg/dashboard"
	"github.com/gpudra/gpudra/pkg/kueue"
)

// image is what the jobs name; devcluster runs its probe in their
// containers.
const image = "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04"

// podsReadyTimeout is Kueue's waitForPodsReady timeout here.
const podsReadyTimeout = 30 * time.Second

// researcher is a user with the default `edit` role and Kueue's
// kueue-batch-user-role (Kueue's documented grant to a batch user) in one
// team's namespace, who runs gpudra's commands with their own rights.
type researcher struct {
	name, namespace string
	cfg             *restclient.Config
}

func newResearcher(t *testing.T, name, namespace string) *researcher {
	t.Helper()
	cfg, err := tenant.Grant(context.Background(), cluster, namespace, name, "edit", "kueue-batch-user-role")
	require.NoError(t, err)
	return &researcher{name: name, namespace: namespace, cfg: cfg}
}

// gpudra runs a gpudra command (submit, jobs, cancel) as the researcher.
func (r *researcher) gpudra(t *testing.T, args ...string) (string, error) {
	t.Helper()
	return tenant.Gpudra(context.Background(), r.cfg, r.namespace, args...)
}

// submit submits a job of gpus GPUs (pods of perPod each) to the team's
// LocalQueue gpus.
func (r *researcher) submit(t *testing.T, name string, gpus, perPod int) {
	t.Helper()
	out, err := r.gpudra(t, "submit", "--name", name, "--gpus", fmt.Sprint(gpus), "--gpus-per-node", fmt.Sprint(perPod),
		"--kueue-queue", "gpus", "--image", image, "--", "python", "train.py")
	require.NoError(t, err, out)
}

// runningPods waits until the job's n pods run and returns them.
func runningPods(t *testing.T, namespace, job string, n int, timeout time.Duration) []v1.Pod {
	t.Helper()
	var pods []v1.Pod
	err := wait.PollUntilContextTimeout(context.Background(), 250*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		list, err := cluster.Client.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{LabelSelector: "batch.kubernetes.io/job-name=" + job})
		if err != nil {
			return false, nil
		}
		pods = list.Items
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
	require.NoError(t, err, "job %s/%s: %d pods running: %s", namespace, job, n, describePods(pods))
	return pods
}

func describePods(pods []v1.Pod) string {
	var b strings.Builder
	for _, p := range pods {
		fmt.Fprintf(&b, "\n  %s: %s", p.Name, p.Status.Phase)
		for _, c := range p.Status.Conditions {
			if c.Status != v1.ConditionTrue {
				fmt.Fprintf(&b, " [%s=%s %s: %s]", c.Type, c.Status, c.Reason, c.Message)
			}
		}
		for _, g := range p.Spec.SchedulingGates {
			fmt.Fprintf(&b, " gate %s", g.Name)
		}
	}
	return b.String()
}

// gpusOf is how many devices the pod's claims hold.
func gpusOf(t *testing.T, p *v1.Pod) int {
	t.Helper()
	n := 0
	for _, s := range p.Status.ResourceClaimStatuses {
		if s.ResourceClaimName == nil {
			continue
		}
		cl, err := cluster.Client.ResourceV1().ResourceClaims(p.Namespace).Get(context.Background(), *s.ResourceClaimName, metav1.GetOptions{})
		require.NoError(t, err)
		require.NotNil(t, cl.Status.Allocation, "claim %s allocated", cl.Name)
		n += len(cl.Status.Allocation.Devices.Results)
	}
	return n
}

// cancel cancels the researcher's jobs and waits until their pods are gone.
func (r *researcher) cancel(t *testing.T, jobs ...string) {
	t.Helper()
	for _, j := range jobs {
		out, err := r.gpudra(t, "cancel", j)
		assert.NoError(t, err, out)
	}
	err := wait.PollUntilContextTimeout(context.Background(), 250*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		pods, err := cluster.Client.CoreV1().Pods(r.namespace).List(ctx, metav1.ListOptions{})
		return err == nil && len(pods.Items) == 0, nil
	})
	assert.NoError(t, err, "the pods of %v are gone", jobs)
}

// workload is Kueue's Workload of the job (owned by it).
func workload(t *testing.T, namespace, job string) *unstructured.Unstructured {
	return ownedWorkload(t, namespace, "Job", job)
}

// rayWorkload is Kueue's Workload of the RayJob.
func rayWorkload(t *testing.T, namespace, job string) *unstructured.Unstructured {
	return ownedWorkload(t, namespace, "RayJob", job)
}

func ownedWorkload(t *testing.T, namespace, kind, job string) *unstructured.Unstructured {
	t.Helper()
	dyn, err := dynamic.NewForConfig(cluster.RESTConfig)
	require.NoError(t, err)
	var found *unstructured.Unstructured
	err = wait.PollUntilContextTimeout(context.Background(), 250*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		list, err := dyn.Resource(kueue.Workloads).Namespace(namespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		for i := range list.Items {
			for _, o := range list.Items[i].GetOwnerReferences() {
				if o.Kind == kind && o.Name == job {
					found = &list.Items[i]
					return true, nil
				}
			}
		}
		return false, nil
	})
	require.NoError(t, err, "Kueue's Workload of %s %s/%s", kind, namespace, job)
	return found
}

// condition is a Workload's condition of type typ (status, reason,
// message), empty when it has none.
func condition(w *unstructured.Unstructured, typ string) (status, reason, message string) {
	conds, _, _ := unstructured.NestedSlice(w.Object, "status", "conditions")
	for _, c := range conds {
		m, _ := c.(map[string]any)
		if m["type"] == typ {
			s, _ := m["status"].(string)
			r, _ := m["reason"].(string)
			msg, _ := m["message"].(string)
			return s, r, msg
		}
	}
	return "", "", ""
}

// dashboardKueue waits until the dashboard, read as the researcher,
// shows the job as Kueue's workload in state, and returns it.
func (r *researcher) dashboardKueue(t *testing.T, job, state string) dashboard.Workload {
	t.Helper()
	kube, err := kubernetes.NewForConfig(r.cfg)
	require.NoError(t, err)
	dc, err := dynamic.NewForConfig(r.cfg)
	require.NoError(t, err)
	src := dashboard.NewClusterSource(dashboard.ClusterConfig{Client: kube, Dynamic: dc, Namespace: r.namespace, Debounce: 50 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx) }()
	defer func() { cancel(); require.NoError(t, <-done) }()
	var last []dashboard.Workload
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		v, changed := src.Current()
		last = v.Workloads
		for _, w := range v.Workloads {
			if w.Kind == "Job" && w.Name == job && w.Kueue != nil && w.Kueue.State == state {
				return w
			}
		}
		select {
		case <-changed:
		case <-time.After(time.Second):
		}
	}
	t.Fatalf("the dashboard shows no Job %s as Kueue's, %s: %+v", job, state, last)
	return dashboard.Workload{}
}

// gangMessage is the message of gpudra's gang condition on the pod.
func gangMessage(p *v1.Pod) string {
	for _, c := range p.Status.Conditions {
		if c.Type == "gpudra.dev/GangAllocated" {
			return c.Message
		}
	}
	return ""
}
