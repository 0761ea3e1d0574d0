package e2e

// Who may open a namespace's PodGroups to its users (the namespace label
// gpudra.dev/own-podgroups), and which PodGroup a pod may join
// (spec.schedulingGroup), under the chart's real policies and webhook
// (docs/security.md).

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	authorizationv1 "k8s.io/api/authorization/v1"
	v1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	restclient "k8s.io/client-go/rest"

	"github.com/gpudra/gpudra/pkg/controller"
)

// namespaceOperator is a client for user, whom a ClusterRole lets create,
// update and patch every namespace (as a namespace-provisioning operator,
// or a multi-tenancy framework's tenant owner, may), and nothing else.
func namespaceOperator(t *testing.T, user string) kubernetes.Interface {
	t.Helper()
	ctx := context.Background()
	name := "e2e-namespace-operator-" + user
	_, err := cluster.Client.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: name},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"namespaces"}, Verbs: []string{"get", "create", "update", "patch"}}}},
		metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = cluster.Client.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: name},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: name},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: user}}}, metav1.CreateOptions{})
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = cluster.Client.RbacV1().ClusterRoleBindings().Delete(context.Background(), name, metav1.DeleteOptions{})
		_ = cluster.Client.RbacV1().ClusterRoles().Delete(context.Background(), name, metav1.DeleteOptions{})
	})
	cfg := restclient.CopyConfig(cluster.RESTConfig)
	cfg.Impersonate = restclient.ImpersonationConfig{UserName: user, Groups: []string{"system:authenticated"}}
	c, err := kubernetes.NewForConfig(cfg)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		review, err := c.AuthorizationV1().SelfSubjectAccessReviews().Create(ctx, &authorizationv1.SelfSubjectAccessReview{
			Spec: authorizationv1.SelfSubjectAccessReviewSpec{ResourceAttributes: &authorizationv1.ResourceAttributes{
				Verb: "patch", Resource: "namespaces"}}}, metav1.CreateOptions{})
		return err == nil && review.Status.Allowed
	}, 20*time.Second, 100*time.Millisecond, "RBAC: %s may patch namespaces", user)
	return c
}

// TestOwnPodGroupsLabelGuarded: the namespace label gpudra.dev/own-podgroups
// opens a namespace's PodGroups, and the way past the queue, to its users.
// A user whom RBAC lets update namespaces may not set, change or remove it
// (on a namespace it updates or creates); its other changes stay allowed; a
// cluster administrator may.
func TestOwnPodGroupsLabelGuarded(t *testing.T) {
	onGangPath(t, controller.GangModeWorkload)
	ctx := context.Background()
	ns := namespace(t)
	const user = "namespace-operator"
	operator := namespaceOperator(t, user)
	const label = "gpudra.dev/own-podgroups"
	dry := metav1.PatchOptions{DryRun: []string{metav1.DryRunAll}}
	patchLabels := func(c kubernetes.Interface, opts metav1.PatchOptions, labels map[string]any) error {
		b, err := json.Marshal(map[string]any{"metadata": map[string]any{"labels": labels}})
		require.NoError(t, err)
		_, err = c.CoreV1().Namespaces().Patch(ctx, ns, types.MergePatchType, b, opts)
		return err
	}
	const refused = "only a cluster administrator sets the label " + label + " of a namespace"

	refusedWith(t, refused+" (it leaves the namespace's PodGroups and Workloads, and with them the way past gpudra's queue, "+
		"to its users: docs/security.md): "+user+" may not set it to 'true' on namespace "+ns, func() error {
		return patchLabels(operator, dry, map[string]any{label: "true"})
	})
	refusedWith(t, user+" may not set it to 'true' on namespace "+ns+"-new", func() error {
		_, err := operator.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns + "-new",
			Labels: map[string]string{label: "true"}}}, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err
	})
	assert.NoError(t, patchLabels(operator, dry, map[string]any{"team": "a"}), "the operator's other changes stay allowed")

	// A cluster administrator (system:masters) sets it; the operator may
	// neither change nor remove it, but still change the rest.
	require.NoError(t, patchLabels(cluster.Client, metav1.PatchOptions{}, map[string]any{label: "true"}), "a cluster administrator sets it")
	refusedWith(t, user+" may not change it from 'true' to 'false' on namespace "+ns, func() error {
		return patchLabels(operator, dry, map[string]any{label: "false"})
	})
	refusedWith(t, user+" may not remove it on namespace "+ns, func() error {
		return patchLabels(operator, dry, map[string]any{label: nil})
	})
	assert.NoError(t, patchLabels(operator, dry, map[string]any{"team": "b"}), "the operator's other changes stay allowed")
	assert.NoError(t, patchLabels(cluster.Client, metav1.PatchOptions{}, map[string]any{label: nil}), "a cluster administrator removes it")
}

// TestPodMayNotJoinAnotherGangsPodGroup: on the Workload API path a pod
// joins a PodGroup by naming it (spec.schedulingGroup). A tenant's pod may
// not join a gang's: neither one gpudra-controller made for a running gang
// nor, before it is made, a waiting gang's; the webhook refuses it, naming
// the PodGroup and the gang. The gang's own pods, and a pod naming a
// PodGroup that is no gang's, are admitted.
func TestPodMayNotJoinAnotherGangsPodGroup(t *testing.T) {
	onGangPath(t, controller.GangModeWorkload)
	ctx := context.Background()
	ns := namespace(t)
	tenant := editTenant(t, ns, "tenant-b")
	create(t, ns, gpus("one-gpu", 1), gangPod("run-0", "run", 1, "one-gpu", nil), gangPod("wait-0", "wait", 3, "one-gpu", nil))
	waitRunning(t, ns, "run-0")
	assert.Equal(t, "run", podGroup(t, ns, "run").Labels["gpudra.dev/gang"])
	gangCondition(t, ns, "wait-0", v1.ConditionFalse, "")

	dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
	joining := func(name, group string, labels map[string]string) error {
		p := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels, Annotations: map[string]string{"gpudra.dev/gang-size": "3"}},
			Spec: v1.PodSpec{Containers: []v1.Container{{Name: "c", Image: "registry.k8s.io/pause:3.10"}},
				SchedulingGroup: &v1.PodSchedulingGroup{PodGroupName: &group}}}
		_, err := tenant.CoreV1().Pods(ns).Create(ctx, p, dry)
		return err
	}
	refusedWith(t, `PodGroup "run" is gang "run"'s (gpudra-controller made it for that gang): kube-scheduler places its pods together, `+
		`and a pod of no gang may not join it; only the gang's pods (label gpudra.dev/gang=run) name it`, func() error {
		return joining("rider", "run", nil)
	})
	refusedWith(t, `PodGroup "wait" is gang "wait"'s (gpudra-controller makes it for that gang's pods, such as wait-0, once its queue lets the gang go)`,
		func() error { return joining("rider", "wait", nil) })
	refusedWith(t, `PodGroup "run" is gang "run"'s (gpudra-controller made it for that gang): kube-scheduler places its pods together, `+
		`and a pod of gang "wait" may not join it`, func() error {
		return joining("wait-1", "run", map[string]string{"gpudra.dev/gang": "wait"})
	})
	assert.NoError(t, joining("wait-1", "wait", map[string]string{"gpudra.dev/gang": "wait"}), "the gang's own pod")
	assert.NoError(t, joining("mine", "mine", nil), "a PodGroup that is no gang's")
}
