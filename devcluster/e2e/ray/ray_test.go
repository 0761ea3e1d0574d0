package ray_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// TestRayClusterOnGPUs: KubeRay makes examples/ray's head and workers;
// each worker's claims, made from its group's ResourceClaimTemplate, are
// allocated on the worker's own node and prepared there, and its container
// is given exactly the claimed GPUs: the 8-GPU worker eight whole GPUs of
// one NVLink domain, the small workers a 1g.10gb MIG device each, the
// serving workers a 20Gi share of the fractional H100.
func TestRayClusterOnGPUs(t *testing.T) {
	ns := namespace(t)
	applyExample(t, ns)
	waitGroup(t, ns, "headgroup", 1)
	train := waitGroup(t, ns, trainGroup, 1)
	small := waitGroup(t, ns, migGroup, 2)
	serve := waitGroup(t, ns, serveGroup, 2)

	// KubeRay sees its workers ready.
	err := wait.PollUntilContextTimeout(context.Background(), 250*time.Millisecond, 60*time.Second, true, func(context.Context) (bool, error) {
		state, ready := rayClusterStatus(t, ns)
		return state == "ready" && ready == 5, nil
	})
	state, ready := rayClusterStatus(t, ns)
	require.NoError(t, err, "RayCluster state %q, %d ready workers", state, ready)

	assertEightGPUWorker(t, train[0])
	for _, pod := range small {
		assertMIGWorker(t, pod)
	}
	for _, pod := range serve {
		assertShareWorker(t, pod)
	}
}

// assertWorkerClaim checks what every worker's claim is: gpudra's devices,
// on the worker's node, prepared there. It returns the claim.
func assertWorkerClaim(t *testing.T, pod v1.Pod, podClaim string, devices int) (*resourceapi.ResourceClaim, []resourceapi.Device) {
	t.Helper()
	claim := claimOf(t, pod, podClaim)
	// Ray is told how many GPUs the worker has: rayStartParams, not the claim.
	c := pod.Spec.Containers[0]
	assert.Contains(t, strings.Join(append(c.Command, c.Args...), " "), fmt.Sprintf("--num-gpus=%d", devices),
		"%s: KubeRay's ray start", pod.Name)
	results := claim.Status.Allocation.Devices.Results
	require.Len(t, results, devices, "claim %s of %s", claim.Name, pod.Name)
	var devs []resourceapi.Device
	seen := map[string]bool{}
	for _, r := range results {
		assert.Equal(t, slicebuilder.DriverName, r.Driver)
		dev, node := device(t, r.Pool, r.Device)
		assert.Equal(t, pod.Spec.NodeName, node, "%s: device %s is on the worker's node", pod.Name, r.Device)
		assert.False(t, seen[r.Device], "%s: device %s allocated twice", pod.Name, r.Device)
		seen[r.Device] = true
		devs = append(devs, dev)
	}
	assert.True(t, hasSpecFor(t, pod.Spec.NodeName, claim.UID), "%s: claim %s prepared on %s", pod.Name, claim.Name, pod.Spec.NodeName)
	return claim, devs
}

func assertEightGPUWorker(t *testing.T, pod v1.Pod) {
	t.Helper()
	_, devs := assertWorkerClaim(t, pod, "gpus", 8)
	domains := map[string]bool{}
	var uuids []string
	for _, d := range devs {
		assert.Equal(t, "gpu", attr(d, "type"))
		domains[attr(d, "nvlinkDomain")] = true
		uuids = append(uuids, attr(d, "uuid"))
	}
	assert.Len(t, domains, 1, "%s: its 8 GPUs share one NVLink domain: %v", pod.Name, domains)
	assert.NotContains(t, domains, "")
	assert.ElementsMatch(t, uuids, visibleGPUs(t, pod, workerName), "%s is given exactly its 8 claimed GPUs", pod.Name)
}

func assertMIGWorker(t *testing.T, pod v1.Pod) {
	t.Helper()
	assert.Equal(t, migNode, pod.Spec.NodeName, pod.Name)
	_, devs := assertWorkerClaim(t, pod, "mig", 1)
	assert.Equal(t, "mig", attr(devs[0], "type"))
	assert.Equal(t, "1g.10gb", attr(devs[0], "migProfile"))
	visible := visibleGPUs(t, pod, workerName)
	require.Len(t, visible, 1, "%s is given one MIG device", pod.Name)
	profile, parent := migInstance(t, pod.Spec.NodeName, visible[0])
	assert.Equal(t, "1g.10gb", profile, "%s: the instance it is given", pod.Name)
	assert.Equal(t, attr(devs[0], "parentUUID"), parent, "%s: the instance is on the claimed GPU", pod.Name)
}

func assertShareWorker(t *testing.T, pod v1.Pod) {
	t.Helper()
	assert.Equal(t, fractionalNode, pod.Spec.NodeName, pod.Name)
	claim, devs := assertWorkerClaim(t, pod, "gpu", 1)
	r := claim.Status.Allocation.Devices.Results[0]
	require.NotNil(t, r.ShareID, "%s: allocated as a share", pod.Name)
	consumed := r.ConsumedCapacity["memory"]
	assert.True(t, resource.MustParse("20Gi").Equal(consumed), "%s consumed %s", pod.Name, consumed.String())
	assert.Equal(t, []string{attr(devs[0], "uuid")}, visibleGPUs(t, pod, workerName), "%s is given the shared GPU", pod.Name)
}

// migInstance is the profile and parent GPU of the node's MIG device with
// this UUID; empty if it does not exist (destroyed at unprepare).
func migInstance(t *testing.T, node, uuid string) (profile, parent string) {
	t.Helper()
	inv, err := cluster.Node(node).Machine.Inventory(context.Background())
	require.NoError(t, err)
	for _, g := range inv.GPUs {
		for _, m := range g.MIG.Devices {
			if m.UUID == uuid {
				return m.Profile, g.UUID
			}
		}
	}
	return "", ""
}

// workerGroup is one worker group's scale, as KubeRay's autoscaler writes
// it: replicas and the workers it chose to remove.
type workerGroup struct {
	index    int
	replicas int
	toDelete []string
}

// scale patches the RayCluster's worker groups as KubeRay's autoscaler
// does (a JSON patch of replicas and scaleStrategy.workersToDelete).
func scale(t *testing.T, ns string, groups ...workerGroup) {
	t.Helper()
	var ops []map[string]any
	for _, g := range groups {
		path := fmt.Sprintf("/spec/workerGroupSpecs/%d", g.index)
		ops = append(ops,
			map[string]any{"op": "replace", "path": path + "/replicas", "value": g.replicas},
			map[string]any{"op": "add", "path": path + "/scaleStrategy", "value": map[string]any{"workersToDelete": append([]string{}, g.toDelete...)}})
	}
	patch, err := json.Marshal(ops)
	require.NoError(t, err)
	_, err = rayClusters(t, ns).Patch(context.Background(), rayClusterName, types.JSONPatchType, patch, metav1.PatchOptions{})
	require.NoError(t, err)
}

// The example's worker groups, in its order.
const (
	trainIndex = iota
	migIndex
	serveIndex
)

// TestRayWorkerGroupScaling: the worker groups scaled down and up as
// KubeRay's autoscaler scales them. A removed worker's claims are deleted
// with it and unprepared on its node (its MIG instance destroyed); the
// workers that stay keep theirs; new workers get new claims, each on its
// own devices; at the end nothing of the cluster is left prepared.
func TestRayWorkerGroupScaling(t *testing.T) {
	ns := namespace(t)
	applyExample(t, ns)
	waitGroup(t, ns, "headgroup", 1)
	train := waitGroup(t, ns, trainGroup, 1)
	small := waitGroup(t, ns, migGroup, 2)
	serve := waitGroup(t, ns, serveGroup, 2)

	// Down: the 8-GPU worker, one small worker and one server go.
	removed := []struct {
		pod   v1.Pod
		claim string
	}{{train[0], "gpus"}, {small[0], "mig"}, {serve[0], "gpu"}}
	var removedClaims []*resourceapi.ResourceClaim
	for _, r := range removed {
		removedClaims = append(removedClaims, claimOf(t, r.pod, r.claim))
	}
	removedMIG := visibleGPUs(t, small[0], workerName)[0]
	keptMIG := claimOf(t, small[1], "mig")
	keptShare := claimOf(t, serve[1], "gpu")
	scale(t, ns, workerGroup{trainIndex, 0, []string{train[0].Name}}, workerGroup{migIndex, 1, []string{small[0].Name}},
		workerGroup{serveIndex, 1, []string{serve[0].Name}})
	assert.Empty(t, waitGroup(t, ns, trainGroup, 0))
	assert.Equal(t, small[1].Name, waitGroup(t, ns, migGroup, 1)[0].Name, "the autoscaler's choice is the worker removed")
	assert.Equal(t, serve[1].Name, waitGroup(t, ns, serveGroup, 1)[0].Name, "the autoscaler's choice is the worker removed")
	for i, claim := range removedClaims {
		waitClaimGone(t, claim)
		waitUnprepared(t, removed[i].pod.Spec.NodeName, claim.UID)
	}
	profile, _ := migInstance(t, migNode, removedMIG)
	assert.Empty(t, profile, "the removed worker's MIG instance %s is destroyed", removedMIG)
	assert.True(t, hasSpecFor(t, migNode, keptMIG.UID), "the small worker that stays keeps its claim prepared")
	assert.True(t, hasSpecFor(t, fractionalNode, keptShare.UID), "the server that stays keeps its claim prepared")

	// Up: two 8-GPU workers (one per MIG-off node), three small workers,
	// two servers, each with claims of its own.
	scale(t, ns, workerGroup{index: trainIndex, replicas: 2}, workerGroup{index: migIndex, replicas: 3},
		workerGroup{index: serveIndex, replicas: 2})
	train = waitGroup(t, ns, trainGroup, 2)
	small = waitGroup(t, ns, migGroup, 3)
	serve = waitGroup(t, ns, serveGroup, 2)
	assert.NotEqual(t, train[0].Spec.NodeName, train[1].Spec.NodeName, "one 8-GPU worker per DGX")
	old := map[types.UID]bool{}
	for _, c := range removedClaims {
		old[c.UID] = true
	}
	for _, pod := range train {
		assertEightGPUWorker(t, pod)
	}
	for _, pod := range small {
		assertMIGWorker(t, pod)
	}
	for _, pod := range serve {
		assertShareWorker(t, pod)
	}
	var claims []string
	for node, uids := range claimUIDsByNode(t, ns) {
		for _, uid := range uids {
			assert.False(t, old[uid], "a removed worker's claim %s came back", uid)
			claims = append(claims, node+"/"+string(uid))
		}
	}
	assert.Len(t, claims, 7, "one claim per worker: %s", strings.Join(claims, ", "))
	// applyExample's cleanup deletes the RayCluster and checks that
	// nothing of it is left prepared.
}
