package e2e

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/pkg/plugin"
)

// eventsNodeName is a node of its own for these tests: its GPUs go bad and
// its inventory reads fail, and no other test's pod may land there.
const eventsNodeName = "events-0"

var eventsNodeOnce sync.Once

func eventsNode(t *testing.T) *nodeagent.Node {
	t.Helper()
	eventsNodeOnce.Do(func() {
		n, err := cluster.AddNode(context.Background(), nodeagent.NodeOptions{Name: eventsNodeName, Machine: "dgx-h100-nomig",
			Taints: []v1.Taint{{Key: "gpudra.dev/e2e-events", Value: "true", Effect: v1.TaintEffectNoSchedule}}})
		require.NoError(t, err)
		require.NoError(t, n.WaitForSlices(context.Background()))
	})
	n := cluster.Node(eventsNodeName)
	require.NotNil(t, n, "node %s was not added", eventsNodeName)
	return n
}

// waitNodeEvent waits for an events.k8s.io/v1 Event regarding the node
// with reason whose note contains what. A Node's Events are in namespace
// default: the recorder puts an Event about a cluster-scoped object there.
func waitNodeEvent(t *testing.T, node, reason, what string) eventsv1.Event {
	t.Helper()
	var found *eventsv1.Event
	err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		list, err := cluster.Client.EventsV1().Events(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{
			FieldSelector: fmt.Sprintf("regarding.kind=Node,regarding.name=%s,reason=%s,reportingController=%s", node, reason, plugin.EventsReportingController)})
		if err != nil {
			return false, nil
		}
		for i, ev := range list.Items {
			if strings.Contains(ev.Note, what) {
				found = &list.Items[i]
				return true, nil
			}
		}
		return false, nil
	})
	require.NoError(t, err, "no %s Event regarding Node %s about %s", reason, node, what)
	return *found
}

func taintOf(t *testing.T, pool, dev string) string {
	t.Helper()
	if taints := device(t, pool, dev).Taints; len(taints) > 0 {
		return taints[0].Value
	}
	return ""
}

// A GPU that turns unhealthy gets an events.k8s.io/v1 Event regarding its
// Node (with the Node's UID, so `kubectl describe node` lists it), naming
// the GPU and the XID; its recovery gets one too. Through the core API the
// same Event shows as involving the Node.
func TestUnhealthyGPURecordsANodeEvent(t *testing.T) {
	ctx := context.Background()
	node := eventsNode(t)
	nodeObj, err := cluster.Client.CoreV1().Nodes().Get(ctx, eventsNodeName, metav1.GetOptions{})
	require.NoError(t, err)
	uuid := attr(device(t, eventsNodeName, "gpu-1"), "uuid")

	require.NoError(t, node.Machine.InjectXID(uuid, "", 48)) // double-bit ECC error
	ev := waitNodeEvent(t, eventsNodeName, plugin.ReasonGPUUnhealthy, uuid)
	assert.Equal(t, v1.EventTypeWarning, ev.Type)
	assert.Equal(t, v1.ObjectReference{APIVersion: "v1", Kind: "Node", Name: eventsNodeName, UID: nodeObj.UID, FieldPath: "devices{gpu-1}"}, ev.Regarding)
	assert.Equal(t, "TaintDevices", ev.Action)
	assert.Contains(t, ev.Note, "GPU gpu-1 ("+uuid+") is unhealthy: XID 48")
	assert.NotEmpty(t, ev.ReportingInstance)

	core, err := cluster.Client.CoreV1().Events(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{
		FieldSelector: "involvedObject.kind=Node,involvedObject.name=" + eventsNodeName + ",reason=" + plugin.ReasonGPUUnhealthy})
	require.NoError(t, err)
	var names []string
	for _, e := range core.Items {
		names = append(names, e.Name)
	}
	assert.Contains(t, names, ev.Name, "kubectl get events finds it as a Node's Event")

	require.NoError(t, node.Machine.ResetGPU(uuid))
	ev = waitNodeEvent(t, eventsNodeName, plugin.ReasonGPURecovered, uuid)
	assert.Equal(t, v1.EventTypeNormal, ev.Type)
	assert.Equal(t, "devices{gpu-1}", ev.Regarding.FieldPath)
}

// The GPU goes bad while every NVML read fails: the republish that would
// taint it fails, and is retried (with backoff) until the reads work
// again, when the taint appears in the node's ResourceSlice. Nothing else
// would publish it: the inventory poll sees no change in the GPUs.
func TestFailedRepublishIsRetried(t *testing.T) {
	node := eventsNode(t)
	uuid := attr(device(t, eventsNodeName, "gpu-2"), "uuid")
	require.Empty(t, taintOf(t, eventsNodeName, "gpu-2"))

	before := node.Machine.InventoryFailures()
	node.Machine.FailInventory(-1)
	t.Cleanup(func() { node.Machine.FailInventory(0) })
	require.NoError(t, node.Machine.InjectXID(uuid, "", 48))
	// The plugin saw the fault (its Event says so) and tried to publish.
	waitNodeEvent(t, eventsNodeName, plugin.ReasonGPUUnhealthy, uuid)
	err := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return node.Machine.InventoryFailures() > before, nil
	})
	require.NoError(t, err, "nothing read the GPUs after the fault")
	time.Sleep(time.Second) // a few failed retries
	assert.Empty(t, taintOf(t, eventsNodeName, "gpu-2"), "nothing can be published while the reads fail")
	failed := node.Machine.InventoryFailures() - before

	node.Machine.FailInventory(0)
	start := time.Now()
	err = wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 20*time.Second, true, func(context.Context) (bool, error) {
		return taintOf(t, eventsNodeName, "gpu-2") != "", nil
	})
	require.NoError(t, err, "the taint was not published once the reads worked again (%d failed reads)", failed)
	assert.Equal(t, "xid-48", taintOf(t, eventsNodeName, "gpu-2"))
	t.Logf("%d failed reads; taint published %s after the reads worked again", failed, time.Since(start).Round(time.Millisecond))

	require.NoError(t, node.Machine.ResetGPU(uuid))
	err = wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 20*time.Second, true, func(context.Context) (bool, error) {
		return taintOf(t, eventsNodeName, "gpu-2") == "", nil
	})
	assert.NoError(t, err, "the taint did not go after the reset")
}

// The chart's RBAC lets the plugin's service account write events.k8s.io
// Events (create, and patch and update for a series), and no longer core
// Events, which nothing in the plugin writes.
func TestChartRBACAllowsNodeEvents(t *testing.T) {
	ctx := context.Background()
	// A release of its own, so that this test needs no other to run first.
	const release = "gpudra-events"
	out, err := render(t, "--set", "fullnameOverride="+release)
	require.NoError(t, err, out)
	var rbac []*unstructured.Unstructured
	for _, o := range objectsFrom(t, out) {
		if (o.GetKind() == "ClusterRole" || o.GetKind() == "ClusterRoleBinding") && strings.HasSuffix(o.GetName(), "-kubelet-plugin") {
			rbac = append(rbac, o)
		}
	}
	require.Len(t, rbac, 2)
	require.NoError(t, cluster.Apply(ctx, chartNamespace, rbac))
	sa := impersonate(t, "system:serviceaccount:"+chartNamespace+":"+release+"-kubelet-plugin", eventsNodeName)

	event := &eventsv1.Event{
		ObjectMeta: metav1.ObjectMeta{Name: eventsNodeName + ".rbac", Namespace: metav1.NamespaceDefault},
		EventTime:  metav1.NowMicro(), ReportingController: plugin.EventsReportingController, ReportingInstance: "e2e",
		Action: "TaintDevices", Reason: plugin.ReasonGPUUnhealthy, Type: v1.EventTypeWarning, Note: "RBAC check",
		Regarding: v1.ObjectReference{APIVersion: "v1", Kind: "Node", Name: eventsNodeName},
	}
	// RBAC is granted asynchronously: wait until the create is allowed.
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 20*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err = sa.EventsV1().Events(metav1.NamespaceDefault).Create(ctx, event, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err == nil, nil
	})
	require.NoError(t, err, "the plugin may not create events.k8s.io Events")
	_, err = sa.EventsV1().Events(metav1.NamespaceDefault).Patch(ctx, "no-such-event", types.StrategicMergePatchType, []byte(`{"series":{"count":2}}`), metav1.PatchOptions{})
	assert.True(t, apierrors.IsNotFound(err), "patch (a series) is allowed, the Event just does not exist: %v", err)
	_, err = sa.EventsV1().Events(metav1.NamespaceDefault).Update(ctx, &eventsv1.Event{ObjectMeta: metav1.ObjectMeta{Name: "no-such-event", Namespace: metav1.NamespaceDefault}}, metav1.UpdateOptions{})
	assert.False(t, apierrors.IsForbidden(err), "update is allowed: %v", err)

	_, err = sa.CoreV1().Events(metav1.NamespaceDefault).Create(ctx, &v1.Event{ObjectMeta: metav1.ObjectMeta{GenerateName: "core-"},
		InvolvedObject: v1.ObjectReference{Kind: "Node", Name: eventsNodeName}, Reason: "Test"}, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
	assert.True(t, apierrors.IsForbidden(err), "core Events are not granted any more: %v", err)
}
