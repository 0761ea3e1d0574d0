package dashboard

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	fakediscovery "k8s.io/client-go/discovery/fake"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/kueue"
)

func obj(t *testing.T, y string) *unstructured.Unstructured {
	t.Helper()
	u := &unstructured.Unstructured{}
	require.NoError(t, yaml.Unmarshal([]byte(y), &u.Object))
	return u
}

// As KubeRay v1.5 writes them: the RayJob, the RayCluster it owns.
const (
	rayJobYAML = `
apiVersion: ray.io/v1
kind: RayJob
metadata: {name: train, namespace: research, uid: rj-1}
spec: {entrypoint: python train.py}
status: {jobDeploymentStatus: Running, jobStatus: RUNNING, rayClusterName: train-abcde}
`
	rayJobClusterYAML = `
apiVersion: ray.io/v1
kind: RayCluster
metadata:
  name: train-abcde
  namespace: research
  uid: rc-1
  ownerReferences: [{apiVersion: ray.io/v1, kind: RayJob, name: train, uid: rj-1, controller: true}]
status: {state: ready}
`
	rayClusterYAML = `
apiVersion: ray.io/v1
kind: RayCluster
metadata: {name: serve, namespace: research, uid: rc-2}
status: {state: ready}
`
	// Kueue v0.17's Workload of a Job, pending for quota, and of a RayJob,
	// admitted.
	pendingWorkloadYAML = `
apiVersion: kueue.x-k8s.io/v1beta2
kind: Workload
metadata:
  name: job-big-3f2a1
  namespace: team-b
  ownerReferences: [{apiVersion: batch/v1, kind: Job, name: big, uid: job-1, controller: true}]
spec:
  queueName: team-b
  active: true
  podSets: [{name: main, count: 1}]
status:
  conditions:
  - type: QuotaReserved
    status: "False"
    reason: Pending
    message: "couldn't assign flavors to pod set main: insufficient unused quota for gpu.gpudra.dev in flavor default, 8 more needed"
    lastTransitionTime: "2026-03-01T12:00:00Z"
`
	admittedWorkloadYAML = `
apiVersion: kueue.x-k8s.io/v1beta2
kind: Workload
metadata:
  name: rayjob-train-9c8b7
  namespace: research
  ownerReferences: [{apiVersion: ray.io/v1, kind: RayJob, name: train, uid: rj-1, controller: true}]
spec: {queueName: research}
status:
  admission: {clusterQueue: team-a-cq}
  conditions:
  - {type: QuotaReserved, status: "True", reason: QuotaReserved, message: "Quota reserved in ClusterQueue team-a-cq"}
  - {type: Admitted, status: "True", reason: Admitted, message: "The workload is admitted"}
`
	localQueueYAML = `
apiVersion: kueue.x-k8s.io/v1beta2
kind: LocalQueue
metadata: {name: team-b, namespace: team-b}
spec: {clusterQueue: team-b-cq}
`
)

func rayPod(name, cluster, role, group, node, claim string) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "research",
		Labels: map[string]string{rayClusterLabel: cluster, rayNodeTypeLabel: role, rayGroupLabel: group}},
		Spec: corev1.PodSpec{NodeName: node}, Status: corev1.PodStatus{Phase: corev1.PodRunning}}
	if claim != "" {
		p.Status.ResourceClaimStatuses = []corev1.PodResourceClaimStatus{{Name: "gpus", ResourceClaimName: ptr.To(claim)}}
	}
	return p
}

func TestWorkloads(t *testing.T) {
	claims := map[string]*resourceapi.ResourceClaim{
		"research/w-0-gpus-x": {ObjectMeta: metav1.ObjectMeta{Name: "w-0-gpus-x", Namespace: "research"},
			Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{
				Results: []resourceapi.DeviceRequestAllocationResult{{Pool: "dgx-1", Device: "gpu-0"}, {Pool: "dgx-1", Device: "gpu-1"}}}}}},
	}
	head := rayPod("train-abcde-head-q", "train-abcde", "head", "headgroup", "dgx-1", "")
	worker := rayPod("train-abcde-gpus-worker-z", "train-abcde", "worker", "gpus", "dgx-1", "w-0-gpus-x")
	serveHead := rayPod("serve-head-a", "serve", "head", "headgroup", "", "")
	serveHead.Status.Phase = corev1.PodPending
	jobPod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "big-0-xyz", Namespace: "team-b",
		OwnerReferences: []metav1.OwnerReference{{APIVersion: "batch/v1", Kind: "Job", Name: "big", UID: types.UID("job-1"), Controller: ptr.To(true)}}},
		Status: corev1.PodStatus{Phase: corev1.PodPending}}
	other := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "lonely", Namespace: "research"}}

	for name, tc := range map[string]struct {
		in   WorkloadInputs
		pods []*corev1.Pod
		want []Workload
	}{
		"nothing served: no group": {pods: []*corev1.Pod{head, other}},
		"a RayJob and its cluster are one group, head first, with the worker's devices": {
			in:   WorkloadInputs{RayJobs: []*unstructured.Unstructured{obj(t, rayJobYAML)}, RayClusters: []*unstructured.Unstructured{obj(t, rayJobClusterYAML)}},
			pods: []*corev1.Pod{worker, other, head},
			want: []Workload{{Kind: "RayJob", Namespace: "research", Name: "train", State: "Running/RUNNING", RayCluster: "train-abcde", ClusterState: "ready",
				Kubectl: "kubectl get rayjob -n research train -o yaml",
				Pods: []WorkloadPod{
					{Name: head.Name, Role: "head", Group: "headgroup", Node: "dgx-1", Phase: "Running"},
					{Name: worker.Name, Role: "worker", Group: "gpus", Node: "dgx-1", Phase: "Running",
						Claims: []WorkloadClaim{{Name: "w-0-gpus-x", Devices: []string{"dgx-1/gpu-0", "dgx-1/gpu-1"}}}},
				}}},
		},
		"a RayCluster of its own, and its unscheduled head": {
			in:   WorkloadInputs{RayClusters: []*unstructured.Unstructured{obj(t, rayClusterYAML)}},
			pods: []*corev1.Pod{serveHead},
			want: []Workload{{Kind: "RayCluster", Namespace: "research", Name: "serve", State: "ready", Kubectl: "kubectl get raycluster -n research serve -o yaml",
				Pods: []WorkloadPod{{Name: serveHead.Name, Role: "head", Group: "headgroup", Phase: "Pending"}}}},
		},
		"a RayJob Kueue admitted: its Kueue state on the RayJob's group": {
			in: WorkloadInputs{RayJobs: []*unstructured.Unstructured{obj(t, rayJobYAML)}, RayClusters: []*unstructured.Unstructured{obj(t, rayJobClusterYAML)},
				KueueWorkloads: []*unstructured.Unstructured{obj(t, admittedWorkloadYAML)}},
			want: []Workload{{Kind: "RayJob", Namespace: "research", Name: "train", State: "Running/RUNNING", RayCluster: "train-abcde", ClusterState: "ready",
				Kubectl: "kubectl get rayjob -n research train -o yaml", Pods: []WorkloadPod{},
				Kueue: &KueueStatus{Status: kueue.Status{Workload: "rayjob-train-9c8b7", LocalQueue: "research", ClusterQueue: "team-a-cq", State: KueueAdmitted},
					Kubectl: "kubectl get workloads.kueue.x-k8s.io -n research rayjob-train-9c8b7 -o yaml"}}},
		},
		"a Job Kueue holds pending: its pods, its ClusterQueue from the LocalQueue, and Kueue's reason": {
			in: WorkloadInputs{KueueWorkloads: []*unstructured.Unstructured{obj(t, pendingWorkloadYAML)},
				LocalQueues: []*unstructured.Unstructured{obj(t, localQueueYAML)}},
			pods: []*corev1.Pod{jobPod, other},
			want: []Workload{{Kind: "Job", Namespace: "team-b", Name: "big", Kubectl: "kubectl get job -n team-b big -o yaml",
				Pods: []WorkloadPod{{Name: "big-0-xyz", Phase: "Pending"}},
				Kueue: &KueueStatus{Status: kueue.Status{Workload: "job-big-3f2a1", LocalQueue: "team-b", ClusterQueue: "team-b-cq", State: KueuePending, Reason: "Pending",
					Message: "couldn't assign flavors to pod set main: insufficient unused quota for gpu.gpudra.dev in flavor default, 8 more needed"},
					Kubectl: "kubectl get workloads.kueue.x-k8s.io -n team-b job-big-3f2a1 -o yaml"}}},
		},
	} {
		t.Run(name, func(t *testing.T) {
			assert.Equal(t, tc.want, workloads(tc.in, tc.pods, claims))
		})
	}
}

// TestClusterSourceEngines: KubeRay's and Kueue's objects are read only
// where discovery says they are served. Not served: no group and no note
// (most clusters run neither). Discovery failing otherwise: a note that
// it could not tell, never silence. Forbidden: a note. Served: the
// groups, from the informers.
func TestClusterSourceEngines(t *testing.T) {
	served := []*metav1.APIResourceList{
		{GroupVersion: "ray.io/v1", APIResources: []metav1.APIResource{{Name: "rayclusters", Namespaced: true}, {Name: "rayjobs", Namespaced: true}}},
		{GroupVersion: "kueue.x-k8s.io/v1beta2", APIResources: []metav1.APIResource{{Name: "workloads", Namespaced: true}, {Name: "localqueues", Namespaced: true}}},
	}
	for name, tc := range map[string]struct {
		resources []*metav1.APIResourceList
		setup     func(*fake.Clientset, *dynamicfake.FakeDynamicClient)
		notes     []string
		groups    []string
	}{
		"neither engine installed": {},
		"discovery fails": {setup: func(c *fake.Clientset, _ *dynamicfake.FakeDynamicClient) {
			c.PrependReactor("get", "resource", func(k8stesting.Action) (bool, runtime.Object, error) {
				return true, nil, apierrors.NewServiceUnavailable("etcd is slow")
			})
		}, notes: []string{
			"RayJobs: could not tell whether ray.io/v1 is served (discovery of ray.io/v1: etcd is slow): RayJobs are not shown as such",
			"Kueue Workloads: could not tell whether kueue.x-k8s.io/v1beta2 is served (discovery of kueue.x-k8s.io/v1beta2: etcd is slow): Kueue's admission and reasons are not shown",
		}},
		"served": {resources: served, groups: []string{"RayJob research/train", "Job team-b/big"}},
		"served, RayJobs forbidden": {resources: served, setup: func(_ *fake.Clientset, d *dynamicfake.FakeDynamicClient) {
			d.PrependReactor("list", "rayjobs", forbid("rayjobs", nil))
		}, notes: []string{"RayJobs (all namespaces): forbidden: RayJobs are not shown as such"},
			groups: []string{"RayCluster research/train-abcde", "Job team-b/big"}},
	} {
		t.Run(name, func(t *testing.T) {
			client := fake.NewClientset(testPod("team-b", "big-0", nil))
			client.Discovery().(*fakediscovery.FakeDiscovery).Resources = tc.resources
			var objs []runtime.Object
			for _, y := range []string{rayJobYAML, rayJobClusterYAML, pendingWorkloadYAML, localQueueYAML} {
				objs = append(objs, obj(t, y))
			}
			dyn := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), map[schema.GroupVersionResource]string{
				gpudrav1.GpuQueues: "GpuQueueList", gpudrav1.GpuReservations: "GpuReservationList",
				RayClusters: "RayClusterList", RayJobs: "RayJobList", KueueWorkloads: "WorkloadList", LocalQueues: "LocalQueueList"}, objs...)
			if tc.setup != nil {
				tc.setup(client, dyn)
			}
			src := NewClusterSource(ClusterConfig{Client: client, Dynamic: dyn, Debounce: 10 * time.Millisecond})
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- src.Run(ctx) }()
			defer func() { cancel(); require.NoError(t, <-done) }()
			v := waitSourceView(t, src, 5*time.Second, func(v *View) bool {
				return !slices.Contains(v.Notes, "reading the cluster...") && len(v.Workloads) == len(tc.groups)
			})
			var groups []string
			for _, w := range v.Workloads {
				groups = append(groups, w.Kind+" "+w.Namespace+"/"+w.Name)
			}
			assert.ElementsMatch(t, tc.groups, groups)
			var engineNotes []string
			for _, n := range v.Notes {
				if strings.Contains(n, "Ray") || strings.Contains(n, "Kueue") {
					engineNotes = append(engineNotes, n)
				}
			}
			for _, want := range tc.notes {
				assert.Contains(t, engineNotes, want)
			}
			if len(tc.notes) == 0 {
				assert.Empty(t, engineNotes, "an engine not installed is no note")
			}
		})
	}
}
