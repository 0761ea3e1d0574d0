package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/pkg/controller"
	"github.com/gpudra/gpudra/pkg/controller/gang"
)

// failOver stops the leading controller replica, waits for the other to
// take the lease, and starts a replacement follower (as the Deployment
// would); between stop and takeover, before returns, nobody leads.
func failOver(t *testing.T, between func()) {
	t.Helper()
	ctx := context.Background()
	var leader string
	require.Eventually(t, func() bool { leader = leaseHolder(ctx); return leader != "" }, 30*time.Second, 100*time.Millisecond)
	var stop, other *devcluster.Controller
	for _, r := range cluster.Controllers() {
		if r.Name == leader {
			stop = r
		} else {
			other = r
		}
	}
	require.NotNil(t, stop, "leader %q is one of the replicas", leader)
	require.NotNil(t, other)
	require.NoError(t, cluster.StopController(stop))
	if between != nil {
		between()
	}
	require.Eventually(t, func() bool { return leaseHolder(ctx) == other.Name }, 2*devcluster.ControllerLeaseDuration, 50*time.Millisecond,
		"the other replica leads")
	_, err := cluster.StartController(stop.Name + "-next")
	require.NoError(t, err)
}

// templateClaim waits for the claim the claim controller made for a pod's only
// claim from its template.
func templateClaim(t *testing.T, ns, pod string) *resourceapi.ResourceClaim {
	t.Helper()
	var cl *resourceapi.ResourceClaim
	require.NoError(t, wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		p, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, pod, metav1.GetOptions{})
		if err != nil || len(p.Status.ResourceClaimStatuses) == 0 || p.Status.ResourceClaimStatuses[0].ResourceClaimName == nil {
			return false, nil
		}
		cl, err = cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, *p.Status.ResourceClaimStatuses[0].ResourceClaimName, metav1.GetOptions{})
		return err == nil, nil
	}), "pod %s/%s has its claim", ns, pod)
	return cl
}

// TestLeaderChangeMidGangAndRepair: issue 47's must-show. What the
// controller remembers of its writes lives on the claims, so a new leader
// (1) never takes back a released gang's claim in a repair, and (2) plans a
// gang the old leader left half written whole.
func TestLeaderChangeMidGangAndRepair(t *testing.T) {
	onGangPath(t, controller.GangModeGates)
	ctx := context.Background()

	t.Run("released gang claim survives the new leader repair", func(t *testing.T) {
		ns := namespace(t)
		// A gang of one, released (gpudra's gate lifted, its claim written)
		// whose pod no scheduler takes yet: another gate holds it, so no pod
		// uses the claim.
		member := gangPod("member", "released", 1, "one-gpu", func(p *v1.Pod) {
			pinned(nomigNode)(p)
			p.Spec.SchedulingGates = append(p.Spec.SchedulingGates, v1.PodSchedulingGate{Name: "example.com/hold"})
		})
		create(t, ns, gpus("one-gpu", 1), member)
		var mine *resourceapi.ResourceClaim
		require.NoError(t, wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
			p, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, "member", metav1.GetOptions{})
			if err != nil || gatedByGpudra(p) || len(p.Status.ResourceClaimStatuses) == 0 {
				return false, nil
			}
			mine, err = cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, *p.Status.ResourceClaimStatuses[0].ResourceClaimName, metav1.GetOptions{})
			return err == nil && mine.Status.Allocation != nil, nil
		}), "the gang is released on its written claim")
		require.Equal(t, "Gang/"+ns+"/released", mine.Annotations[gpudrav1.AnnotationAllocatedFor], "the write is remembered on the claim")

		failOver(t, nil)

		// A claim given the same device, as kube-scheduler did in
		// kubernetes#140053, allocated before it and used by nobody: by age
		// alone it would keep the device.
		allocatedLike(t, ns, "theirs", mine, 2*time.Minute)
		waitTakenBack(t, ns, "theirs", "the new leader takes the other claim back")
		kept, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, mine.Name, metav1.GetOptions{})
		require.NoError(t, err)
		require.NotNil(t, kept.Status.Allocation, "the released gang keeps its plan")
		assert.Equal(t, mine.Status.Allocation.Devices.Results, kept.Status.Allocation.Devices.Results)

		// The kept device is fenced from kube-scheduler until the claim ends.
		fences := func() []string {
			list, err := cluster.Client.ResourceV1().DeviceTaintRules().List(ctx, metav1.ListOptions{LabelSelector: gang.LabelKeptFor + "=" + string(mine.UID)})
			require.NoError(t, err)
			var out []string
			for _, r := range list.Items {
				out = append(out, *r.Spec.DeviceSelector.Device)
			}
			return out
		}
		assert.Equal(t, []string{mine.Status.Allocation.Devices.Results[0].Device}, fences())
		require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(ctx, "member", metav1.DeleteOptions{GracePeriodSeconds: ptr[int64](0)}))
		waitPodGone(t, ns, "member")
		assert.Eventually(t, func() bool { return len(fences()) == 0 }, 30*time.Second, 200*time.Millisecond, "lifted once its claim ended")
	})

	t.Run("half-written gang planned whole by the new leader", func(t *testing.T) {
		ns := namespace(t)
		mutate := func(p *v1.Pod) { pinned(nomigNode)(p) }
		create(t, ns, gpus("one-gpu", 1), gangPod("a", "half", 2, "one-gpu", mutate))
		a := templateClaim(t, ns, "a")
		// What a leader leaves when it stops between the gang's two claim
		// writes: a's claim written for the gang (annotations, then the
		// allocation), b's not.
		at := metav1.NewTime(time.Now().Add(-time.Minute)).Rfc3339Copy()
		a.Annotations = map[string]string{gpudrav1.AnnotationAllocatedFor: "Gang/" + ns + "/half", gpudrav1.AnnotationAllocatedAt: at.UTC().Format(time.RFC3339)}
		a.Finalizers = append(a.Finalizers, resourceapi.Finalizer)
		a, err := cluster.Client.ResourceV1().ResourceClaims(ns).Update(ctx, a, metav1.UpdateOptions{})
		require.NoError(t, err)
		a.Status.Allocation = &resourceapi.AllocationResult{
			Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{{
				Request: "gpu", Driver: "gpu.gpudra.dev", Pool: nomigNode, Device: "gpu-7"}}},
			NodeSelector: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchFields: []v1.NodeSelectorRequirement{{
				Key: "metadata.name", Operator: v1.NodeSelectorOpIn, Values: []string{nomigNode}}}}}},
			AllocationTimestamp: &at,
		}
		_, err = cluster.Client.ResourceV1().ResourceClaims(ns).UpdateStatus(ctx, a, metav1.UpdateOptions{})
		require.NoError(t, err)

		// The leader changes, and the gang's second pod comes meanwhile.
		failOver(t, func() { create(t, ns, nil, gangPod("b", "half", 2, "one-gpu", mutate)) })

		waitRunning(t, ns, "a")
		waitRunning(t, ns, "b")
		got, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, a.Name, metav1.GetOptions{})
		require.NoError(t, err)
		require.NotNil(t, got.Status.Allocation)
		assert.NotEqual(t, at.UTC().Format(time.RFC3339), got.Annotations[gpudrav1.AnnotationAllocatedAt],
			"the old leader's write was taken back and the gang planned whole, not planned around it")
		b := templateClaim(t, ns, "b")
		for _, cl := range []*resourceapi.ResourceClaim{got, b} {
			assert.Equal(t, "Gang/"+ns+"/half", cl.Annotations[gpudrav1.AnnotationAllocatedFor], "claim %s written by the new leader for the gang", cl.Name)
		}
		doubles, err := doublyAllocated(ctx)
		require.NoError(t, err)
		assert.Empty(t, doubles)
	})
}
