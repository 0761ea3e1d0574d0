package submit

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	fakediscovery "k8s.io/client-go/discovery/fake"
	"k8s.io/client-go/kubernetes/fake"
	clienttesting "k8s.io/client-go/testing"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

func ray(change func(*Spec)) func(*Spec) {
	return func(s *Spec) {
		s.Ray = true
		if change != nil {
			change(s)
		}
	}
}

// TestBuildRayJob: --ray builds a RayJob from the same flags as a Job: a
// head without GPUs and one worker group whose workers hold the claim
// template's GPUs, as many workers as the Job would have pods, head and
// workers one gang, the command the entrypoint.
func TestBuildRayJob(t *testing.T) {
	for name, tc := range map[string]struct {
		change  func(*Spec)
		workers int32
		perPod  int64
		check   func(t *testing.T, o Objects)
	}{
		"2 GPUs in one NVLink domain: one worker": {change: func(s *Spec) { s.SameNVLink = true }, workers: 1, perPod: 2, check: func(t *testing.T, o Objects) {
			assert.Len(t, o.Template.Spec.Spec.Devices.Constraints, 1, "the Job path's claim: matchAttribute on the NVLink domain")
		}},
		"16 GPUs: two workers of 8": {change: func(s *Spec) { s.GPUs = 16 }, workers: 2, perPod: 8},
		"a MIG profile": {change: func(s *Spec) { s.GPUs = 1; s.MIG = "1g.10gb" }, workers: 1, perPod: 1, check: func(t *testing.T, o Objects) {
			assert.Equal(t, "mig.gpudra.dev", o.Template.Spec.Spec.Devices.Requests[0].Exactly.DeviceClassName)
		}},
		"a quarter of a GPU: the worker tolerates the fractional node, the head does not need to": {
			change: func(s *Spec) { s.GPUs = 1; s.Share = "0.25" }, workers: 1, perPod: 1, check: func(t *testing.T, o Objects) {
				w := o.RayJob.Spec.RayClusterSpec.WorkerGroupSpecs[0].Template.Spec
				require.Len(t, w.Tolerations, 1)
				assert.Equal(t, FractionalToleration, w.Tolerations[0].Key)
				assert.Empty(t, o.RayJob.Spec.RayClusterSpec.HeadGroupSpec.Template.Spec.Tolerations)
				assert.NotNil(t, o.Template.Spec.Spec.Devices.Requests[0].Exactly.Capacity)
			}},
		"queue, priority and duration on head and workers": {
			change: func(s *Spec) { s.Queue = "team-a"; s.PriorityClass = "high"; s.Duration = time.Hour }, workers: 1, perPod: 2,
			check: func(t *testing.T, o Objects) {
				for _, tmpl := range []corev1.PodTemplateSpec{o.RayJob.Spec.RayClusterSpec.HeadGroupSpec.Template, o.RayJob.Spec.RayClusterSpec.WorkerGroupSpecs[0].Template} {
					assert.Equal(t, "team-a", tmpl.Annotations[gpudrav1.AnnotationQueue])
					assert.Equal(t, "1h0m0s", tmpl.Annotations[gpudrav1.AnnotationDuration])
					assert.Equal(t, "high", tmpl.Spec.PriorityClassName)
					assert.Nil(t, tmpl.Spec.ActiveDeadlineSeconds, "declared only: KubeRay would make a stopped Ray pod again, outside its gang")
				}
			}},
	} {
		t.Run(name, func(t *testing.T) {
			o := mustBuild(t, ray(tc.change))
			require.Nil(t, o.Job, "a RayJob instead of a Job")
			require.NotNil(t, o.RayJob)
			rj := o.RayJob
			assert.Equal(t, "ray.io/v1", rj.APIVersion)
			assert.Equal(t, KindRayJob, rj.Kind)
			assert.Equal(t, "train", rj.Name)
			assert.Equal(t, "research", rj.Namespace)
			assert.Equal(t, ManagedBy, rj.Labels[LabelManagedBy], "gpudra jobs lists it")
			assert.Equal(t, "python train.py", rj.Spec.Entrypoint)
			assert.True(t, rj.Spec.ShutdownAfterJobFinishes, "the cluster, and its claims, go when the job ends")

			gang := ptr.To(tc.workers + 1)
			head := rj.Spec.RayClusterSpec.HeadGroupSpec
			assert.Equal(t, "0", head.RayStartParams["num-gpus"])
			assert.Empty(t, head.Template.Spec.ResourceClaims, "the head holds no GPU")
			require.Len(t, rj.Spec.RayClusterSpec.WorkerGroupSpecs, 1)
			w := rj.Spec.RayClusterSpec.WorkerGroupSpecs[0]
			assert.Equal(t, tc.workers, *w.Replicas)
			assert.Equal(t, tc.workers, *w.MinReplicas, "a gang's size is fixed")
			assert.Equal(t, tc.workers, *w.MaxReplicas, "a gang's size is fixed")
			assert.Equal(t, map[string]string{"num-gpus": resourceCount(tc.perPod)}, w.RayStartParams, "Ray sees the claimed GPUs")
			assert.Equal(t, tc.perPod, o.Template.Spec.Spec.Devices.Requests[0].Exactly.Count)
			require.Len(t, w.Template.Spec.ResourceClaims, 1)
			assert.Equal(t, TemplateName("train"), *w.Template.Spec.ResourceClaims[0].ResourceClaimTemplateName)
			assert.Equal(t, []corev1.ResourceClaim{{Name: ClaimName}}, w.Template.Spec.Containers[0].Resources.Claims)
			for _, tmpl := range []corev1.PodTemplateSpec{head.Template, w.Template} {
				assert.Equal(t, "train", tmpl.Labels[gpudrav1.LabelGang], "head and workers: one gang")
				assert.Equal(t, "train", tmpl.Labels[LabelJob])
				assert.Equal(t, resourceCount(int64(*gang)), tmpl.Annotations[gpudrav1.AnnotationGangSize], "the head and every worker")
				assert.Equal(t, "cuda", tmpl.Spec.Containers[0].Image)
				assert.Empty(t, tmpl.Spec.Containers[0].Command, "KubeRay runs ray start; the command is the entrypoint")
				assert.Empty(t, tmpl.Spec.RestartPolicy, "KubeRay's to decide")
			}
			if tc.check != nil {
				tc.check(t, o)
			}
			kind, apiVersion := "RayJob", "ray.io/v1"
			u, err := runtime.DefaultUnstructuredConverter.ToUnstructured(rj)
			require.NoError(t, err)
			assert.Equal(t, kind, u["kind"])
			assert.Equal(t, apiVersion, u["apiVersion"])
		})
	}
}

func resourceCount(n int64) string { return strconv.FormatInt(n, 10) }

func TestShellJoin(t *testing.T) {
	for in, want := range map[string]struct {
		args []string
		line string
	}{
		"plain":        {[]string{"python", "train.py", "--lr=0.1"}, "python train.py --lr=0.1"},
		"spaces":       {[]string{"echo", "a b"}, "echo 'a b'"},
		"quote":        {[]string{"echo", "it's"}, `echo 'it'"'"'s'`},
		"shell syntax": {[]string{"echo", "$HOME;rm"}, "echo '$HOME;rm'"},
		"empty":        {[]string{"echo", ""}, "echo ''"},
	} {
		assert.Equal(t, want.line, shellJoin(want.args), in)
	}
}

// rayServed makes the fake discovery serve ray.io/v1 RayJobs.
func rayServed(kube *fake.Clientset) {
	kube.Discovery().(*fakediscovery.FakeDiscovery).Resources = []*metav1.APIResourceList{{
		GroupVersion: "ray.io/v1", APIResources: []metav1.APIResource{{Name: "rayjobs", Kind: "RayJob", Namespaced: true}}}}
}

// TestSubmitRayRefusedWhereRayJobIsNotServed: without KubeRay's CRD the
// submission is refused before anything is created; a discovery that
// failed otherwise says it could not tell, not that RayJob is absent.
func TestSubmitRayRefusedWhereRayJobIsNotServed(t *testing.T) {
	ctx := context.Background()
	for name, tc := range map[string]struct {
		setup func(*fake.Clientset)
		want  string
	}{
		"not served": {func(*fake.Clientset) {}, "ray.io/v1 RayJob is not served on this cluster: install KubeRay"},
		"group without RayJobs": {func(k *fake.Clientset) {
			k.Discovery().(*fakediscovery.FakeDiscovery).Resources = []*metav1.APIResourceList{{GroupVersion: "ray.io/v1",
				APIResources: []metav1.APIResource{{Name: "rayclusters"}}}}
		}, "ray.io/v1 RayJob is not served"},
		"discovery failed": {func(k *fake.Clientset) {
			k.PrependReactor("get", "resource", func(clienttesting.Action) (bool, runtime.Object, error) {
				return true, nil, errors.New("connection refused")
			})
		}, "could not tell whether ray.io/v1 RayJob is served on this cluster"},
	} {
		t.Run(name, func(t *testing.T) {
			c, kube, dyn := fakeClient(t)
			tc.setup(kube)
			err := c.Submit(ctx, mustBuild(t, ray(nil)))
			require.ErrorContains(t, err, tc.want)
			nothingCreated(t, kube)
			l, lerr := dyn.Resource(RayJobs).Namespace("research").List(ctx, metav1.ListOptions{})
			require.NoError(t, lerr)
			assert.Empty(t, l.Items)
		})
	}
}

// TestSubmitListCancelRayJob: the RayJob is created with the template
// owned by it; gpudra jobs shows it with KubeRay's state and the devices
// of its workers; gpudra cancel deletes it and its template.
func TestSubmitListCancelRayJob(t *testing.T) {
	ctx := context.Background()
	c, kube, dyn := fakeClient(t)
	rayServed(kube)
	require.NoError(t, c.Submit(ctx, mustBuild(t, ray(nil))))
	rj, err := dyn.Resource(RayJobs).Namespace("research").Get(ctx, "train", metav1.GetOptions{})
	require.NoError(t, err, "the RayJob is created, not only its dry run")
	tmpl, err := kube.ResourceV1().ResourceClaimTemplates("research").Get(ctx, TemplateName("train"), metav1.GetOptions{})
	require.NoError(t, err)
	require.Len(t, tmpl.OwnerReferences, 1)
	assert.Equal(t, "RayJob", tmpl.OwnerReferences[0].Kind)
	assert.Equal(t, "ray.io/v1", tmpl.OwnerReferences[0].APIVersion)
	assert.Equal(t, rj.GetUID(), tmpl.OwnerReferences[0].UID)

	require.NoError(t, unstructured.SetNestedField(rj.Object, "Running", "status", "jobDeploymentStatus"))
	require.NoError(t, unstructured.SetNestedField(rj.Object, "RUNNING", "status", "jobStatus"))
	_, err = dyn.Resource(RayJobs).Namespace("research").Update(ctx, rj, metav1.UpdateOptions{})
	require.NoError(t, err)
	for _, p := range []*corev1.Pod{rayPod("train-head-x", false), rayPod("train-gpus-worker-y", true)} {
		_, err := kube.CoreV1().Pods("research").Create(ctx, p, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	_, err = kube.ResourceV1().ResourceClaims("research").Create(ctx, allocatedClaim("train-gpus-worker-y-gpus-abc", "node-a", "gpu-3", "gpu-4"), metav1.CreateOptions{})
	require.NoError(t, err)

	jobs, notes, err := c.List(ctx, "research")
	require.NoError(t, err)
	assert.Empty(t, notes)
	require.Len(t, jobs, 1)
	assert.Equal(t, KindRayJob, jobs[0].Kind)
	assert.Equal(t, StateRunning, jobs[0].State)
	assert.Equal(t, "2/2", jobs[0].Pods, "the head and the worker")
	assert.Equal(t, "RayJob Running, job RUNNING", jobs[0].Reason)
	assert.Equal(t, []string{"node-a/gpu-3", "node-a/gpu-4"}, jobs[0].Devices)

	// KubeRay's submitter Job has the RayJob's name, and not submit's
	// label: cancel finds the RayJob behind it.
	_, err = kube.BatchV1().Jobs("research").Create(ctx, &batchv1.Job{ObjectMeta: metav1.ObjectMeta{Name: "train", Namespace: "research",
		Labels: map[string]string{"ray.io/originated-from-crd": "RayJob"}}}, metav1.CreateOptions{})
	require.NoError(t, err)
	require.NoError(t, c.Cancel(ctx, "research", "train"))
	require.NoError(t, kube.BatchV1().Jobs("research").Delete(ctx, "train", metav1.DeleteOptions{}), "the submitter Job is KubeRay's to delete, not cancel's")
	_, err = dyn.Resource(RayJobs).Namespace("research").Get(ctx, "train", metav1.GetOptions{})
	require.Error(t, err, "cancel deletes the RayJob")
	nothingCreated(t, kube)
	require.ErrorContains(t, c.Cancel(ctx, "research", "train"), "job research/train: not found")
}

func rayPod(name string, worker bool) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "research",
		Labels: map[string]string{LabelManagedBy: ManagedBy, LabelJob: "train", gpudrav1.LabelGang: "train"}},
		Spec: corev1.PodSpec{NodeName: "node-a"}, Status: corev1.PodStatus{Phase: corev1.PodRunning}}
	if worker {
		p.Status.ResourceClaimStatuses = []corev1.PodResourceClaimStatus{{Name: ClaimName, ResourceClaimName: ptr.To(name + "-gpus-abc")}}
	}
	return p
}

func allocatedClaim(name, node string, devices ...string) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "research"},
		Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{}}}
	for _, d := range devices {
		c.Status.Allocation.Devices.Results = append(c.Status.Allocation.Devices.Results,
			resourceapi.DeviceRequestAllocationResult{Request: ClaimName, Driver: "gpu.gpudra.dev", Pool: node, Device: d})
	}
	return c
}

// TestRayJobStatus: KubeRay's words become gpudra jobs' states.
func TestRayJobStatus(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	waiting := rayPod("train-head-x", false)
	waiting.Spec.NodeName, waiting.Status.Phase = "", corev1.PodPending
	waiting.Status.Conditions = []corev1.PodCondition{{Type: gangCondition, Status: corev1.ConditionFalse, Reason: "WaitingForDevices",
		Message: "position 1 in queue default: waiting for 16 free devices"}}
	for name, tc := range map[string]struct {
		deployment, job, reason string
		pods                    []*corev1.Pod
		state, wantReason       string
	}{
		"gang waits":      {deployment: "Initializing", pods: []*corev1.Pod{waiting}, state: StateWaiting, wantReason: "WaitingForDevices"},
		"running":         {deployment: "Running", job: "RUNNING", pods: []*corev1.Pod{rayPod("h", false)}, state: StateRunning, wantReason: "RayJob Running, job RUNNING"},
		"succeeded":       {deployment: "Complete", job: "SUCCEEDED", state: StateSucceeded},
		"job failed":      {deployment: "Complete", job: "FAILED", state: StateFailed, wantReason: "JobFAILED"},
		"deployment fail": {deployment: "Failed", reason: "DeadlineExceeded", state: StateFailed, wantReason: "DeadlineExceeded"},
	} {
		t.Run(name, func(t *testing.T) {
			o := mustBuild(t, ray(func(s *Spec) { s.GPUs = 16 }))
			u, err := runtime.DefaultUnstructuredConverter.ToUnstructured(o.RayJob)
			require.NoError(t, err)
			rj := &unstructured.Unstructured{Object: u}
			rj.SetCreationTimestamp(metav1.NewTime(now.Add(-time.Minute)))
			for k, v := range map[string]string{"jobDeploymentStatus": tc.deployment, "jobStatus": tc.job, "reason": tc.reason} {
				if v != "" {
					require.NoError(t, unstructured.SetNestedField(rj.Object, v, "status", k))
				}
			}
			st := RayJobStatus(rj, tc.pods, nil, now)
			assert.Equal(t, tc.state, st.State)
			assert.Equal(t, tc.wantReason, st.Reason)
			assert.Equal(t, KindRayJob, st.Kind)
			assert.Equal(t, time.Minute, st.Age)
			assert.Regexp(t, `/3$`, st.Pods, "a head and two workers of 8")
		})
	}
}
