package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	restclient "k8s.io/client-go/rest"

	"github.com/gpudra/gpudra/devcluster"
)

const (
	chartDir       = "../../deployments/helm/gpudra"
	chartNamespace = "gpudra"
	// chartRelease names what the chart tests install: not "gpudra",
	// devcluster's own release (identity.go), whose cluster-wide RBAC and
	// policies the components run under.
	chartRelease = "gpudra-chart"
	// pluginUser is the kubelet plugin's service account as the chart
	// names it for chartRelease.
	pluginUser = "system:serviceaccount:gpudra:" + chartRelease + "-kubelet-plugin"
)

// helm is the helm binary `make test` installs (HELM overrides).
func helm(t *testing.T) string {
	t.Helper()
	if h := os.Getenv("HELM"); h != "" {
		return h
	}
	h, err := filepath.Abs("../../bin/helm")
	require.NoError(t, err)
	_, err = os.Stat(h)
	require.NoError(t, err, "helm is not installed: run `make helm` (or set HELM)")
	return h
}

// render runs helm template for release gpudra in namespace gpudra, named
// chartRelease unless args name it otherwise.
func render(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(helm(t), append([]string{"template", "gpudra", chartDir, "--namespace", chartNamespace, "--kube-version", "1.37.1",
		"--set", "fullnameOverride=" + chartRelease}, args...)...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func TestChartRejectsWrongValues(t *testing.T) {
	tests := []struct {
		name string
		set  string
		want string
	}{
		{"a string where a number goes", "kubeletPlugin.kubeAPI.qps=fast", "at '/kubeletPlugin/kubeAPI/qps': got string, want number"},
		{"an unknown key", "kubeletPlugin.fractionalGPU=true", "at '/kubeletPlugin': additional properties 'fractionalGPU' not allowed"},
		{"an unknown top-level key", "plugin.enabled=true", "additional properties 'plugin' not allowed"},
		{"a backend that does not exist", "kubeletPlugin.backend=cuda", "at '/kubeletPlugin/backend'"},
		{"a relative driver root", "kubeletPlugin.driverRoot=run/nvidia/driver", "at '/kubeletPlugin/driverRoot'"},
		{"a port out of range", "kubeletPlugin.metrics.port=70000", "at '/kubeletPlugin/metrics/port'"},
		{"a webhook timeout the API server refuses", "webhook.timeoutSeconds=60", "at '/webhook/timeoutSeconds'"},
		{"no controller replica", "controller.replicas=0", "at '/controller/replicas'"},
		{"an image digest that is a tag", "image.digest=latest", "at '/image/digest'"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			out, err := render(t, "--set", tc.set)
			require.Error(t, err, "helm template accepted %s", tc.set)
			assert.Contains(t, out, tc.want)
		})
	}
}

// The chart's DeviceClasses are the ones the examples (and the demo) use.
func TestChartDeviceClassesMatchTheExamples(t *testing.T) {
	out, err := render(t)
	require.NoError(t, err, out)
	chart := objectsFrom(t, out)
	examplesObjs, err := devcluster.Manifests(filepath.Join(examples, "deviceclasses"))
	require.NoError(t, err)
	for _, want := range examplesObjs {
		var got *unstructured.Unstructured
		for _, o := range chart {
			if o.GetKind() == "DeviceClass" && o.GetName() == want.GetName() {
				got = o
			}
		}
		require.NotNil(t, got, "chart has no DeviceClass %s", want.GetName())
		assert.Equal(t, want.Object["spec"], got.Object["spec"], "DeviceClass %s", want.GetName())
	}
}

func objectsFrom(t *testing.T, rendered string) []*unstructured.Unstructured {
	t.Helper()
	f := filepath.Join(t.TempDir(), "chart.yaml")
	require.NoError(t, os.WriteFile(f, []byte(rendered), 0o644))
	objs, err := devcluster.Manifests(f)
	require.NoError(t, err)
	return objs
}

// TestChartInstallAndNodeIsolation installs the rendered chart into the API
// server (which validates every object; authorization is Node,RBAC), then
// acts as the plugin's service account on one node: RBAC lets it do what the
// plugin does and nothing more, and the admission policy refuses a slice
// for another node.
func TestChartInstallAndNodeIsolation(t *testing.T) {
	ctx := context.Background()
	for _, values := range [][]string{nil, {"-f", filepath.Join(chartDir, "ci", "non-default-values.yaml"), "--set", "fullnameOverride=gpudra-alt"}} {
		out, err := render(t, values...)
		require.NoError(t, err, out)
		objs := objectsFrom(t, out)
		require.NotEmpty(t, objs)
		_, err = cluster.Client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: chartNamespace}}, metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			require.NoError(t, err)
		}
		// DeviceClasses exist already (the examples'): the API server
		// validates the chart's through a dry run instead.
		var fresh []*unstructured.Unstructured
		for _, o := range objs {
			if o.GetKind() == "DeviceClass" {
				_, err := cluster.Client.ResourceV1().DeviceClasses().Get(ctx, o.GetName(), metav1.GetOptions{})
				if err == nil {
					require.NoError(t, dryRunCreate(ctx, o), "DeviceClass %s", o.GetName())
					continue
				}
			}
			// The webhook configuration would send devcluster's claims to a
			// Service nobody serves (devcluster runs its own, controller.go):
			// validated by a dry run; TestChartControllerLeastPrivilege
			// installs one that matches nothing.
			// The same for the gang pods' mutating configuration, which
			// would also take the name of devcluster's own.
			if o.GetKind() == "ValidatingWebhookConfiguration" || o.GetKind() == "MutatingWebhookConfiguration" {
				require.NoError(t, dryRunCreate(ctx, o), "%s %s", o.GetKind(), o.GetName())
				continue
			}
			// The Prometheus Operator's kinds (the PrometheusRule of
			// non-default values) are not served here: no operator, no
			// CRDs. hack/promrules checks what the chart renders of them.
			if o.GroupVersionKind().Group == "monitoring.coreos.com" {
				continue
			}
			// The gang gate and gang PodGroup policies exempt their own
			// release's controller only: applied, they would stop
			// devcluster's from lifting gates and creating PodGroups.
			if strings.HasSuffix(o.GetName(), "-gang-gate") || strings.HasSuffix(o.GetName(), "-gang-podgroups") {
				require.NoError(t, dryRunCreate(ctx, o), "%s %s", o.GetKind(), o.GetName())
				continue
			}
			fresh = append(fresh, o)
		}
		require.NoError(t, cluster.Apply(ctx, chartNamespace, fresh), "the API server refused the rendered chart (values %v)", values)
	}

	plugin := impersonate(t, pluginUser, "vap-node-a")
	// The policy is loaded asynchronously: wait until it refuses.
	var err error
	waitErr := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 20*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err = plugin.ResourceV1().ResourceSlices().Create(ctx, slice("vap-node-b"), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err != nil && strings.Contains(err.Error(), "may not create, change or delete ResourceSlices of node 'vap-node-b'"), nil
	})
	require.NoError(t, waitErr, "a slice for another node was not refused; last error: %v", err)
	assert.True(t, apierrors.IsInvalid(err) || apierrors.IsForbidden(err), "%v", err)
	assert.Contains(t, err.Error(), "the gpudra kubelet plugin on node 'vap-node-a'")

	// Its own node's slice is accepted, changed and deleted.
	own, err := plugin.ResourceV1().ResourceSlices().Create(ctx, slice("vap-node-a"), metav1.CreateOptions{})
	require.NoError(t, err, "the plugin may publish its own node's slice")
	own.Spec.Devices = append(own.Spec.Devices, resourceapi.Device{Name: "gpu-1"})
	own, err = plugin.ResourceV1().ResourceSlices().Update(ctx, own, metav1.UpdateOptions{})
	require.NoError(t, err)
	require.NoError(t, plugin.ResourceV1().ResourceSlices().Delete(ctx, own.Name, metav1.DeleteOptions{}))

	// Another node's slice, made by someone else, cannot be deleted by it.
	other, err := cluster.Client.ResourceV1().ResourceSlices().Create(ctx, slice("vap-node-b"), metav1.CreateOptions{})
	require.NoError(t, err)
	defer func() {
		_ = cluster.Client.ResourceV1().ResourceSlices().Delete(ctx, other.Name, metav1.DeleteOptions{})
	}()
	err = plugin.ResourceV1().ResourceSlices().Delete(ctx, other.Name, metav1.DeleteOptions{})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "may not create, change or delete ResourceSlices of node 'vap-node-b'")

	// A slice of another node's pool is refused even on its own node (a
	// compromised plugin spoiling another pool); a slice's pool name is
	// immutable, so an update cannot move it there either.
	for _, pool := range []string{"vap-node-b", "vap-node-a-other"} {
		spoiled := slice("vap-node-a")
		spoiled.Spec.Pool.Name = pool
		_, err = plugin.ResourceV1().ResourceSlices().Create(ctx, spoiled, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		require.Error(t, err, "pool %s", pool)
		assert.True(t, apierrors.IsInvalid(err) || apierrors.IsForbidden(err), "%v", err)
		assert.Contains(t, err.Error(), "may only publish ResourceSlices of its own node's pool, not of pool '"+pool+"'")
	}

	// Another driver's slice is refused even on its own node.
	foreign := slice("vap-node-a")
	foreign.Spec.Driver = "gpu.nvidia.com"
	_, err = plugin.ResourceV1().ResourceSlices().Create(ctx, foreign, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "only publish ResourceSlices of driver gpu.gpudra.dev")

	// A token that is not bound to a pod on a node carries no node.
	unbound := impersonate(t, pluginUser, "")
	_, err = unbound.ResourceV1().ResourceSlices().Create(ctx, slice("vap-node-a"), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "carries no node")

	// Device status: the plugin may report on claims allocated on its own
	// node (resourceclaims/driver, associated-node verbs), not elsewhere.
	ns := namespace(t)
	apply(t, ns, filepath.Join(examples, "single-gpu"))
	pod := waitRunning(t, ns, "single-gpu")
	claim := podClaim(t, pod, "gpu")
	r := claim.Status.Allocation.Devices.Results[0]
	otherNode := "dgx-h100-0"
	if pod.Spec.NodeName == otherNode {
		otherNode = "dgx-h100-1"
	}
	status := func(c kubernetes.Interface) error {
		cl, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, claim.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		cl.Status.Devices = []resourceapi.AllocatedDeviceStatus{{Driver: r.Driver, Pool: r.Pool, Device: r.Device,
			Conditions: []metav1.Condition{{Type: "Ready", Status: metav1.ConditionTrue, Reason: "Test", LastTransitionTime: metav1.Now()}}}}
		_, err = c.ResourceV1().ResourceClaims(ns).UpdateStatus(ctx, cl, metav1.UpdateOptions{})
		return err
	}
	err = status(impersonate(t, pluginUser, otherNode))
	require.Error(t, err, "a plugin on another node may not write the claim's device status")
	assert.Contains(t, err.Error(), `resourceclaims/driver`)
	require.NoError(t, status(impersonate(t, pluginUser, pod.Spec.NodeName)), "the plugin on the claim's node may")

	// MPS server pods: what the policies pin is TestMPSServerPodPinned's
	// (security_test.go); here, that RBAC allows pods in the release
	// namespace only.
	_, err = plugin.CoreV1().Pods("default").Create(ctx, &v1.Pod{ObjectMeta: metav1.ObjectMeta{GenerateName: "gpudra-mps-"},
		Spec: v1.PodSpec{NodeName: "vap-node-a", Containers: []v1.Container{{Name: "mps-server", Image: "x"}}}}, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
	assert.True(t, apierrors.IsForbidden(err), "pods outside the release namespace: %v", err)

	// RBAC really applies: what the plugin does not call, it may not do.
	_, err = plugin.CoreV1().Secrets("default").List(ctx, metav1.ListOptions{})
	assert.True(t, apierrors.IsForbidden(err), "secrets: %v", err)
	_, err = plugin.ResourceV1().ResourceClaims("default").List(ctx, metav1.ListOptions{})
	assert.NoError(t, err, "listing claims, to rebuild a lost checkpoint")
	_, err = plugin.ResourceV1().ResourceClaims("default").Watch(ctx, metav1.ListOptions{})
	assert.True(t, apierrors.IsForbidden(err), "watching claims: %v", err)
	err = plugin.CoreV1().Nodes().Delete(ctx, "dgx-h100-0", metav1.DeleteOptions{DryRun: []string{metav1.DryRunAll}})
	assert.True(t, apierrors.IsForbidden(err), "deleting a node: %v", err)
	_, err = plugin.CoreV1().Nodes().Get(ctx, "dgx-h100-0", metav1.GetOptions{})
	assert.NoError(t, err, "reading a Node is allowed")
}

func slice(node string) *resourceapi.ResourceSlice {
	return &resourceapi.ResourceSlice{
		ObjectMeta: metav1.ObjectMeta{GenerateName: node + "-gpu.gpudra.dev-"},
		Spec: resourceapi.ResourceSliceSpec{
			Driver: "gpu.gpudra.dev", NodeName: &node,
			Pool:    resourceapi.ResourcePool{Name: node, Generation: 1, ResourceSliceCount: 1},
			Devices: []resourceapi.Device{{Name: "gpu-0"}},
		},
	}
}

// impersonate is a client acting as user, with the node association a
// pod-bound service account token gives (none when node is empty).
func impersonate(t *testing.T, user, node string) kubernetes.Interface {
	t.Helper()
	cfg := restclient.CopyConfig(cluster.RESTConfig)
	cfg.Impersonate = restclient.ImpersonationConfig{UserName: user,
		Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + chartNamespace, "system:authenticated"}}
	if node != "" {
		cfg.Impersonate.Extra = map[string][]string{"authentication.kubernetes.io/node-name": {node}}
	}
	c, err := kubernetes.NewForConfig(cfg)
	require.NoError(t, err)
	return c
}

func dryRunCreate(ctx context.Context, o *unstructured.Unstructured) error {
	if o.GetKind() == "ValidatingWebhookConfiguration" {
		var vwc admissionregistrationv1.ValidatingWebhookConfiguration
		if err := runtimeConvert(o, &vwc); err != nil {
			return err
		}
		vwc.Name += "-dry-run"
		_, err := cluster.Client.AdmissionregistrationV1().ValidatingWebhookConfigurations().Create(ctx, &vwc, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err
	}
	if o.GetKind() == "MutatingWebhookConfiguration" {
		var mwc admissionregistrationv1.MutatingWebhookConfiguration
		if err := runtimeConvert(o, &mwc); err != nil {
			return err
		}
		mwc.Name += "-dry-run"
		_, err := cluster.Client.AdmissionregistrationV1().MutatingWebhookConfigurations().Create(ctx, &mwc, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err
	}
	if o.GetKind() == "ValidatingAdmissionPolicy" || o.GetKind() == "ValidatingAdmissionPolicyBinding" {
		dry := o.DeepCopy()
		dry.SetName(o.GetName() + "-dry-run")
		resource := map[string]string{"ValidatingAdmissionPolicy": "validatingadmissionpolicies",
			"ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings"}[o.GetKind()]
		gvr := admissionregistrationv1.SchemeGroupVersion.WithResource(resource)
		dyn, err := dynamic.NewForConfig(cluster.RESTConfig)
		if err != nil {
			return err
		}
		_, err = dyn.Resource(gvr).Create(ctx, dry, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err
	}
	if o.GetKind() != "DeviceClass" {
		return fmt.Errorf("dry run of %s not supported here", o.GetKind())
	}
	var dc resourceapi.DeviceClass
	if err := runtimeConvert(o, &dc); err != nil {
		return err
	}
	dc.Name = dc.Name + "-dry-run"
	_, err := cluster.Client.ResourceV1().DeviceClasses().Create(ctx, &dc, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
	return err
}

func runtimeConvert(u *unstructured.Unstructured, into any) error {
	return runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, into)
}
