package e2e

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/devcluster/noderuntime"
	"github.com/gpudra/gpudra/pkg/plugin"
	"github.com/gpudra/gpudra/pkg/sharing"
)

// mpsServer is the MPS server of a node's GPU: its pod and the host's pid
// of its (stand-in) control daemon, which records its pid in its own PID
// namespace in its pipe directory.
type mpsServer struct {
	Pod *v1.Pod
	Dir string
	PID int
}

// assertSeesMPSServer checks, from inside a client container, that it
// sees what its server's container made: the daemon's control FIFO and
// pid in the pipe directory, and the server's shared memory in /dev/shm
// (the stand-in daemon writes it only in a container of its own).
func assertSeesMPSServer(t *testing.T, pod string, v noderuntime.ContainerView) {
	t.Helper()
	if !realMPSContainers() {
		return
	}
	require.NotNil(t, v.Report, "pod %s: no report from inside", pod)
	assert.Subset(t, v.Report.Dirs[sharing.MPSPipeDirectory], []string{"control", "control.pid"},
		"pod %s, from inside: the server's pipe directory", pod)
	assert.Contains(t, v.Report.Dirs["/dev/shm"], "cuda.shm.fake-mps-control",
		"pod %s, from inside: the /dev/shm its server writes its shared memory into", pod)
}

// mpsServers are the node's MPS server pods, with their daemons.
func mpsServers(t *testing.T, node string) []mpsServer {
	t.Helper()
	pods, err := cluster.Client.CoreV1().Pods(chart.PluginNamespace).List(context.Background(), metav1.ListOptions{
		LabelSelector: "app.kubernetes.io/component=" + sharing.MPSServerComponent, FieldSelector: "spec.nodeName=" + node})
	require.NoError(t, err)
	var out []mpsServer
	for i := range pods.Items {
		p := &pods.Items[i]
		s := mpsServer{Pod: p, Dir: p.Annotations["gpu.gpudra.dev/mps-dir"]}
		s.PID = daemonHostPID(s.Dir, string(p.UID))
		out = append(out, s)
	}
	return out
}

// waitMPSServers waits until the node has n MPS server pods whose daemons
// run.
func waitMPSServers(t *testing.T, node string, n int) []mpsServer {
	t.Helper()
	var got []mpsServer
	require.Eventually(t, func() bool {
		got = mpsServers(t, node)
		if len(got) != n {
			return false
		}
		for _, s := range got {
			if s.PID == 0 || syscall.Kill(s.PID, 0) != nil {
				return false
			}
		}
		return true
	}, 30*time.Second, 100*time.Millisecond, "node %s: want %d MPS servers running, have %d", node, n, len(got))
	return got
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
	node := a.Spec.NodeName
	servers := waitMPSServers(t, node, 1)
	server := servers[0]
	for _, p := range []*v1.Pod{a, b} {
		v := views(t, p)["cuda"]
		assert.Equal(t, "0=40960M", v.Env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "pod %s", p.Name)
		assert.Equal(t, "50", v.Env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "pod %s", p.Name)
		assert.Equal(t, sharing.MPSPipeDirectory, v.Env["CUDA_MPS_PIPE_DIRECTORY"], "pod %s", p.Name)
		assert.ElementsMatch(t, []string{filepath.Join(server.Dir, "pipe") + ":" + sharing.MPSPipeDirectory, filepath.Join(server.Dir, "shm") + ":/dev/shm"},
			v.Mounts, "pod %s: the GPU's server's pipe directory and /dev/shm", p.Name)
		assertSeesMPSServer(t, p.Name, v)
	}
	assert.Equal(t, views(t, a)["cuda"].VisibleGPUs(), strings.Split(server.Pod.Annotations["gpu.gpudra.dev/mps-devices"], ","), "the server serves the claim's GPU")
	st := deviceStatus(t, claim)
	assert.Equal(t, "40Gi", st.PinnedMemoryLimit)
	assert.Equal(t, int32(50), st.ActiveThreadPercentage)
	assert.Contains(t, st.Enforced["faults"], "not isolated")
	assert.Contains(t, st.Enforced["memory"], "not enforced against the client", "limits are in the client's environment")

	deleteAllPods(t, ns)
	require.Eventually(t, func() bool { return len(mpsServers(t, node)) == 0 }, 30*time.Second, 100*time.Millisecond, "the server pod goes with the last consumer")
	assert.Eventually(t, func() bool { return syscall.Kill(server.PID, 0) != nil }, 10*time.Second, 50*time.Millisecond, "its daemon quit")
	log, err := os.ReadFile(filepath.Join(server.Dir, "log", "control.log"))
	if err == nil {
		assert.Contains(t, string(log), "command quit")
	}
	_, err = os.Stat(server.Dir)
	assert.True(t, os.IsNotExist(err), "its directory is removed")
}

// TestMPSServersSurvivePluginContainerRestart: the plugin's container is
// restarted as on a real node, where it has its own PID namespace: every
// process it started dies. The workloads' MPS server (a pod of its own) keeps
// running, the same daemon, and their claims stay prepared.
func TestMPSServersSurvivePluginContainerRestart(t *testing.T) {
	ns := namespace(t)
	apply(t, ns, filepath.Join(examples, "mps"))
	a := waitRunning(t, ns, "mps-client-a")
	waitRunning(t, ns, "mps-client-b")
	node := a.Spec.NodeName
	before := waitMPSServers(t, node, 1)[0]

	killed, err := cluster.Node(node).RestartPluginContainer()
	require.NoError(t, err)
	t.Logf("the plugin container's restart killed %d processes", killed)
	require.NoError(t, cluster.Node(node).WaitForSlices(context.Background()))
	// The restarted plugin's supervision has run at least once.
	time.Sleep(6 * time.Second)
	after := waitMPSServers(t, node, 1)[0]
	assert.Equal(t, before.Pod.UID, after.Pod.UID, "the same server pod")
	assert.Equal(t, before.PID, after.PID, "the same daemon: the workloads kept their MPS server")
	log, err := os.ReadFile(filepath.Join(before.Dir, "log", "control.log"))
	require.NoError(t, err)
	assert.Equal(t, 1, strings.Count(string(log), "daemon start"), string(log))

	// A new consumer of the claim is served by the same server.
	pod := gpuPod("mps-client-c", "")
	pod.Spec.ResourceClaims = a.Spec.ResourceClaims
	create(t, ns, nil, pod)
	c := waitRunning(t, ns, "mps-client-c")
	assert.Equal(t, views(t, a)["cuda"].Mounts, views(t, c)["cuda"].Mounts)
	assert.Equal(t, before.PID, waitMPSServers(t, node, 1)[0].PID)
	deleteAllPods(t, ns)
	require.Eventually(t, func() bool { return len(mpsServers(t, node)) == 0 }, 30*time.Second, 100*time.Millisecond)
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
	servers := waitMPSServers(t, fractionalNode, 1)
	assert.Len(t, strings.Split(servers[0].Pod.Annotations["gpu.gpudra.dev/mps-devices"], ","), 1, "one MPS server for the GPU, shared by its three shares")

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
