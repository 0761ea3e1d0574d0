package e2e

// What a compromised gpudra component can do, tried with its real
// credentials (a token for the chart's ServiceAccount, bound to its Node
// for the node agents) against devcluster's own install of the chart's
// RBAC and admission policies (docs/security.md).

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	resourceapi "k8s.io/api/resource/v1"
	resourcev1beta1 "k8s.io/api/resource/v1beta1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	restclient "k8s.io/client-go/rest"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/pkg/controller"
	"github.com/gpudra/gpudra/pkg/controller/gang"
	"github.com/gpudra/gpudra/pkg/sharing"
)

// asServiceAccount is a client with a component's credentials: sa's token,
// bound to node unless node is empty.
func asServiceAccount(t *testing.T, sa, node string) kubernetes.Interface {
	t.Helper()
	cfg, err := cluster.ServiceAccountConfig(context.Background(), sa, node)
	require.NoError(t, err)
	c, err := kubernetes.NewForConfig(cfg)
	require.NoError(t, err)
	return c
}

// refusedWith waits until create is refused with want (a policy is loaded
// asynchronously), then returns the error.
func refusedWith(t *testing.T, want string, try func() error) {
	t.Helper()
	var err error
	_ = wait.PollUntilContextTimeout(context.Background(), 200*time.Millisecond, 20*time.Second, true, func(context.Context) (bool, error) {
		err = try()
		return err != nil && strings.Contains(err.Error(), want), nil
	})
	if assert.Error(t, err, "not refused: %s", want) {
		assert.Contains(t, err.Error(), want)
		assert.True(t, apierrors.IsForbidden(err) || apierrors.IsInvalid(err), "%v", err)
	}
}

// TestMPSServerPodPinned: the plugin, as its ServiceAccount on its node,
// may create exactly the MPS server pod it makes (pkg/sharing) and no
// variation that would give the pod credentials, another program, host
// access or company.
func TestMPSServerPodPinned(t *testing.T) {
	ctx := context.Background()
	node := cluster.Node("dgx-h100-1")
	require.NotNil(t, node)
	plugin := asServiceAccount(t, chart.PluginServiceAccount, node.Name)
	opts := node.SharingOptions()
	servers, ok := opts.MPSServers.(*sharing.PodServers)
	require.True(t, ok, "devcluster's plugins run MPS servers as pods, as the chart does")
	gpu := node.Machine.Devices()[0]
	server := sharing.MPSServerFor(sharing.MPSRoot(opts.Root), []string{gpu.UUID})
	base, err := servers.Pod(ctx, server)
	require.NoError(t, err)

	create := func(pod *v1.Pod) error {
		_, err := plugin.CoreV1().Pods(chart.PluginNamespace).Create(ctx, pod, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err
	}
	require.NoError(t, create(base), "the server pod the plugin makes")

	hostPathType := v1.HostPathDirectory
	const allowList = "with the fields it sets (an allow-list, docs/security.md), not "
	for _, tc := range []struct {
		name   string
		change func(p *v1.Pod)
		want   string
	}{
		{"the controller's ServiceAccount", func(p *v1.Pod) { p.Spec.ServiceAccountName = chart.ControllerServiceAccount },
			"MPS server pods that run as ServiceAccount " + chart.MPSServerServiceAccount},
		{"a mounted token", func(p *v1.Pod) { p.Spec.AutomountServiceAccountToken = nil }, "automountServiceAccountToken false"},
		{"--control-binary=/bin/sh", func(p *v1.Pod) {
			p.Spec.Containers[0].Args = append(p.Spec.Containers[0].Args, "--control-binary=/bin/sh")
		}, "with the arguments --driver-root=/driver-root"},
		{"another --dir", func(p *v1.Pod) {
			p.Spec.Containers[0].Args[1] = "--dir=/etc"
		}, "with the arguments --driver-root=/driver-root"},
		{"a server directory outside the plugin's", func(p *v1.Pod) {
			for i := range p.Spec.Volumes {
				if p.Spec.Volumes[i].Name == "server" {
					p.Spec.Volumes[i].HostPath.Path = "/etc"
				}
			}
		}, "whose volumes are the server's directory"},
		{"the server directory mounted elsewhere", func(p *v1.Pod) {
			for i := range p.Spec.Containers[0].VolumeMounts {
				if p.Spec.Containers[0].VolumeMounts[i].Name == "server" {
					p.Spec.Containers[0].VolumeMounts[i].MountPath = "/etc"
				}
			}
		}, "whose volumes are the server's directory"},
		{"hostPath /", func(p *v1.Pod) {
			p.Spec.Volumes = append(p.Spec.Volumes, v1.Volume{Name: "host", VolumeSource: v1.VolumeSource{HostPath: &v1.HostPathVolumeSource{Path: "/", Type: &hostPathType}}})
			p.Spec.Containers[0].VolumeMounts = append(p.Spec.Containers[0].VolumeMounts, v1.VolumeMount{Name: "host", MountPath: "/host"})
		}, "whose volumes are the server's directory"},
		{"the driver root as /", func(p *v1.Pod) {
			for i := range p.Spec.Volumes {
				if p.Spec.Volumes[i].Name == "driver-root" {
					p.Spec.Volumes[i].HostPath.Path = "/"
				}
			}
		}, "whose volumes are the server's directory"},
		{"the driver root writable", func(p *v1.Pod) {
			for i := range p.Spec.Containers[0].VolumeMounts {
				p.Spec.Containers[0].VolumeMounts[i].ReadOnly = false
			}
		}, "whose volumes are the server's directory"},
		{"env LD_PRELOAD", func(p *v1.Pod) {
			p.Spec.Containers[0].Env = []v1.EnvVar{{Name: "LD_PRELOAD", Value: "/driver-root/tmp/evil.so"}}
		}, allowList + "spec.containers[0].env"},
		{"hostNetwork", func(p *v1.Pod) { p.Spec.HostNetwork = true }, allowList + "spec.hostNetwork"},
		{"hostPID", func(p *v1.Pod) { p.Spec.HostPID = true }, allowList + "spec.hostPID"},
		{"an extra container", func(p *v1.Pod) {
			p.Spec.Containers = append(p.Spec.Containers, v1.Container{Name: "extra", Image: p.Spec.Containers[0].Image, Command: []string{"gpudra-mps-server"}})
		}, "one container named mps-server"},
		{"an init container", func(p *v1.Pod) {
			p.Spec.InitContainers = []v1.Container{{Name: "init", Image: "busybox", Command: []string{"sh"}}}
		}, allowList + "spec.initContainers"},
		{"another image", func(p *v1.Pod) { p.Spec.Containers[0].Image = "busybox" }, "from the chart's image"},
		{"another command", func(p *v1.Pod) { p.Spec.Containers[0].Command = []string{"sh", "-c", "cat /etc/shadow"} }, "from the chart's image"},
		{"another node", func(p *v1.Pod) { p.Spec.NodeName = "dgx-h100-0" }, "may only create or delete MPS server pods of its own node, not of node 'dgx-h100-0'"},
		// Issue 35: an image pull Secret the Node authorizer would then
		// let the node read, and the other pod fields PodServers never sets.
		{"an image pull Secret", func(p *v1.Pod) {
			p.Spec.ImagePullSecrets = []v1.LocalObjectReference{{Name: "gpudra-webhook-tls"}}
		}, "with the values it sets"},
		{"a resource claim", func(p *v1.Pod) {
			claim := "any"
			p.Spec.ResourceClaims = []v1.PodResourceClaim{{Name: "gpu", ResourceClaimName: &claim}}
		}, allowList + "spec.resourceClaims"},
		{"a runtime class", func(p *v1.Pod) {
			// One that exists: RuntimeClass admission refuses a missing one first.
			rc := &nodev1.RuntimeClass{ObjectMeta: metav1.ObjectMeta{Name: "e2e-kata"}, Handler: "kata"}
			if _, err := cluster.Client.NodeV1().RuntimeClasses().Create(ctx, rc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
				t.Fatal(err)
			}
			p.Spec.RuntimeClassName = &rc.Name
		}, allowList + "spec.runtimeClassName"},
		{"another priority class", func(p *v1.Pod) { p.Spec.PriorityClassName = "system-cluster-critical" }, "with the values it sets"},
		{"another owner", func(p *v1.Pod) {
			p.OwnerReferences = append(p.OwnerReferences, metav1.OwnerReference{APIVersion: "v1", Kind: "Node", Name: "dgx-h100-0", UID: "x"})
		}, "with the values it sets"},
		{"a finalizer", func(p *v1.Pod) { p.Finalizers = []string{"example.com/keep"} }, allowList + "metadata.finalizers"},
		// Issue 47: an allow-list. Each of these passed the list of what
		// was refused before it.
		{"mount propagation Bidirectional", func(p *v1.Pod) {
			bidirectional := v1.MountPropagationBidirectional
			p.Spec.Containers[0].VolumeMounts[0].MountPropagation = &bidirectional
		}, allowList + "spec.containers[0].volumeMounts[server].mountPropagation"},
		{"a server directory of another type", func(p *v1.Pod) {
			socket := v1.HostPathSocket
			p.Spec.Volumes[0].HostPath.Type = &socket
		}, "whose volumes are the server's directory"},
		{"another label", func(p *v1.Pod) { p.Labels["app.kubernetes.io/instance"] = "gpudra" }, allowList + "metadata.labels[app.kubernetes.io/instance]"},
		{"another server key", func(p *v1.Pod) { p.Labels["gpu.gpudra.dev/mps-server"] = "mps-000000000000" }, "labelled and annotated with their own server's key"},
		{"a runtime's annotation", func(p *v1.Pod) {
			p.Annotations["io.kubernetes.cri-o.Devices"] = "/dev/sda"
		}, allowList + "metadata.annotations[io.kubernetes.cri-o.Devices]"},
		{"a pod security context", func(p *v1.Pod) {
			p.Spec.SecurityContext = &v1.PodSecurityContext{SupplementalGroups: []int64{0}}
		}, allowList + "spec.securityContext.supplementalGroups"},
		{"hostUsers", func(p *v1.Pod) { p.Spec.HostUsers = new(bool) }, allowList + "spec.hostUsers"},
		{"an SELinux type", func(p *v1.Pod) {
			p.Spec.Containers[0].SecurityContext.SELinuxOptions = &v1.SELinuxOptions{Type: "spc_t"}
		}, allowList + "spec.containers[0].securityContext.seLinuxOptions"},
		{"not privileged", func(p *v1.Pod) { p.Spec.Containers[0].SecurityContext.Privileged = new(bool) }, "runs privileged as root"},
		{"a working directory", func(p *v1.Pod) { p.Spec.Containers[0].WorkingDir = "/driver-root" }, allowList + "spec.containers[0].workingDir"},
		{"stdin", func(p *v1.Pod) { p.Spec.Containers[0].Stdin = true }, allowList + "spec.containers[0].stdin"},
		{"a termination message elsewhere", func(p *v1.Pod) {
			p.Spec.Containers[0].TerminationMessagePath = "/mps/control"
		}, "the default termination message"},
		{"a DNS configuration", func(p *v1.Pod) {
			p.Spec.DNSConfig = &v1.PodDNSConfig{Nameservers: []string{"192.0.2.1"}}
		}, allowList + "spec.dnsConfig"},
		{"a readiness gate", func(p *v1.Pod) {
			p.Spec.ReadinessGates = []v1.PodReadinessGate{{ConditionType: "example.com/ready"}}
		}, allowList + "spec.readinessGates"},
		{"another toleration", func(p *v1.Pod) {
			p.Spec.Tolerations = append(p.Spec.Tolerations, v1.Toleration{Key: "example.com/x", Operator: v1.TolerationOpExists})
		}, "one toleration of every taint"},
		{"an hour's grace", func(p *v1.Pod) { p.Spec.TerminationGracePeriodSeconds = ptr[int64](3600) }, "a grace period of 30 s"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pod := base.DeepCopy()
			tc.change(pod)
			refusedWith(t, tc.want, func() error { return create(pod) })
		})
	}
}

// TestPluginDeletesOnlyMPSServerPods: on its own node and in the release
// namespace, the plugin may delete its MPS server pods and no other pod (a
// controller replica on that node, say).
func TestPluginDeletesOnlyMPSServerPods(t *testing.T) {
	ctx := context.Background()
	node := cluster.Node("dgx-h100-1")
	require.NotNil(t, node)
	plugin := asServiceAccount(t, chart.PluginServiceAccount, node.Name)
	other := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "not-an-mps-server", Namespace: chart.PluginNamespace,
		Labels: map[string]string{"app.kubernetes.io/component": "controller"}},
		Spec: v1.PodSpec{NodeName: node.Name, Containers: []v1.Container{{Name: "c", Image: "x"}}}}
	_, err := cluster.Client.CoreV1().Pods(chart.PluginNamespace).Create(ctx, other, metav1.CreateOptions{})
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = cluster.Client.CoreV1().Pods(chart.PluginNamespace).Delete(context.Background(), other.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
	})
	refusedWith(t, "may only create or delete MPS server pods (label app.kubernetes.io/component=mps-server), not pod 'not-an-mps-server'", func() error {
		return plugin.CoreV1().Pods(chart.PluginNamespace).Delete(ctx, other.Name, metav1.DeleteOptions{DryRun: []string{metav1.DryRunAll}})
	})
}

// TestControllerPodUpdatesPinned: gpudra-controller, as its ServiceAccount,
// may lift its own scheduling gate and set its own pod condition, and
// nothing else a pod patch could do.
func TestControllerPodUpdatesPinned(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t)
	const otherGate = "example.com/quota"
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "gated", Labels: map[string]string{"app": "x"}},
		Spec: v1.PodSpec{SchedulingGates: []v1.PodSchedulingGate{{Name: gpudrav1.SchedulingGate}, {Name: otherGate}},
			Containers: []v1.Container{{Name: "c", Image: "registry.example.com/app:1"}}}}
	_, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{})
	require.NoError(t, err)
	controller := asServiceAccount(t, chart.ControllerServiceAccount, "")

	patch := func(ops ...map[string]any) error {
		b, err := json.Marshal(ops)
		require.NoError(t, err)
		_, err = controller.CoreV1().Pods(ns).Patch(ctx, pod.Name, types.JSONPatchType, b, metav1.PatchOptions{DryRun: []string{metav1.DryRunAll}})
		return err
	}
	refusedWith(t, "may only lift its scheduling gate from a pod", func() error {
		return patch(map[string]any{"op": "replace", "path": "/spec/containers/0/image", "value": "evil.example.com/miner:1"})
	})
	refusedWith(t, "may only remove its own scheduling gate gpudra.dev/gang, not add or remove "+otherGate, func() error {
		return patch(map[string]any{"op": "replace", "path": "/spec/schedulingGates", "value": []map[string]string{{"name": gpudrav1.SchedulingGate}}})
	})
	refusedWith(t, "may not change a pod's labels", func() error {
		return patch(map[string]any{"op": "add", "path": "/metadata/labels/evil", "value": "1"})
	})
	// Status patches merge conditions by type, as the controller's do.
	statusPatch := func(status map[string]any) error {
		b, err := json.Marshal(map[string]any{"status": status})
		require.NoError(t, err)
		_, err = controller.CoreV1().Pods(ns).Patch(ctx, pod.Name, types.StrategicMergePatchType, b, metav1.PatchOptions{DryRun: []string{metav1.DryRunAll}}, "status")
		return err
	}
	refusedWith(t, "may only set its own pod condition", func() error {
		return statusPatch(map[string]any{"conditions": []map[string]string{{"type": "Ready", "status": "True"}}})
	})
	refusedWith(t, "may only set its own pod condition", func() error {
		return statusPatch(map[string]any{"podIP": "10.0.0.66", "podIPs": []map[string]string{{"ip": "10.0.0.66"}}})
	})
	// Every PodStatus field but conditions, not only those it used to
	// list (internal/chartpolicy holds the list complete).
	refusedWith(t, "may only set its own pod condition", func() error {
		return statusPatch(map[string]any{"startTime": "2020-01-01T00:00:00Z"})
	})

	// What it does: lift its gate, leave the other; set its condition.
	require.NoError(t, patch(map[string]any{"op": "replace", "path": "/spec/schedulingGates", "value": []map[string]string{{"name": otherGate}}}))
	require.NoError(t, statusPatch(map[string]any{"conditions": []map[string]string{{"type": "gpudra.dev/GangAllocated", "status": "True", "reason": "GangAllocated"}}}))
}

// TestGangControllerFailsWithoutItsRule: the chart's RBAC is what the gang
// controller runs under. With one rule taken from its ClusterRole (creating
// DeviceTaintRules, the fence) a gang stays gated, the pods' condition
// names the forbidden call, and the recorder that fails e2e tests saw it;
// with the rule back, the gang lands.
func TestGangControllerFailsWithoutItsRule(t *testing.T) {
	onGangPath(t, controller.GangModeGates)
	ctx := context.Background()
	roles := cluster.Client.RbacV1().ClusterRoles()
	role, err := roles.Get(ctx, chart.ControllerServiceAccount, metav1.GetOptions{})
	require.NoError(t, err)
	original := role.DeepCopy()
	restore := func() {
		r, err := roles.Get(ctx, original.Name, metav1.GetOptions{})
		require.NoError(t, err)
		r.Rules = original.Rules
		_, err = roles.Update(ctx, r, metav1.UpdateOptions{})
		require.NoError(t, err)
	}
	t.Cleanup(restore)
	removed := false
	for i, rule := range role.Rules {
		if slices.Contains(rule.Resources, "devicetaintrules") {
			role.Rules[i].Verbs = slices.DeleteFunc(slices.Clone(rule.Verbs), func(v string) bool { return v == "create" })
			removed = true
		}
	}
	require.True(t, removed, "the chart's controller ClusterRole grants creating devicetaintrules")
	_, err = roles.Update(ctx, role, metav1.UpdateOptions{})
	require.NoError(t, err)

	ns := namespace(t)
	create(t, ns, gpus("one-gpu", 1), gangPod("rule-0", "rule", 2, "one-gpu", nil), gangPod("rule-1", "rule", 2, "one-gpu", nil))
	cond := gangCondition(t, ns, "rule-0", v1.ConditionFalse, "WaitingForDevices")
	var forbidden []devcluster.ForbiddenCall
	require.Eventually(t, func() bool {
		forbidden = append(forbidden, cluster.TakeForbidden()...)
		return len(forbidden) > 0
	}, 30*time.Second, 100*time.Millisecond, "no forbidden call recorded")
	assert.Contains(t, cond.Message+" "+condMessage(t, ns, "rule-0"), "devicetaintrules.resource.k8s.io is forbidden")
	for _, call := range forbidden {
		assert.Equal(t, "system:serviceaccount:"+chart.PluginNamespace+":"+chart.ControllerServiceAccount, call.User)
		assert.Equal(t, "POST /apis/resource.k8s.io/v1/devicetaintrules", call.Method+" "+call.URL)
	}

	restore()
	waitRunning(t, ns, "rule-0")
	waitRunning(t, ns, "rule-1")
	// The calls refused before the rule was back, and none after.
	for _, call := range cluster.TakeForbidden() {
		assert.Equal(t, "POST /apis/resource.k8s.io/v1/devicetaintrules", call.Method+" "+call.URL)
	}
}

// condMessage is the pod's current gang condition message.
func condMessage(t *testing.T, ns, name string) string {
	t.Helper()
	p, err := cluster.Client.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{})
	require.NoError(t, err)
	for _, c := range p.Status.Conditions {
		if c.Type == gang.PodConditionGang {
			return c.Message
		}
	}
	return ""
}

// TestGangGateOnlyTheControllerLifts: a user who may patch their pods may
// not lift gpudra's gate from a gang pod (jumping the queue and scheduling
// it alone); other changes to the pod stay allowed.
func TestGangGateOnlyTheControllerLifts(t *testing.T) {
	onGangPath(t, controller.GangModeGates)
	ctx := context.Background()
	ns := namespace(t)
	create(t, ns, gpus("one-gpu", 1), gangPod("wait-0", "wait", 2, "one-gpu", nil))
	gangCondition(t, ns, "wait-0", v1.ConditionFalse, gang.ReasonWaitingForPods)

	_, err := cluster.Client.RbacV1().Roles(ns).Create(ctx, &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: "pod-editor"},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get", "patch", "update"}}}}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = cluster.Client.RbacV1().RoleBindings(ns).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "alice"},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: "pod-editor"},
		Subjects: []rbacv1.Subject{{Kind: "User", Name: "alice"}}}, metav1.CreateOptions{})
	require.NoError(t, err)
	cfg := restclient.CopyConfig(cluster.RESTConfig)
	cfg.Impersonate = restclient.ImpersonationConfig{UserName: "alice", Groups: []string{"system:authenticated"}}
	alice, err := kubernetes.NewForConfig(cfg)
	require.NoError(t, err)

	patch := func(ops ...map[string]any) error {
		b, err := json.Marshal(ops)
		require.NoError(t, err)
		_, err = alice.CoreV1().Pods(ns).Patch(ctx, "wait-0", types.JSONPatchType, b, metav1.PatchOptions{DryRun: []string{metav1.DryRunAll}})
		return err
	}
	refusedWith(t, "only gpudra-controller lifts the scheduling gate gpudra.dev/gang", func() error {
		return patch(map[string]any{"op": "replace", "path": "/spec/schedulingGates", "value": []any{}})
	})
	require.NoError(t, patch(map[string]any{"op": "add", "path": "/metadata/labels/team", "value": "a"}), "other changes stay allowed")
}

// TestFenceTolerationRefused: no claim or claim template may tolerate the
// gang fence's device taint, through a request or a firstAvailable
// subrequest; other tolerations stay allowed.
func TestFenceTolerationRefused(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t)
	dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
	tolerate := func(key string) []resourceapi.DeviceToleration {
		return []resourceapi.DeviceToleration{{Key: key, Operator: resourceapi.DeviceTolerationOpExists}}
	}
	claim := func(name string, req resourceapi.DeviceRequest) *resourceapi.ResourceClaim {
		return &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{req}}}}
	}
	exact := func(key string) resourceapi.DeviceRequest {
		return resourceapi.DeviceRequest{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.gpudra.dev", Tolerations: tolerate(key)}}
	}
	sub := resourceapi.DeviceRequest{Name: "gpu", FirstAvailable: []resourceapi.DeviceSubRequest{
		{Name: "full", DeviceClassName: "gpu.gpudra.dev", Tolerations: tolerate("gpudra.dev/fence")}}}
	const want = "a claim may not tolerate the device taint gpudra.dev/fence"
	refusedWith(t, want, func() error {
		_, err := cluster.Client.ResourceV1().ResourceClaims(ns).Create(ctx, claim("fenced", exact("gpudra.dev/fence")), dry)
		return err
	})
	refusedWith(t, want, func() error {
		_, err := cluster.Client.ResourceV1().ResourceClaims(ns).Create(ctx, claim("fenced-sub", sub), dry)
		return err
	})
	refusedWith(t, want, func() error {
		_, err := cluster.Client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, &resourceapi.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Name: "fenced"},
			Spec: resourceapi.ResourceClaimTemplateSpec{Spec: claim("", exact("gpudra.dev/fence")).Spec}}, dry)
		return err
	})
	// A toleration without a key and operator Exists tolerates every
	// taint, the fence too.
	refusedWith(t, want, func() error {
		_, err := cluster.Client.ResourceV1().ResourceClaims(ns).Create(ctx, claim("every-taint", exact("")), dry)
		return err
	})
	// The same claim in v1beta1's shape (tolerations on the request
	// itself), where that version is served (the suite serves it).
	refusedWith(t, want, func() error {
		_, err := cluster.Client.ResourceV1beta1().ResourceClaims(ns).Create(ctx, &resourcev1beta1.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "fenced-v1beta1"},
			Spec: resourcev1beta1.ResourceClaimSpec{Devices: resourcev1beta1.DeviceClaim{Requests: []resourcev1beta1.DeviceRequest{{
				Name: "gpu", DeviceClassName: "gpu.gpudra.dev",
				Tolerations: []resourcev1beta1.DeviceToleration{{Key: "gpudra.dev/fence", Operator: resourcev1beta1.DeviceTolerationOpExists}}}}}}}, dry)
		return err
	})
	_, err := cluster.Client.ResourceV1().ResourceClaims(ns).Create(ctx, claim("unhealthy-ok", exact("gpu.gpudra.dev/unhealthy")), dry)
	assert.NoError(t, err, "another toleration")
	_, err = cluster.Client.ResourceV1beta1().ResourceClaims(ns).Create(ctx, &resourcev1beta1.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "plain-v1beta1"},
		Spec: resourcev1beta1.ResourceClaimSpec{Devices: resourcev1beta1.DeviceClaim{Requests: []resourcev1beta1.DeviceRequest{{
			Name: "gpu", DeviceClassName: "gpu.gpudra.dev"}}}}}, dry)
	assert.NoError(t, err, "a v1beta1 claim without the toleration is admitted")
}
