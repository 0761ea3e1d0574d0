package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"

	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// gpuPod is a pod with one claim from a template in the same namespace.
func gpuPod(name, template string) *v1.Pod {
	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: v1.PodSpec{
			RestartPolicy: v1.RestartPolicyNever,
			Containers: []v1.Container{{Name: "cuda", Image: "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04",
				Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu"}}}}},
			ResourceClaims: []v1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: &template}},
		},
	}
}

func template(name string, req resourceapi.DeviceRequest, constraints []resourceapi.DeviceConstraint, config []resourceapi.DeviceClaimConfiguration) *resourceapi.ResourceClaimTemplate {
	return &resourceapi.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{req}, Constraints: constraints, Config: config}}},
	}
}

func create(t *testing.T, ns string, tmpl *resourceapi.ResourceClaimTemplate, pods ...*v1.Pod) {
	t.Helper()
	ctx := context.Background()
	if tmpl != nil {
		_, err := cluster.Client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, tmpl, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	for _, p := range pods {
		_, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{})
		require.NoError(t, err)
	}
}

func TestImpossibleRequestStaysPending(t *testing.T) {
	ns := namespace(t)
	// Nine GPUs on one NVLink domain: a DGX H100 has eight.
	create(t, ns, template("nine", resourceapi.DeviceRequest{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{
		DeviceClassName: "gpu.gpudra.dev", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 9}},
		[]resourceapi.DeviceConstraint{{Requests: []string{"gpu"}, MatchAttribute: ptr(resourceapi.FullyQualifiedName("gpu.gpudra.dev/nvlinkDomain"))}}, nil),
		gpuPod("too-big", "nine"))
	cond := waitUnschedulable(t, ns, "too-big")
	assert.Equal(t, v1.PodReasonUnschedulable, cond.Reason)
	assert.Contains(t, cond.Message, "cannot allocate all claims")
	// And it stays so.
	time.Sleep(2 * time.Second)
	p, err := cluster.Client.CoreV1().Pods(ns).Get(context.Background(), "too-big", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, v1.PodPending, p.Status.Phase)
	assert.Empty(t, p.Spec.NodeName)
}

// waitUnschedulable waits for the scheduler to give up on the pod and
// returns its PodScheduled condition.
func waitUnschedulable(t *testing.T, ns, name string) v1.PodCondition {
	t.Helper()
	var cond v1.PodCondition
	err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		p, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for _, c := range p.Status.Conditions {
			if c.Type == v1.PodScheduled && c.Status == v1.ConditionFalse {
				cond = c
				return true, nil
			}
		}
		return false, nil
	})
	require.NoError(t, err, "the scheduler did not report pod %s/%s unschedulable", ns, name)
	return cond
}

func TestDeletingAPodUnpreparesItsClaim(t *testing.T) {
	ns := namespace(t)
	apply(t, ns, filepath.Join(examples, "single-gpu"))
	pod := waitRunning(t, ns, "single-gpu")
	claim := podClaim(t, pod, "gpu")
	require.True(t, hasSpecFor(t, pod.Spec.NodeName, string(claim.UID)))

	ctx := context.Background()
	require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(ctx, pod.Name, metav1.DeleteOptions{}))
	waitPodGone(t, ns, pod.Name)
	assert.False(t, hasSpecFor(t, pod.Spec.NodeName, string(claim.UID)), "CDI spec removed at unprepare")
	// The garbage collector deletes the generated claim once its pod is gone.
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, claim.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	})
	assert.NoError(t, err, "generated claim %s not deleted", claim.Name)
}

func TestPluginRestartKeepsPreparedClaims(t *testing.T) {
	ns := namespace(t)
	apply(t, ns, filepath.Join(examples, "mig"))
	pod := waitRunning(t, ns, "mig")
	node := cluster.Node(pod.Spec.NodeName)
	small := podClaim(t, pod, "small")
	migUUID := views(t, pod)["small"].VisibleGPUs()[0]

	require.NoError(t, node.RestartPlugin())
	require.NoError(t, node.WaitForSlices(context.Background()))
	// The claim is still prepared: its spec is there and its MIG device
	// still exists (not destroyed as a leftover, not created twice).
	assert.True(t, hasSpecFor(t, node.Name, string(small.UID)))
	inv, err := node.Machine.Inventory(context.Background())
	require.NoError(t, err)
	count := 0
	for _, g := range inv.GPUs {
		for _, m := range g.MIG.Devices {
			if m.UUID == migUUID {
				count++
			}
		}
	}
	assert.Equal(t, 1, count, "MIG device of the prepared claim survives the restart")

	// The restarted plugin serves new pods and unprepares the old ones.
	apply(t, ns, filepath.Join(examples, "single-gpu"))
	waitRunning(t, ns, "single-gpu")
	ctx := context.Background()
	require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(ctx, "mig", metav1.DeleteOptions{}))
	waitPodGone(t, ns, "mig")
	assert.False(t, hasSpecFor(t, node.Name, string(small.UID)))
}

// withoutWebhook takes gpudra's admission webhook out of the API server's
// path until the test ends, as on a cluster installed without the
// controller or with objects admitted before it was: the plugin is the last
// line of defence and must still say what is wrong. The API server learns
// of webhook configurations through an informer, so both ways it waits
// until a dry run of probe (an object the webhook refuses) shows the change.
func withoutWebhook(t *testing.T, ns string, probe *resourceapi.ResourceClaimTemplate) {
	t.Helper()
	ctx := context.Background()
	hooks := cluster.Client.AdmissionregistrationV1().ValidatingWebhookConfigurations()
	refused := func() bool {
		_, err := cluster.Client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, probe, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err != nil
	}
	saved, err := hooks.Get(ctx, devcluster.WebhookConfigurationName, metav1.GetOptions{})
	require.NoError(t, err)
	require.NoError(t, hooks.Delete(ctx, saved.Name, metav1.DeleteOptions{}))
	require.Eventually(t, func() bool { return !refused() }, 30*time.Second, 100*time.Millisecond, "the API server still calls the deleted webhook")
	t.Cleanup(func() {
		restored := saved.DeepCopy()
		restored.ResourceVersion, restored.UID = "", ""
		_, err := hooks.Create(ctx, restored, metav1.CreateOptions{})
		require.NoError(t, err)
		require.NoError(t, cluster.WaitForWebhook(ctx, 30*time.Second))
		require.Eventually(t, refused, 30*time.Second, 100*time.Millisecond, "the API server does not call the restored webhook")
	})
}

func TestInvalidOpaqueConfigIsAnEventOnThePod(t *testing.T) {
	ns := namespace(t)
	params := runtime.RawExtension{Raw: []byte(`{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"Everything"}}`)}
	bad := template("bad-config", resourceapi.DeviceRequest{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.gpudra.dev"}}, nil,
		[]resourceapi.DeviceClaimConfiguration{{DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{
			Driver: slicebuilder.DriverName, Parameters: params}}}})
	// The webhook refuses it at the door, naming the field.
	_, err := cluster.Client.ResourceV1().ResourceClaimTemplates(ns).Create(context.Background(), bad, metav1.CreateOptions{})
	require.ErrorContains(t, err, "sharing.strategy")

	withoutWebhook(t, ns, bad)
	create(t, ns, bad, gpuPod("bad-config", "bad-config"))
	var event v1.Event
	err = wait.PollUntilContextTimeout(context.Background(), 200*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		events, err := cluster.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		for _, e := range events.Items {
			// The Node authorizer may refuse the kubelet's first read of a
			// new claim (its graph lags the pod): retried, not this test's.
			if e.InvolvedObject.Name == "bad-config" && e.Reason == "FailedPrepareDynamicResources" && !strings.Contains(e.Message, "is forbidden") {
				event = e
				return true, nil
			}
		}
		return false, nil
	})
	require.NoError(t, err, "no FailedPrepareDynamicResources event on the pod")
	assert.Equal(t, v1.EventTypeWarning, event.Type)
	assert.Contains(t, event.Message, "sharing.strategy")
	assert.Contains(t, event.Message, `"Everything"`)
	p, err := cluster.Client.CoreV1().Pods(ns).Get(context.Background(), "bad-config", metav1.GetOptions{})
	require.NoError(t, err)
	assert.NotEqual(t, v1.PodRunning, p.Status.Phase)
}

// Every slice the plugin would publish, for every simulated machine, passes
// the API server's validation (server-side dry run), and the nodes' plugins
// published exactly what they computed.
func TestAPIServerAcceptsEverySlice(t *testing.T) {
	machines := append(sim.BuiltinMachines(), filepath.Join(examples, "machines", "two-h100-mig.yaml"))
	ctx := context.Background()
	for _, name := range machines {
		t.Run(filepath.Base(name), func(t *testing.T) {
			m, err := sim.NewBuiltin(name, "dry-run-node")
			require.NoError(t, err)
			inv, err := m.Inventory(ctx)
			require.NoError(t, err)
			res, err := slicebuilder.Build(inv, "dry-run-node", slicebuilder.Options{})
			require.NoError(t, err)
			slices := slicebuilder.ResourceSlices(res, "dry-run-node")
			// And with fractional GPUs (consumable capacity, request policies).
			fractional, err := slicebuilder.Build(inv, "dry-run-node", slicebuilder.Options{FractionalGPUs: true})
			require.NoError(t, err)
			slices = append(slices, slicebuilder.ResourceSlices(fractional, "dry-run-node")...)
			require.NotEmpty(t, slices)
			for i := range slices {
				s := slices[i]
				if s.Name == "" {
					s.Name = fmt.Sprintf("dry-run-%d", i)
				}
				_, err := cluster.Client.ResourceV1().ResourceSlices().Create(ctx, &s, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
				require.NoError(t, err, "slice %d of %s rejected: %s", i, name, sliceSummary(s))
			}
		})
	}
	for _, n := range cluster.Nodes() {
		require.NoError(t, n.WaitForSlices(ctx), "node %s", n.Name)
	}
}

func sliceSummary(s resourceapi.ResourceSlice) string {
	b, _ := json.Marshal(map[string]int{"devices": len(s.Spec.Devices), "counterSets": len(s.Spec.SharedCounters)})
	return string(b)
}

func ptr[T any](v T) *T { return &v }
