package submit

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	"k8s.io/client-go/kubernetes/fake"
	clienttesting "k8s.io/client-go/testing"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// fakeClient is a Client over fake clientsets that, as the API server,
// persists nothing of a dry-run create; queues are the GpuQueues that
// exist.
func fakeClient(t *testing.T, queues ...string) (*Client, *fake.Clientset, *dynamicfake.FakeDynamicClient) {
	t.Helper()
	kube := fake.NewClientset()
	kube.PrependReactor("create", "*", func(a clienttesting.Action) (bool, runtime.Object, error) {
		if c, ok := a.(clienttesting.CreateActionImpl); ok && len(c.GetCreateOptions().DryRun) > 0 {
			return true, c.GetObject(), nil
		}
		return false, nil, nil
	})
	var objs []runtime.Object
	for _, q := range queues {
		u := &unstructured.Unstructured{}
		u.SetAPIVersion(gpudrav1.APIVersion)
		u.SetKind(gpudrav1.KindGpuQueue)
		u.SetName(q)
		objs = append(objs, u)
	}
	dyn := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(),
		map[schema.GroupVersionResource]string{gpudrav1.GpuQueues: "GpuQueueList", RayJobs: "RayJobList"}, objs...)
	dyn.PrependReactor("create", "*", func(a clienttesting.Action) (bool, runtime.Object, error) {
		if c, ok := a.(clienttesting.CreateActionImpl); ok && len(c.GetCreateOptions().DryRun) > 0 {
			return true, c.GetObject(), nil
		}
		return false, nil, nil
	})
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	return &Client{Kube: kube, Dynamic: dyn, Now: func() time.Time { return now }}, kube, dyn
}

func mustBuild(t *testing.T, change func(*Spec)) Objects {
	t.Helper()
	s := valid()
	if change != nil {
		change(&s)
	}
	o, err := Build(s)
	require.NoError(t, err)
	return o
}

// nothingCreated asserts that no job and no template exist.
func nothingCreated(t *testing.T, kube *fake.Clientset) {
	t.Helper()
	jobs, err := kube.BatchV1().Jobs("research").List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	assert.Empty(t, jobs.Items)
	tmpls, err := kube.ResourceV1().ResourceClaimTemplates("research").List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	assert.Empty(t, tmpls.Items)
}

func TestSubmitCreatesTheTemplateOwnedByTheJob(t *testing.T) {
	ctx := context.Background()
	c, kube, _ := fakeClient(t, "team-a")
	require.NoError(t, c.Submit(ctx, mustBuild(t, func(s *Spec) { s.Queue = "team-a" })))
	job, err := kube.BatchV1().Jobs("research").Get(ctx, "train", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, "team-a", job.Spec.Template.Annotations[gpudrav1.AnnotationQueue])
	tmpl, err := kube.ResourceV1().ResourceClaimTemplates("research").Get(ctx, "train-gpus", metav1.GetOptions{})
	require.NoError(t, err)
	require.Len(t, tmpl.OwnerReferences, 1)
	assert.Equal(t, "Job", tmpl.OwnerReferences[0].Kind)
	assert.Equal(t, "train", tmpl.OwnerReferences[0].Name)
	pods, err := kube.CoreV1().Pods("research").List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	assert.Empty(t, pods.Items, "the pod was only a dry run")
}

func TestSubmitCreatesNothingOnBadInput(t *testing.T) {
	ctx := context.Background()
	t.Run("a queue that does not exist", func(t *testing.T) {
		c, kube, _ := fakeClient(t, "team-a")
		err := c.Submit(ctx, mustBuild(t, func(s *Spec) { s.Queue = "team-b" }))
		require.ErrorContains(t, err, "--queue team-b: no GpuQueue of that name")
		assert.NotErrorIs(t, err, ErrQueueUnknown)
		nothingCreated(t, kube)
	})
	t.Run("a queue that could not be read is not called absent", func(t *testing.T) {
		c, kube, dyn := fakeClient(t)
		dyn.PrependReactor("get", "gpuqueues", func(clienttesting.Action) (bool, runtime.Object, error) {
			return true, nil, apierrors.NewInternalError(errors.New("etcd timeout"))
		})
		err := c.Submit(ctx, mustBuild(t, func(s *Spec) { s.Queue = "team-b" }))
		require.ErrorIs(t, err, ErrQueueUnknown)
		assert.NotContains(t, err.Error(), "no GpuQueue")
		nothingCreated(t, kube)
	})
	t.Run("forbidden to read queues", func(t *testing.T) {
		c, kube, dyn := fakeClient(t)
		dyn.PrependReactor("get", "gpuqueues", func(clienttesting.Action) (bool, runtime.Object, error) {
			return true, nil, apierrors.NewForbidden(gpudrav1.GpuQueues.GroupResource(), "team-b", errors.New("RBAC"))
		})
		err := c.Submit(ctx, mustBuild(t, func(s *Spec) { s.Queue = "team-b" }))
		require.ErrorIs(t, err, ErrQueueUnknown)
		require.ErrorContains(t, err, "may not read GpuQueues")
		nothingCreated(t, kube)
	})
	t.Run("the API server refuses the pod", func(t *testing.T) {
		c, kube, _ := fakeClient(t)
		kube.PrependReactor("create", "pods", func(clienttesting.Action) (bool, runtime.Object, error) {
			return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "pods"}, "train-0", errors.New("no PriorityClass with name high was found"))
		})
		err := c.Submit(ctx, mustBuild(t, func(s *Spec) { s.PriorityClass = "high" }))
		require.ErrorContains(t, err, "the job's pods would be refused")
		require.ErrorContains(t, err, "no PriorityClass with name high")
		nothingCreated(t, kube)
	})
	t.Run("the default queue need not exist", func(t *testing.T) {
		c, _, _ := fakeClient(t)
		require.NoError(t, c.Submit(ctx, mustBuild(t, func(s *Spec) { s.Queue = gpudrav1.DefaultQueue })))
	})
}

func TestListShowsWhereAJobWaitsAndWhatItHolds(t *testing.T) {
	ctx := context.Background()
	c, kube, _ := fakeClient(t)
	require.NoError(t, c.Submit(ctx, mustBuild(t, nil)))
	require.NoError(t, c.Submit(ctx, mustBuild(t, func(s *Spec) { s.Name = "eval" })))
	// A job of someone else's (not submit's) is not listed.
	_, err := kube.BatchV1().Jobs("research").Create(ctx, &batchv1.Job{ObjectMeta: metav1.ObjectMeta{Name: "other"}}, metav1.CreateOptions{})
	require.NoError(t, err)

	jobPod := func(job, name string) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "research",
			Labels: map[string]string{LabelManagedBy: ManagedBy, LabelJob: job}}}
	}
	waiting := jobPod("train", "train-0-abcde")
	waiting.Spec.SchedulingGates = []corev1.PodSchedulingGate{{Name: gpudrav1.SchedulingGate}}
	waiting.Status.Conditions = []corev1.PodCondition{
		{Type: corev1.PodScheduled, Status: corev1.ConditionFalse, Reason: corev1.PodReasonSchedulingGated},
		{Type: gangCondition, Status: corev1.ConditionFalse, Reason: "BehindInQueue", Message: "position 2 in queue default: research/first waits for 8 devices"},
	}
	running := jobPod("eval", "eval-0-fghij")
	running.Spec.NodeName = "node-a"
	running.Status.Phase = corev1.PodRunning
	running.Status.ResourceClaimStatuses = []corev1.PodResourceClaimStatus{{Name: ClaimName, ResourceClaimName: ptr.To("eval-0-fghij-gpus-xyz")}}
	for _, p := range []*corev1.Pod{waiting, running} {
		_, err := kube.CoreV1().Pods("research").Create(ctx, p, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "eval-0-fghij-gpus-xyz", Namespace: "research"},
		Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{
			Results: []resourceapi.DeviceRequestAllocationResult{{Request: "gpus", Driver: "gpu.gpudra.dev", Pool: "node-a", Device: "gpu-0"},
				{Request: "gpus", Driver: "gpu.gpudra.dev", Pool: "node-a", Device: "gpu-1"}}}}}}
	_, err = kube.ResourceV1().ResourceClaims("research").Create(ctx, claim, metav1.CreateOptions{})
	require.NoError(t, err)

	jobs, _, err := c.List(ctx, "research")
	require.NoError(t, err)
	require.Len(t, jobs, 2)
	byName := map[string]JobStatus{}
	for _, j := range jobs {
		byName[j.Name] = j
	}
	train := byName["train"]
	assert.Equal(t, StateWaiting, train.State)
	assert.Equal(t, 2, train.Position)
	assert.Equal(t, "default", train.Queue)
	assert.Equal(t, "BehindInQueue", train.Reason, "the gang's reason, not the gate's")
	assert.Equal(t, "research/first waits for 8 devices", train.Message)
	assert.Empty(t, train.Devices)
	eval := byName["eval"]
	assert.Equal(t, StateRunning, eval.State)
	assert.Equal(t, "1/1", eval.Pods)
	assert.Equal(t, []string{"node-a/gpu-0", "node-a/gpu-1"}, eval.Devices)
	assert.Zero(t, eval.Position)
	assert.Empty(t, eval.Reason)
}

func TestStatusOfAnUngatedPendingPodIsTheSchedulersReason(t *testing.T) {
	job := &batchv1.Job{ObjectMeta: metav1.ObjectMeta{Name: "train"}}
	pod := &corev1.Pod{Status: corev1.PodStatus{Conditions: []corev1.PodCondition{
		{Type: corev1.PodScheduled, Status: corev1.ConditionFalse, Reason: corev1.PodReasonUnschedulable, Message: "0/4 nodes are available"}}}}
	st := Status(job, []*corev1.Pod{pod}, nil, time.Now())
	assert.Equal(t, StateWaiting, st.State)
	assert.Equal(t, corev1.PodReasonUnschedulable, st.Reason)
	done := job.DeepCopy()
	done.Status.Conditions = []batchv1.JobCondition{{Type: batchv1.JobComplete, Status: corev1.ConditionTrue}}
	assert.Equal(t, StateSucceeded, Status(done, nil, nil, time.Now()).State)
}

// TestStatusOfEndedPods: a job whose pods have ended is Succeeded or
// Failed at once, not Starting (bound to a node, not running) until the
// Job controller writes its condition.
func TestStatusOfEndedPods(t *testing.T) {
	job := &batchv1.Job{ObjectMeta: metav1.ObjectMeta{Name: "train"}, Spec: batchv1.JobSpec{Completions: ptr.To[int32](2)}}
	pod := func(phase corev1.PodPhase) *corev1.Pod {
		return &corev1.Pod{Spec: corev1.PodSpec{NodeName: "node-a"}, Status: corev1.PodStatus{Phase: phase}}
	}
	for _, tc := range []struct {
		name   string
		phases []corev1.PodPhase
		want   string
	}{
		{"both succeeded", []corev1.PodPhase{corev1.PodSucceeded, corev1.PodSucceeded}, StateSucceeded},
		{"one failed", []corev1.PodPhase{corev1.PodSucceeded, corev1.PodFailed}, StateFailed},
		{"one still running", []corev1.PodPhase{corev1.PodSucceeded, corev1.PodRunning}, StateRunning},
		{"one bound, not started", []corev1.PodPhase{corev1.PodSucceeded, corev1.PodPending}, StateStarting},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var pods []*corev1.Pod
			for _, ph := range tc.phases {
				pods = append(pods, pod(ph))
			}
			assert.Equal(t, tc.want, Status(job, pods, nil, time.Now()).State)
		})
	}
}

func TestCancelDeletesTheJobAndItsTemplate(t *testing.T) {
	ctx := context.Background()
	c, kube, _ := fakeClient(t)
	require.NoError(t, c.Submit(ctx, mustBuild(t, nil)))
	var propagation *metav1.DeletionPropagation
	kube.PrependReactor("delete", "jobs", func(a clienttesting.Action) (bool, runtime.Object, error) {
		propagation = a.(clienttesting.DeleteActionImpl).DeleteOptions.PropagationPolicy
		return false, nil, nil
	})
	require.NoError(t, c.Cancel(ctx, "research", "train"))
	require.NotNil(t, propagation)
	assert.Equal(t, metav1.DeletePropagationBackground, *propagation, "so that the pods, and with them their claims, go")
	nothingCreated(t, kube)

	require.ErrorContains(t, c.Cancel(ctx, "research", "train"), "job research/train: not found")
	_, err := kube.BatchV1().Jobs("research").Create(ctx, &batchv1.Job{ObjectMeta: metav1.ObjectMeta{Name: "other"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	require.ErrorContains(t, c.Cancel(ctx, "research", "other"), "was not made by gpudra submit")
	_, err = kube.BatchV1().Jobs("research").Get(ctx, "other", metav1.GetOptions{})
	require.NoError(t, err, "someone else's Job is left alone")
}
