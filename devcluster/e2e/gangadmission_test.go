package e2e

// What a tenant may do to a gang on the Workload API path, with the default
// `edit` role (docs/security.md): not hand it to kube-scheduler itself
// (a PodGroup or Workload of its own), and not make a gang kube-scheduler
// would refuse for good (pods of differing priorities).

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	authorizationv1 "k8s.io/api/authorization/v1"
	v1 "k8s.io/api/core/v1"
	schedulingv1beta1 "k8s.io/api/scheduling/v1beta1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/devcluster/e2e/tenant"
	"github.com/gpudra/gpudra/pkg/controller"
	"github.com/gpudra/gpudra/pkg/controller/gang"
)

// editTenant is a client for user, who holds the default `edit` role in ns
// (as aggregated in a cluster) and nothing else.
func editTenant(t *testing.T, ns, user string) kubernetes.Interface {
	t.Helper()
	cfg, err := tenant.Grant(context.Background(), cluster, ns, user, "edit")
	require.NoError(t, err)
	c, err := kubernetes.NewForConfig(cfg)
	require.NoError(t, err)
	return c
}

// TestTenantCannotHandItsGangToTheScheduler: on the Workload API path a
// waiting gang's pods name its PodGroup, and kube-scheduler places them as
// soon as one of that name exists. A tenant with the default `edit` role,
// which RBAC lets create PodGroups and Workloads, may not create its gang's
// (with or without gpudra's label), nor any other (kube-scheduler finds a
// PodGroup by name alone), nor change the label of the controller's own.
// In a namespace its administrator opens, its own are allowed, gpudra's
// label still not. The controller's own PodGroup is made as before.
func TestTenantCannotHandItsGangToTheScheduler(t *testing.T) {
	onGangPath(t, controller.GangModeWorkload)
	ctx := context.Background()
	ns := namespace(t)
	const user = "tenant-a"
	tenant := editTenant(t, ns, user)
	// RBAC allows it (once the authorizer has seen the binding): the
	// policy is what refuses.
	for _, resource := range []string{"podgroups", "workloads"} {
		require.Eventually(t, func() bool {
			review, err := tenant.AuthorizationV1().SelfSubjectAccessReviews().Create(ctx, &authorizationv1.SelfSubjectAccessReview{
				Spec: authorizationv1.SelfSubjectAccessReviewSpec{ResourceAttributes: &authorizationv1.ResourceAttributes{
					Namespace: ns, Verb: "create", Group: "scheduling.k8s.io", Resource: resource}}}, metav1.CreateOptions{})
			return err == nil && review.Status.Allowed
		}, 20*time.Second, 100*time.Millisecond, "RBAC: `edit` may create %s", resource)
	}

	// A gang of three with two pods: it waits for its third, held back.
	create(t, ns, gpus("one-gpu", 1), gangPod("skip-0", "skip", 3, "one-gpu", nil), gangPod("skip-1", "skip", 3, "one-gpu", nil))
	gangCondition(t, ns, "skip-0", v1.ConditionFalse, gang.ReasonWaitingForPods)

	dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
	gangPolicy := schedulingv1beta1.PodGroupSchedulingPolicy{Gang: &schedulingv1beta1.GangSchedulingPolicy{MinCount: 2}}
	tenantPodGroup := func(name string, lbls map[string]string) error {
		_, err := tenant.SchedulingV1beta1().PodGroups(ns).Create(ctx, &schedulingv1beta1.PodGroup{
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: lbls}, Spec: schedulingv1beta1.PodGroupSpec{SchedulingPolicy: gangPolicy}}, dry)
		return err
	}
	tenantWorkload := func(name string, lbls map[string]string) error {
		_, err := tenant.SchedulingV1beta1().Workloads(ns).Create(ctx, &schedulingv1beta1.Workload{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: lbls},
			Spec: schedulingv1beta1.WorkloadSpec{PodGroupTemplates: []schedulingv1beta1.PodGroupTemplate{{Name: "gang", SchedulingPolicy: gangPolicy}}}}, dry)
		return err
	}
	claimed := map[string]string{gpudrav1.LabelGang: "skip"}
	const skips = "hands pods to kube-scheduler's gang scheduling, past gpudra's queue"
	refusedWith(t, "a PodGroup "+skips, func() error { return tenantPodGroup("skip", nil) })
	refusedWith(t, "only gpudra-controller creates PodGroups labelled gpudra.dev/gang", func() error { return tenantPodGroup("skip", claimed) })
	refusedWith(t, "a Workload "+skips, func() error { return tenantWorkload("skip", nil) })
	refusedWith(t, "only gpudra-controller creates Workloads labelled gpudra.dev/gang", func() error { return tenantWorkload("skip", claimed) })
	refusedWith(t, "not PodGroup elsewhere by "+user, func() error { return tenantPodGroup("elsewhere", nil) })

	// The controller's own, for a gang that fits: made, and its label
	// stays as it is; other changes to it stay allowed.
	create(t, ns, nil, gangPod("own-0", "own", 1, "one-gpu", nil))
	waitRunning(t, ns, "own-0")
	pg := podGroup(t, ns, "own")
	assert.Equal(t, "own", pg.Labels[gpudrav1.LabelGang])
	patch := func(ops ...map[string]any) error {
		b, err := json.Marshal(ops)
		require.NoError(t, err)
		_, err = tenant.SchedulingV1beta1().PodGroups(ns).Patch(ctx, "own", types.JSONPatchType, b, metav1.PatchOptions{DryRun: []string{metav1.DryRunAll}})
		return err
	}
	refusedWith(t, "only gpudra-controller sets the label gpudra.dev/gang of a PodGroup", func() error {
		return patch(map[string]any{"op": "remove", "path": "/metadata/labels/gpudra.dev~1gang"})
	})
	refusedWith(t, "only gpudra-controller sets the label gpudra.dev/gang of a PodGroup", func() error {
		return patch(map[string]any{"op": "replace", "path": "/metadata/labels/gpudra.dev~1gang", "value": "skip"})
	})
	require.NoError(t, patch(map[string]any{"op": "add", "path": "/metadata/labels/team", "value": "a"}), "other changes stay allowed")

	// An administrator leaves the namespace's PodGroups to its users:
	// theirs are allowed, gpudra's label still is not.
	nsObj, err := cluster.Client.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
	require.NoError(t, err)
	nsObj.Labels = labels.Merge(nsObj.Labels, map[string]string{"gpudra.dev/own-podgroups": "true"})
	_, err = cluster.Client.CoreV1().Namespaces().Update(ctx, nsObj, metav1.UpdateOptions{})
	require.NoError(t, err)
	refusedWith(t, "only gpudra-controller creates PodGroups labelled gpudra.dev/gang", func() error { return tenantPodGroup("skip", claimed) })
	require.Eventually(t, func() bool { return tenantPodGroup("theirs", nil) == nil && tenantWorkload("theirs", nil) == nil },
		20*time.Second, 200*time.Millisecond, "the tenant's own PodGroup and Workload in a namespace left to its users")
}

// TestGangPodOfAnotherPriorityRefused: kube-scheduler places no pod of a
// PodGroup whose pods' priorities differ; the webhook refuses such a gang
// pod, naming the gang, both priorities and the other pod.
func TestGangPodOfAnotherPriorityRefused(t *testing.T) {
	onGangPath(t, controller.GangModeWorkload)
	ctx := context.Background()
	ns := namespace(t)
	prio := &schedulingPriorityClass{name: "gpudra-e2e-gang-high", value: 1000}
	prio.create(t)
	high := func(p *v1.Pod) { p.Spec.PriorityClassName = prio.name }
	// A gang of three: it waits for its third pod.
	create(t, ns, gpus("one-gpu", 1), gangPod("prio-0", "prio", 3, "one-gpu", high))
	dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
	refusedWith(t, `gang "prio": this pod's priority 0 (no PriorityClass) differs from 1000 (PriorityClass "gpudra-e2e-gang-high") of the gang's pod prio-0`,
		func() error {
			_, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, gangPod("prio-1", "prio", 3, "one-gpu", nil), dry)
			return err
		})
	_, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, gangPod("prio-1", "prio", 3, "one-gpu", high), dry)
	assert.NoError(t, err, "a pod of the gang's priority")
	_, err = cluster.Client.CoreV1().Pods(ns).Create(ctx, gangPod("other-0", "other", 2, "one-gpu", nil), dry)
	assert.NoError(t, err, "another gang's pod, of another priority")
}
