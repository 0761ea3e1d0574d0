package devcluster

// Every gpudra component in devcluster runs as the chart's own identity:
// the chart is rendered with helm and its ServiceAccounts, RBAC and
// admission policies are applied, and each component authenticates with a
// service-account token the API server issued (TokenRequest), as in a
// cluster. The kubelet plugin's and the device-plugin agent's tokens are
// bound to their Node, so the API server adds the node-name extra the
// chart's admission policies check. Admin credentials remain only for the
// harness (tests, the demo, the Grove stand-in, the kubelets).

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	restclient "k8s.io/client-go/rest"
	"k8s.io/utils/ptr"

	"github.com/gpudra/gpudra/devcluster/chart"
)

// componentTokenLifetime outlives any devcluster run.
const componentTokenLifetime = 48 * time.Hour

// identityKinds are what devcluster applies from the rendered chart: who
// the components are and what they may do. The workloads (DaemonSet,
// Deployment, Services) are devcluster's own in-process components, and
// the webhook configurations point at devcluster's front (controller.go).
var identityKinds = []string{"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
	"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}

// installChartIdentities applies the chart's ServiceAccounts, RBAC and
// admission policies, and waits until the policies are in force.
func (c *Cluster) installChartIdentities(ctx context.Context, opts chart.Options) error {
	rendered, err := chart.Render(ctx, opts, c.Dir, opts.Values...)
	if err != nil {
		return err
	}
	if err := os.WriteFile(c.renderedChart(), []byte(rendered), 0o600); err != nil {
		return err
	}
	keep, err := c.chartObjects(identityKinds...)
	if err != nil {
		return err
	}
	if err := c.Apply(ctx, chart.PluginNamespace, keep); err != nil {
		return fmt.Errorf("apply the chart's identities: %w", err)
	}
	for _, sa := range []string{chart.PluginServiceAccount, chart.ControllerServiceAccount, chart.MPSServerServiceAccount} {
		if _, err := c.Client.CoreV1().ServiceAccounts(chart.PluginNamespace).Get(ctx, sa, metav1.GetOptions{}); err != nil {
			return fmt.Errorf("the chart has no ServiceAccount %s: %w", sa, err)
		}
	}
	return nil
}

// installPluginDaemonSet creates the chart's kubelet plugin DaemonSet, as
// rendered, and makes it the owner of the plugin pods devcluster runs on
// each node. No DaemonSet controller runs here (devcluster plays it): the
// object is there for what reads it on a real cluster. An autoscaler
// counts a DaemonSet's pods as part of every node (Karpenter's
// daemonset overhead) and never as a workload to move: a bare plugin pod
// made every simulated node look busy to Karpenter, so that no GPU node
// was ever empty.
func (c *Cluster) installPluginDaemonSet(ctx context.Context) error {
	objs, err := c.chartObjects("DaemonSet")
	if err != nil {
		return err
	}
	name := chart.Release + "-kubelet-plugin"
	objs = slices.DeleteFunc(objs, func(o *unstructured.Unstructured) bool { return o.GetName() != name })
	if len(objs) != 1 {
		return fmt.Errorf("the rendered chart (%s) has no DaemonSet %s", c.renderedChart(), name)
	}
	if err := c.Apply(ctx, chart.PluginNamespace, objs); err != nil {
		return fmt.Errorf("apply the chart's DaemonSet %s: %w", name, err)
	}
	ds, err := c.Client.AppsV1().DaemonSets(chart.PluginNamespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("the chart's DaemonSet %s: %w", name, err)
	}
	c.pluginOwner = metav1.NewControllerRef(ds, appsv1.SchemeGroupVersion.WithKind("DaemonSet"))
	return nil
}

// renderedChart is the chart as devcluster rendered it at Start.
func (c *Cluster) renderedChart() string { return filepath.Join(c.Dir, "chart.yaml") }

// chartObjects are the rendered chart's objects of these kinds.
func (c *Cluster) chartObjects(kinds ...string) ([]*unstructured.Unstructured, error) {
	objs, err := Manifests(c.renderedChart())
	if err != nil {
		return nil, fmt.Errorf("the rendered chart: %w", err)
	}
	var keep []*unstructured.Unstructured
	for _, o := range objs {
		if slices.Contains(kinds, o.GetKind()) {
			keep = append(keep, o)
		}
	}
	return keep, nil
}

// InstallChartDeviceClasses applies the DeviceClasses the chart renders,
// exactly the ones a user of the chart gets (the e2e suite applies
// examples/deviceclasses, which a test holds equal to them), and returns
// their names.
func (c *Cluster) InstallChartDeviceClasses(ctx context.Context) ([]string, error) {
	classes, err := c.chartObjects("DeviceClass")
	if err != nil {
		return nil, err
	}
	if len(classes) == 0 {
		return nil, fmt.Errorf("the chart renders no DeviceClass (%s)", c.renderedChart())
	}
	if err := c.Apply(ctx, "", classes); err != nil {
		return nil, fmt.Errorf("apply the chart's DeviceClasses: %w", err)
	}
	names := make([]string, 0, len(classes))
	for _, o := range classes {
		names = append(names, o.GetName())
	}
	return names, nil
}

// componentConfig is a client configuration that authenticates as the
// service account sa of chart.PluginNamespace with a token from the API server,
// bound to node when node is set (the node-name extra), with no other
// credentials. Every response it gets is watched: a 403 is recorded
// (TakeForbidden).
func (c *Cluster) componentConfig(ctx context.Context, sa, userAgent string, node *v1.Node) (*restclient.Config, error) {
	cfg, err := c.serviceAccountConfig(ctx, sa, userAgent, node)
	if err != nil {
		return nil, err
	}
	user := "system:serviceaccount:" + chart.PluginNamespace + ":" + sa
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return forbiddenRecorder{next: rt, user: user, log: &c.forbidden}
	})
	return cfg, nil
}

// ServiceAccountConfig is a client configuration with the credentials a
// component has (the ServiceAccount sa of chart.PluginNamespace, its token bound
// to the Node named node unless node is empty) but none of its recording:
// for tests that try what a compromised component could do.
func (c *Cluster) ServiceAccountConfig(ctx context.Context, sa, node string) (*restclient.Config, error) {
	var bound *v1.Node
	if node != "" {
		n, err := c.Client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("Node %s, for its token: %w", node, err)
		}
		bound = n
	}
	return c.serviceAccountConfig(ctx, sa, "e2e-as-"+sa, bound)
}

func (c *Cluster) serviceAccountConfig(ctx context.Context, sa, userAgent string, node *v1.Node) (*restclient.Config, error) {
	req := &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{
		ExpirationSeconds: ptr.To(int64(componentTokenLifetime.Seconds()))}}
	if node != nil {
		req.Spec.BoundObjectRef = &authenticationv1.BoundObjectReference{APIVersion: "v1", Kind: "Node", Name: node.Name, UID: node.UID}
	}
	tok, err := c.Client.CoreV1().ServiceAccounts(chart.PluginNamespace).CreateToken(ctx, sa, req, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("token for ServiceAccount %s/%s: %w", chart.PluginNamespace, sa, err)
	}
	cfg := restclient.AnonymousClientConfig(c.RESTConfig)
	cfg.BearerToken = tok.Status.Token
	cfg.UserAgent = userAgent
	return cfg, nil
}

// nodeComponentConfig is componentConfig bound to the named Node.
func (c *Cluster) nodeComponentConfig(ctx context.Context, sa, userAgent, nodeName string) (*restclient.Config, error) {
	node, err := c.Client.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("Node %s, for its token: %w", nodeName, err)
	}
	return c.componentConfig(ctx, sa, userAgent, node)
}

// ForbiddenCall is a request of a component that the API server refused
// with 403: RBAC or an admission policy said no.
type ForbiddenCall struct {
	User, Method, URL string
}

func (f ForbiddenCall) String() string { return f.User + " " + f.Method + " " + f.URL }

type forbiddenLog struct {
	mu    sync.Mutex
	calls []ForbiddenCall
}

// TakeForbidden returns the forbidden calls of gpudra's components since
// the last call, and forgets them. A forbidden call means the chart's
// RBAC or policies lack what the code does: the e2e suite fails the test
// during which it happened.
func (c *Cluster) TakeForbidden() []ForbiddenCall {
	c.forbidden.mu.Lock()
	defer c.forbidden.mu.Unlock()
	out := c.forbidden.calls
	c.forbidden.calls = nil
	return out
}

type forbiddenRecorder struct {
	next http.RoundTripper
	user string
	log  *forbiddenLog
}

func (r forbiddenRecorder) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := r.next.RoundTrip(req)
	if err == nil && resp.StatusCode == http.StatusForbidden {
		r.log.mu.Lock()
		r.log.calls = append(r.log.calls, ForbiddenCall{User: r.user, Method: req.Method, URL: req.URL.RequestURI()})
		r.log.mu.Unlock()
	}
	return resp, err
}
