package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"

	"github.com/gpudra/gpudra/devcluster/nodeagent"
)

// These tests do to the kubelet plugin what a real node does: a rolling
// update with two plugin pods of one node side by side, and a checkpoint
// damaged while pods run.

// migCount counts the node's MIG devices with one of the UUIDs.
func migCount(t *testing.T, node *nodeagent.Node, uuids ...string) int {
	t.Helper()
	inv, err := node.Machine.Inventory(context.Background())
	require.NoError(t, err)
	n := 0
	for _, g := range inv.GPUs {
		for _, m := range g.MIG.Devices {
			for _, u := range uuids {
				if m.UUID == u {
					n++
				}
			}
		}
	}
	return n
}

// migPod runs the mig example (two MIG devices the driver creates) in a new
// namespace and returns the pod, its claims and the MIG UUIDs it sees.
func migPod(t *testing.T) (*v1.Pod, []*resourceapi.ResourceClaim, []string) {
	t.Helper()
	ns := namespace(t)
	apply(t, ns, filepath.Join(examples, "mig"))
	pod := waitRunning(t, ns, "mig")
	var uuids []string
	for _, v := range views(t, pod) {
		uuids = append(uuids, v.VisibleGPUs()...)
	}
	require.Len(t, uuids, 2)
	return pod, []*resourceapi.ResourceClaim{podClaim(t, pod, "small"), podClaim(t, pod, "medium")}, uuids
}

// unprepareThrough plays the kubelet towards one plugin instance: the
// kubelet may call either instance during a rolling update.
func unprepareThrough(t *testing.T, socket string, claims []*resourceapi.ResourceClaim) {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer conn.Close()
	req := &drapb.NodeUnprepareResourcesRequest{}
	for _, c := range claims {
		req.Claims = append(req.Claims, &drapb.Claim{Namespace: c.Namespace, Name: c.Name, Uid: string(c.UID)})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := drapb.NewDRAPluginClient(conn).NodeUnprepareResources(ctx, req)
	require.NoError(t, err)
	for uid, r := range resp.Claims {
		require.Empty(t, r.Error, "unprepare of claim %s", uid)
	}
}

// TestRollingUpdateTwoPluginInstances: the new plugin pod starts beside the
// old one; a claim prepared through one instance is unprepared through the
// other, and nothing is lost or leaked.
func TestRollingUpdateTwoPluginInstances(t *testing.T) {
	first, firstClaims, firstMigs := migPod(t)
	node := cluster.Node(first.Spec.NodeName)
	old, err := node.StartRollingUpdate()
	require.NoError(t, err)
	defer func() {
		if old != nil {
			old.Stop()
		}
	}()
	require.NoError(t, node.WaitForSlices(context.Background()))

	// A pod started during the update: the kubelet prepares it through the
	// newest registered instance.
	second, secondClaims, secondMigs := migPod(t)
	require.Equal(t, node.Name, second.Spec.NodeName, "the MIG example lands on the MIG node")
	require.Equal(t, 2, migCount(t, node, secondMigs...))

	// The old instance unprepares the claims the new one prepared, and the
	// new one those the old one prepared: each knows the other's claims.
	unprepareThrough(t, old.DRASocket(), secondClaims)
	assert.Equal(t, 0, migCount(t, node, secondMigs...), "the old instance destroyed the MIG devices the new one created")
	for _, c := range secondClaims {
		assert.False(t, hasSpecFor(t, node.Name, string(c.UID)), "CDI spec of %s removed", c.Name)
	}
	unprepareThrough(t, node.Plugin().Sockets[0], firstClaims)
	assert.Equal(t, 0, migCount(t, node, firstMigs...), "the new instance destroyed the MIG devices the old one created")

	// The old pod terminates; the kubelet's own unprepares at pod deletion
	// find nothing left to do and succeed.
	old.Stop()
	old = nil
	ctx := context.Background()
	for _, p := range []*v1.Pod{first, second} {
		require.NoError(t, cluster.Client.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{}))
		waitPodGone(t, p.Namespace, p.Name)
	}
	for _, c := range append(firstClaims, secondClaims...) {
		assert.False(t, hasSpecFor(t, node.Name, string(c.UID)))
	}
	// The node still serves new pods through the new instance.
	third, _, thirdMigs := migPod(t)
	assert.Equal(t, 2, migCount(t, node, thirdMigs...))
	require.NoError(t, cluster.Client.CoreV1().Pods(third.Namespace).Delete(ctx, third.Name, metav1.DeleteOptions{}))
	waitPodGone(t, third.Namespace, third.Name)
	assert.Equal(t, 0, migCount(t, node, thirdMigs...))
}

// TestCorruptCheckpointWhilePodsRun: the checkpoint is damaged while a pod
// runs on MIG devices the driver created. After a plugin restart the pod's
// devices are still prepared (nothing destroyed), the Node Event says what
// happened, and deleting the pod still destroys the driver's MIG devices.
func TestCorruptCheckpointWhilePodsRun(t *testing.T) {
	pod, claims, migs := migPod(t)
	node := cluster.Node(pod.Spec.NodeName)
	ctx := context.Background()

	node.StopPlugin()
	path := filepath.Join(node.PluginDataDir(), "checkpoint.json")
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	b[len(b)/3] ^= 0x5a
	require.NoError(t, os.WriteFile(path, b, 0o600))
	require.NoError(t, node.StartPlugin())
	require.NoError(t, node.WaitForSlices(ctx))

	for _, c := range claims {
		assert.True(t, hasSpecFor(t, node.Name, string(c.UID)), "CDI spec of %s kept", c.Name)
	}
	assert.Equal(t, 2, migCount(t, node, migs...), "the running pod's MIG devices are not destroyed")

	var event v1.Event
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 20*time.Second, true, func(ctx context.Context) (bool, error) {
		events, err := cluster.Client.CoreV1().Events(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		for _, e := range events.Items {
			if e.InvolvedObject.Kind == "Node" && e.InvolvedObject.Name == node.Name && e.Reason == "CheckpointCorrupt" &&
				strings.Contains(e.Message, pod.Namespace+"/") {
				event = e
				return true, nil
			}
		}
		return false, nil
	})
	require.NoError(t, err, "no CheckpointCorrupt event on node %s naming the pod's claims", node.Name)
	assert.Equal(t, v1.EventTypeWarning, event.Type)
	for _, c := range claims {
		assert.Contains(t, event.Message, c.Namespace+"/"+c.Name, "the event names the adopted claim")
	}
	assert.Contains(t, event.Message, "nothing running pods use was destroyed")

	require.NoError(t, cluster.Client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{}))
	waitPodGone(t, pod.Namespace, pod.Name)
	assert.Equal(t, 0, migCount(t, node, migs...), "the adopted MIG devices are destroyed at unprepare")
	for _, c := range claims {
		assert.False(t, hasSpecFor(t, node.Name, string(c.UID)))
	}
}
