// Package tenant makes the e2e suites' tenants: users who hold, in one
// namespace, the default `edit` role (and any other ClusterRole an admin
// grants there, such as Kueue's kueue-batch-user-role) and nothing else.
package tenant

import (
	"bytes"
	"context"
	"fmt"
	"time"

	authorizationv1 "k8s.io/api/authorization/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	restclient "k8s.io/client-go/rest"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/pkg/submit/cli"
)

// Grant gives user, in namespace, the rules of the ClusterRoles (edit
// first), as a cluster aggregates them (devcluster runs no ClusterRole
// aggregation controller, so a Role holds the aggregated rules), and
// returns the user's client configuration.
func Grant(ctx context.Context, c *devcluster.Cluster, namespace, user string, clusterRoles ...string) (*restclient.Config, error) {
	rules, err := Rules(ctx, c.Client, clusterRoles...)
	if err != nil {
		return nil, err
	}
	// Granted again (after an admin aggregated more into edit), the Role
	// is brought up to date.
	role := user + "-roles"
	r := &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: role}, Rules: rules}
	if _, err := c.Client.RbacV1().Roles(namespace).Create(ctx, r, metav1.CreateOptions{}); apierrors.IsAlreadyExists(err) {
		_, err = c.Client.RbacV1().Roles(namespace).Update(ctx, r, metav1.UpdateOptions{})
		if err != nil {
			return nil, fmt.Errorf("Role %s/%s: %w", namespace, role, err)
		}
	} else if err != nil {
		return nil, fmt.Errorf("Role %s/%s: %w", namespace, role, err)
	}
	if _, err := c.Client.RbacV1().RoleBindings(namespace).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: user},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: role},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: user}}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return nil, fmt.Errorf("RoleBinding %s/%s: %w", namespace, user, err)
	}
	// The API server's authorizer learns of the binding from its informer
	// a moment later: the user has it once a review says so.
	review := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{User: user, Groups: []string{"system:authenticated"},
		ResourceAttributes: &authorizationv1.ResourceAttributes{Namespace: namespace, Verb: "get", Group: "rbac.authorization.k8s.io", Resource: "roles", Name: role}}}
	// The Role grants itself nothing: ask for what its rules grant.
	if len(rules) > 0 && len(rules[0].Verbs) > 0 && len(rules[0].APIGroups) > 0 && len(rules[0].Resources) > 0 {
		review.Spec.ResourceAttributes = &authorizationv1.ResourceAttributes{Namespace: namespace, Verb: rules[0].Verbs[0],
			Group: rules[0].APIGroups[0], Resource: rules[0].Resources[0]}
	}
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		r, err := c.Client.AuthorizationV1().SubjectAccessReviews().Create(ctx, review, metav1.CreateOptions{})
		return err == nil && r.Status.Allowed, nil
	})
	if err != nil {
		return nil, fmt.Errorf("user %s in %s: the API server does not authorize its new Role yet: %w", user, namespace, err)
	}
	cfg := restclient.CopyConfig(c.RESTConfig)
	cfg.Impersonate = restclient.ImpersonationConfig{UserName: user, Groups: []string{"system:authenticated"}}
	return cfg, nil
}

// Rules are the rules of the ClusterRoles as the ClusterRole aggregation
// controller fills them: their own and, recursively, those of the
// ClusterRoles their aggregationRule selects (devcluster runs no such
// controller, so the API server's bootstrap `edit` has none of its own).
func Rules(ctx context.Context, client kubernetes.Interface, clusterRoles ...string) ([]rbacv1.PolicyRule, error) {
	seen := map[string]bool{}
	var rules []rbacv1.PolicyRule
	for _, name := range clusterRoles {
		r, err := aggregated(ctx, client, name, seen)
		if err != nil {
			return nil, err
		}
		rules = append(rules, r...)
	}
	return rules, nil
}

// aggregated are a ClusterRole's rules with those of the roles its
// aggregation rule selects.
func aggregated(ctx context.Context, client kubernetes.Interface, name string, seen map[string]bool) ([]rbacv1.PolicyRule, error) {
	if seen[name] {
		return nil, nil
	}
	seen[name] = true
	role, err := client.RbacV1().ClusterRoles().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("ClusterRole %s: %w", name, err)
	}
	rules := role.Rules
	if role.AggregationRule == nil {
		return rules, nil
	}
	for _, sel := range role.AggregationRule.ClusterRoleSelectors {
		s, err := metav1.LabelSelectorAsSelector(&sel)
		if err != nil {
			return nil, fmt.Errorf("ClusterRole %s: %w", name, err)
		}
		list, err := client.RbacV1().ClusterRoles().List(ctx, metav1.ListOptions{LabelSelector: s.String()})
		if err != nil {
			return nil, err
		}
		for _, r := range list.Items {
			more, err := aggregated(ctx, client, r.Name, seen)
			if err != nil {
				return nil, err
			}
			rules = append(rules, more...)
		}
	}
	return rules, nil
}

// Gpudra runs a gpudra command of the cluster (submit, jobs, cancel,
// logs) in-process with cfg's credentials and namespace, as the user
// would run the CLI, and returns what it printed.
func Gpudra(ctx context.Context, cfg *restclient.Config, namespace string, args ...string) (string, error) {
	clients := func(string, string) (cli.Clients, error) { return cli.ClientsFor(cfg, namespace, nil) }
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
	return "", fmt.Errorf("no gpudra command %s", args[0])
}
