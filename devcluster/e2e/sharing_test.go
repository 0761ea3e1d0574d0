package e2e

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpudra/gpudra/pkg/plugin"
	"github.com/gpudra/gpudra/pkg/sharing"
)

// mpsDaemon is the pid of the claim's MPS daemon on the node, 0 if none runs.
func mpsDaemon(t *testing.T, node, claimUID string) int {
	t.Helper()
	pid, err := sharing.RecordedDaemonPID(filepath.Join(cluster.Node(node).PluginDataDir(), "sharing", "mps", claimUID))
	if err != nil {
		return 0
	}
	if !(sharing.ExecMPSControl{}).Alive(pid) {
		return 0
	}
	return pid
}

func deviceStatus(t *testing.T, claim *resourceapi.ResourceClaim) plugin.SharingStatus {
	t.Helper()
	var st plugin.SharingStatus
	err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 10*time.Second, true, func(ctx context.Context) (bool, error) {
		c, err := cluster.Client.ResourceV1().ResourceClaims(claim.Namespace).Get(ctx, claim.Name, metav1.GetOptions{})
		if err != nil || len(c.Status.Devices) == 0 || c.Status.Devices[0].Data == nil {
			return false, nil
		}
		return true, json.Unmarshal(c.Status.Devices[0].Data.Raw, &st)
	})
	require.NoError(t, err, "claim %s has no device status", claim.Name)
	return st
}

func TestTimeSlicingTwoPods(t *testing.T) {
	ns := namespace(t)
	apply(t, ns, filepath.Join(examples, "time-slicing"))
	a, b := waitRunning(t, ns, "ts-trainer-a"), waitRunning(t, ns, "ts-trainer-b")
	assert.Equal(t, a.Spec.NodeName, b.Spec.NodeName)
	uuid := views(t, a)["cuda"].VisibleGPUs()
	require.Len(t, uuid, 1)
	assert.Equal(t, uuid, views(t, b)["cuda"].VisibleGPUs(), "both pods on the same GPU")
	machine := cluster.Node(a.Spec.NodeName).Machine
	assert.Equal(t, 3, machine.TimeSlice(uuid[0]), "interval Long is nvidia-smi's --set-timeslice 3")
	st := deviceStatus(t, podClaim(t, a, "gpu"))
	assert.Equal(t, "not enforced: time-slicing has no memory limit", st.Enforced["memory"])

	ctx := context.Background()
	require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(ctx, "ts-trainer-a", metav1.DeleteOptions{}))
	waitPodGone(t, ns, "ts-trainer-a")
	assert.Equal(t, 3, machine.TimeSlice(uuid[0]), "kept while a consumer is left")
	require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(ctx, "ts-trainer-b", metav1.DeleteOptions{}))
	waitPodGone(t, ns, "ts-trainer-b")
	assert.Equal(t, 0, machine.TimeSlice(uuid[0]), "restored to Default with the last claim")
}

func TestMPSTwoPods(t *testing.T) {
	ns := namespace(t)
	apply(t, ns, filepath.Join(examples, "mps"))
	a, b := waitRunning(t, ns, "mps-client-a"), waitRunning(t, ns, "mps-client-b")
	claim := podClaim(t, a, "gpu")
	for _, p := range []*v1.Pod{a, b} {
		v := views(t, p)["cuda"]
		assert.Equal(t, "0=40960M", v.Env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "pod %s", p.Name)
		assert.Equal(t, "50", v.Env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "pod %s", p.Name)
		assert.Equal(t, sharing.MPSPipeDirectory, v.Env["CUDA_MPS_PIPE_DIRECTORY"], "pod %s", p.Name)
		require.Len(t, v.Mounts, 1)
		assert.True(t, strings.HasSuffix(v.Mounts[0], ":"+sharing.MPSPipeDirectory), v.Mounts[0])
	}
	assert.Equal(t, views(t, a)["cuda"].Mounts, views(t, b)["cuda"].Mounts, "one daemon, one pipe directory")
	node := a.Spec.NodeName
	pid := mpsDaemon(t, node, string(claim.UID))
	require.NotZero(t, pid, "the claim's MPS daemon runs")
	st := deviceStatus(t, claim)
	assert.Equal(t, "40Gi", st.PinnedMemoryLimit)
	assert.Equal(t, int32(50), st.ActiveThreadPercentage)
	assert.Contains(t, st.Enforced["faults"], "not isolated")

	// A plugin restart keeps the daemon: adopted, not started twice.
	require.NoError(t, cluster.Node(node).RestartPlugin())
	require.NoError(t, cluster.Node(node).WaitForSlices(context.Background()))
	assert.Equal(t, pid, mpsDaemon(t, node, string(claim.UID)))
	log, err := os.ReadFile(filepath.Join(cluster.Node(node).PluginDataDir(), "sharing", "mps", string(claim.UID), "log", "control.log"))
	require.NoError(t, err)
	assert.Equal(t, 1, strings.Count(string(log), "daemon start"), string(log))
	assert.Contains(t, string(log), "command set_default_device_pinned_mem_limit 0 40960M")

	deleteAllPods(t, ns)
	assert.Zero(t, mpsDaemon(t, node, string(claim.UID)), "the daemon stops with the last consumer")
	_, err = os.Stat(filepath.Join(cluster.Node(node).PluginDataDir(), "sharing", "mps", string(claim.UID)))
	assert.True(t, os.IsNotExist(err), "its directories are removed")
}

func TestFractionalShares(t *testing.T) {
	ns := namespace(t)
	apply(t, ns, filepath.Join(examples, "fractional"))
	want := map[string]string{"share-a": "20Gi", "share-b": "20Gi", "share-c": "39Gi"}
	shareIDs := map[string]bool{}
	var device string
	for name, mem := range want {
		pod := waitRunning(t, ns, name)
		assert.Equal(t, fractionalNode, pod.Spec.NodeName)
		claim := podClaim(t, pod, "gpu")
		r := claim.Status.Allocation.Devices.Results[0]
		require.NotNil(t, r.ShareID, "%s: allocated as a share", name)
		shareIDs[string(*r.ShareID)] = true
		if device == "" {
			device = r.Device
		}
		assert.Equal(t, device, r.Device, "all shares of the one GPU")
		consumed := r.ConsumedCapacity["memory"]
		assert.True(t, resource.MustParse(mem).Equal(consumed), "%s consumed %s", name, consumed.String())
		limit := resource.MustParse(mem)
		v := views(t, pod)["cuda"]
		assert.Equal(t, "0="+strconv.FormatInt(limit.Value()>>20, 10)+"M", v.Env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "%s: capped at its share", name)
		st := deviceStatus(t, claim)
		assert.Equal(t, string(*r.ShareID), st.ShareID)
		assert.Equal(t, mem, st.PinnedMemoryLimit)
	}
	assert.Len(t, shareIDs, 3)

	// A fourth 20Gi share does not fit in what is left (81559Mi - 79Gi).
	fourth := gpuPod("share-d", "share-20gi")
	fourth.Spec.NodeSelector = map[string]string{"gpu.gpudra.dev/fractional": "true"}
	fourth.Spec.Tolerations = []v1.Toleration{{Key: "gpu.gpudra.dev/fractional", Operator: v1.TolerationOpExists, Effect: v1.TaintEffectNoSchedule}}
	create(t, ns, nil, fourth)
	cond := waitUnschedulable(t, ns, "share-d")
	assert.Equal(t, v1.PodReasonUnschedulable, cond.Reason)
	assert.Contains(t, cond.Message, "cannot allocate all claims")

	// When one share goes, the fourth fits.
	require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(context.Background(), "share-a", metav1.DeleteOptions{}))
	waitRunning(t, ns, "share-d")
}
