package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/pkg/deviceplugin"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/sharing"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// The device-plugin-mode nodes: dpNode (added by TestMain) has GPUs 0-5
// whole and GPUs 6-7 in MIG mode (two 1g.10gb on GPU 6, one 3g.40gb on
// GPU 7); dpSharedNode (added by the time-slicing test) has one H100
// time-sliced into four nvidia.com/gpu.shared replicas, dpMPSNode (added
// by the MPS test) one H100 shared by two MPS replicas, dpSwitchNode
// (added by the mode switch test) one H100 that changes modes.
const (
	dpNode       = "dp-h100-0"
	dpMachine    = "testdata/dp-h100.yaml"
	dpSharedNode = "dp-h100-ts-0"
	dpMPSNode    = "dp-h100-mps-0"
	dpSwitchNode = "dp-h100-switch-0"
	// draSwitchNode is added in DRA mode (tainted as a device-plugin
	// node) and switched to device-plugin mode by the same test.
	draSwitchNode = "dra-h100-switch-0"
)

// dpNodeConfig is dpNode's config, explicit where the defaults (NVIDIA's)
// are not what these tests need: the mixed MIG strategy (GPUs 6-7's MIG
// devices per profile; none would advertise GPUs 6-7 whole), and CDI names
// (devcluster's kubelet resolves a device plugin's CdiDevices only; envvar
// would answer with the device nodes, mounts and variables themselves).
var dpNodeConfig = mustDPConfig("version: v1\nflags:\n  migStrategy: mixed\n  plugin:\n    deviceListStrategy: cdi-cri\n")

// mustDPConfig parses a device plugin config of these tests.
func mustDPConfig(y string) *deviceplugin.Config {
	c, err := deviceplugin.ParseConfig([]byte(y))
	if err != nil {
		panic(err)
	}
	return c
}

// dpPod asks for device plugin resources (limits, as the device plugin API
// wants) on one device-plugin node.
func dpPod(name, node string, resources map[string]int64) *v1.Pod {
	limits := v1.ResourceList{}
	for r, n := range resources {
		limits[v1.ResourceName(r)] = *resource.NewQuantity(n, resource.DecimalSI)
	}
	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: v1.PodSpec{
			RestartPolicy: v1.RestartPolicyNever,
			NodeSelector:  map[string]string{"kubernetes.io/hostname": node},
			Tolerations:   []v1.Toleration{{Key: nodeagent.DevicePluginTaintKey, Operator: v1.TolerationOpExists}},
			Containers: []v1.Container{{Name: "cuda", Image: "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04",
				Resources: v1.ResourceRequirements{Limits: limits}}},
		},
	}
}

// inventory is the node's GPUs and MIG devices by UUID.
func inventory(t *testing.T, node *nodeagent.Node) (map[string]nvdevice.GPU, map[string]nvdevice.MigDevice) {
	t.Helper()
	inv, err := node.Machine.Inventory(context.Background())
	require.NoError(t, err)
	gpus, migs := map[string]nvdevice.GPU{}, map[string]nvdevice.MigDevice{}
	for _, g := range inv.GPUs {
		gpus[g.UUID] = g
		for _, m := range g.MIG.Devices {
			migs[m.UUID] = m
		}
	}
	return gpus, migs
}

// nodeResource is the node's capacity and allocatable of one resource.
func nodeResource(t *testing.T, node, name string) (capacity, allocatable int64) {
	t.Helper()
	n, err := cluster.Client.CoreV1().Nodes().Get(context.Background(), node, metav1.GetOptions{})
	require.NoError(t, err)
	c, a := n.Status.Capacity[v1.ResourceName(name)], n.Status.Allocatable[v1.ResourceName(name)]
	return c.Value(), a.Value()
}

func waitAllocatable(t *testing.T, node, name string, want int64) {
	t.Helper()
	var got int64
	err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, got = nodeResource(t, node, name)
		return got == want, nil
	})
	require.NoError(t, err, "node %s: allocatable %s is %d, want %d", node, name, got, want)
}

// The device-plugin node's Node object carries what the kubelet's device
// manager reports from the plugin's ListAndWatch: whole GPUs as
// nvidia.com/gpu, MIG devices per profile.
func TestDevicePluginNodeAllocatable(t *testing.T) {
	node := cluster.Node(dpNode)
	require.NotNil(t, node)
	assert.Equal(t, nodeagent.ModeDevicePlugin, node.Mode())
	for name, want := range map[string]int64{"nvidia.com/gpu": 6, "nvidia.com/mig-1g.10gb": 2, "nvidia.com/mig-3g.40gb": 1} {
		c, a := nodeResource(t, dpNode, name)
		assert.Equal(t, want, c, "capacity %s", name)
		assert.Equal(t, want, a, "allocatable %s", name)
	}
	// No DRA on this node: nothing published.
	slices, err := cluster.Client.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	for _, s := range slices.Items {
		assert.NotEqual(t, dpNode, s.Spec.Pool.Name, "slice %s", s.Name)
	}
}

// nvidia.com/gpu: 2 is scheduled by extended resource, allocated by the
// kubelet's device manager (GetPreferredAllocation, Allocate), and the
// container's CDI devices give it exactly two whole GPUs of one NVLink
// domain; a second such pod gets two others, a pod asking for more than
// what is left stays pending.
func TestDevicePluginTwoGPUs(t *testing.T) {
	node := cluster.Node(dpNode)
	require.NotNil(t, node)
	ns := namespace(t)
	gpus, _ := inventory(t, node)

	create(t, ns, nil, dpPod("two", dpNode, map[string]int64{"nvidia.com/gpu": 2}), dpPod("two-more", dpNode, map[string]int64{"nvidia.com/gpu": 2}))
	seen := map[string]string{}
	for _, name := range []string{"two", "two-more"} {
		pod := waitRunning(t, ns, name)
		assert.Equal(t, dpNode, pod.Spec.NodeName)
		view := views(t, pod)["cuda"]
		require.Len(t, view.VisibleGPUs(), 2, "%s: %+v", name, view)
		domains := map[string]bool{}
		for _, uuid := range view.VisibleGPUs() {
			g, ok := gpus[uuid]
			require.True(t, ok, "%s sees %s, not a whole GPU of the node", name, uuid)
			assert.False(t, g.MIG.Enabled, "%s got GPU %d in MIG mode", name, g.Index)
			require.NotEmpty(t, g.NVLink.Domain, "GPU %d has no NVLink domain", g.Index)
			domains[g.NVLink.Domain] = true
			require.NotContains(t, seen, uuid, "GPU %s given to %s and %s", uuid, seen[uuid], name)
			seen[uuid] = name
		}
		assert.Len(t, domains, 1, "%s: GPUs of one NVLink domain", name)
		// The same container edits as DRA's: device-plugin CDI names from
		// the node-wide spec, plus the driver's common spec.
		for _, uuid := range view.VisibleGPUs() {
			g := gpus[uuid]
			assert.Contains(t, view.CDIDevices, deviceplugin.CDIDeviceName(slicebuilder.GPUDeviceName(&g)), name)
		}
		assert.NotEmpty(t, view.DriverMounts, "%s: driver files", name)
		// From inside: exactly these two GPUs' nodes.
		var want []string
		for _, uuid := range view.VisibleGPUs() {
			want = append(want, fmt.Sprintf("/dev/nvidia%d", gpus[uuid].Minor))
		}
		assertSeesFromInside(t, name, view, want)
	}
	// 6 whole GPUs, 4 taken: a pod asking for 3 does not fit.
	create(t, ns, nil, dpPod("three", dpNode, map[string]int64{"nvidia.com/gpu": 3}))
	assert.Contains(t, waitUnschedulable(t, ns, "three").Message, "nvidia.com/gpu", "unschedulable for the extended resource")

	// Deleting a pod frees its GPUs: the kubelet's device manager gives
	// them to the waiting pod (once the scheduler sees room).
	require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(context.Background(), "two", metav1.DeleteOptions{}))
	waitPodGone(t, ns, "two")
	pod := waitRunning(t, ns, "three")
	assert.Len(t, views(t, pod)["cuda"].VisibleGPUs(), 3)
}

// A MIG resource (mixed strategy) gets the MIG device configured on the
// node: the container's device nodes give it that MIG device only.
func TestDevicePluginMIGDevice(t *testing.T) {
	node := cluster.Node(dpNode)
	require.NotNil(t, node)
	ns := namespace(t)
	gpus, migs := inventory(t, node)

	create(t, ns, nil, dpPod("mig-small", dpNode, map[string]int64{"nvidia.com/mig-1g.10gb": 1}),
		dpPod("mig-big", dpNode, map[string]int64{"nvidia.com/mig-3g.40gb": 1}))
	for name, profile := range map[string]string{"mig-small": "1g.10gb", "mig-big": "3g.40gb"} {
		pod := waitRunning(t, ns, name)
		view := views(t, pod)["cuda"]
		require.Len(t, view.VisibleGPUs(), 1, "%s: %+v", name, view)
		m, ok := migs[view.VisibleGPUs()[0]]
		require.True(t, ok, "%s sees %s, not a MIG device", name, view.VisibleGPUs()[0])
		assert.Equal(t, profile, m.Profile, name)
		for _, g := range gpus {
			assert.NotContains(t, view.VisibleGPUs(), g.UUID, "%s sees a whole GPU", name)
		}
	}
}

// Time-slicing (the config file in NVIDIA's shape): one H100 advertised as
// four nvidia.com/gpu.shared replicas; four pods share the one GPU, a
// fifth does not fit.
func TestDevicePluginTimeSlicing(t *testing.T) {
	ctx := context.Background()
	node := cluster.Node(dpSharedNode)
	if node == nil {
		cfg, err := deviceplugin.ParseConfig([]byte(`version: v1
flags:
  plugin:
    deviceListStrategy: cdi-cri
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
      rename: nvidia.com/gpu.shared
`))
		require.NoError(t, err)
		node, err = cluster.AddNode(ctx, nodeagent.DevicePluginNode(dpSharedNode, filepath.Join(examples, "machines", "one-h100.yaml"), cfg))
		require.NoError(t, err)
		require.NoError(t, node.WaitForDevicePlugin(ctx))
	}
	c, a := nodeResource(t, dpSharedNode, "nvidia.com/gpu.shared")
	assert.Equal(t, int64(4), c)
	assert.Equal(t, int64(4), a)

	ns := namespace(t)
	gpus, _ := inventory(t, node)
	require.Len(t, gpus, 1)
	var only string
	for uuid := range gpus {
		only = uuid
	}
	for i := range 5 {
		create(t, ns, nil, dpPod(fmt.Sprintf("share-%d", i), dpSharedNode, map[string]int64{"nvidia.com/gpu.shared": 1}))
	}
	running := 0
	for i := range 4 {
		pod := waitRunning(t, ns, fmt.Sprintf("share-%d", i))
		assert.Equal(t, []string{only}, views(t, pod)["cuda"].VisibleGPUs(), "pod %s", pod.Name)
		running++
	}
	assert.Equal(t, 4, running, "four pods share one GPU")
	// The fifth is unschedulable: four replicas only.
	assert.Contains(t, waitUnschedulable(t, ns, "share-4").Message, "nvidia.com/gpu.shared")
}

// MPS replicas (sharing.mps): one MPS server pod for the GPU, started by
// the agent before it advertises the replicas and configured with one
// replica's share as the daemon's defaults; each replica's container gets
// the server's pipe directory and /dev/shm and the same share in its
// environment, through the CDI spec Allocate names; a third pod does not
// fit two replicas.
func TestDevicePluginMPS(t *testing.T) {
	ctx := context.Background()
	node := cluster.Node(dpMPSNode)
	if node == nil {
		cfg, err := deviceplugin.ParseConfig([]byte(`version: v1
flags:
  plugin:
    deviceListStrategy: cdi-cri
sharing:
  mps:
    resources:
    - name: nvidia.com/gpu
      replicas: 2
`))
		require.NoError(t, err)
		node, err = cluster.AddNode(ctx, nodeagent.DevicePluginNode(dpMPSNode, filepath.Join(examples, "machines", "one-h100.yaml"), cfg))
		require.NoError(t, err)
		require.NoError(t, node.WaitForDevicePlugin(ctx))
	}
	c, a := nodeResource(t, dpMPSNode, "nvidia.com/gpu")
	assert.Equal(t, int64(2), c)
	assert.Equal(t, int64(2), a)
	servers := waitMPSServers(t, dpMPSNode, 1)
	server := servers[0]
	gpus, _ := inventory(t, node)
	require.Len(t, gpus, 1)
	var only string
	for uuid := range gpus {
		only = uuid
	}
	assert.Equal(t, only, server.Pod.Annotations["gpu.gpudra.dev/mps-devices"], "the server serves the GPU")
	log, err := os.ReadFile(filepath.Join(server.Dir, "log", "control.log"))
	require.NoError(t, err)
	assert.Contains(t, string(log), "command set_default_active_thread_percentage 50")
	assert.Contains(t, string(log), "command set_default_device_pinned_mem_limit 0 40779M")

	ns := namespace(t)
	for i := range 3 {
		create(t, ns, nil, dpPod(fmt.Sprintf("mps-%d", i), dpMPSNode, map[string]int64{"nvidia.com/gpu": 1}))
	}
	for i := range 2 {
		pod := waitRunning(t, ns, fmt.Sprintf("mps-%d", i))
		v := views(t, pod)["cuda"]
		assert.Equal(t, []string{only}, v.VisibleGPUs(), "pod %s", pod.Name)
		assert.Contains(t, v.CDIDevices, deviceplugin.MPSCDIDeviceName("gpu-0"), "pod %s", pod.Name)
		assert.Equal(t, sharing.MPSPipeDirectory, v.Env["CUDA_MPS_PIPE_DIRECTORY"], "pod %s", pod.Name)
		assert.Equal(t, "50", v.Env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "pod %s", pod.Name)
		assert.Equal(t, "0=40779M", v.Env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "pod %s", pod.Name)
		assert.ElementsMatch(t, []string{filepath.Join(server.Dir, "pipe") + ":" + sharing.MPSPipeDirectory, filepath.Join(server.Dir, "shm") + ":/dev/shm"},
			v.Mounts, "pod %s: the GPU's server's pipe directory and /dev/shm", pod.Name)
		assertSeesMPSServer(t, pod.Name, v)
	}
	assert.Contains(t, waitUnschedulable(t, ns, "mps-2").Message, "nvidia.com/gpu", "two replicas only")
	assert.Len(t, mpsServers(t, dpMPSNode), 1, "one server for every replica of the GPU")
}

// An unhealthy GPU (a critical XID through the simulated machine) leaves
// allocatable: ListAndWatch reports it, the device manager counts it out;
// a GPU reset brings it back.
func TestDevicePluginUnhealthyGPULeavesAllocatable(t *testing.T) {
	node := cluster.Node(dpNode)
	require.NotNil(t, node)
	ctx := context.Background()
	inv, err := node.Machine.Inventory(ctx)
	require.NoError(t, err)
	var victim string
	for _, g := range inv.GPUs {
		if !g.MIG.Enabled {
			victim = g.UUID
			break
		}
	}
	waitAllocatable(t, dpNode, "nvidia.com/gpu", 6)
	require.NoError(t, node.Machine.InjectXID(victim, "", 48)) // double-bit ECC error
	waitAllocatable(t, dpNode, "nvidia.com/gpu", 5)
	c, _ := nodeResource(t, dpNode, "nvidia.com/gpu")
	assert.Equal(t, int64(6), c, "capacity keeps the unhealthy GPU")

	require.NoError(t, node.Machine.ResetGPU(victim))
	waitAllocatable(t, dpNode, "nvidia.com/gpu", 6)
}

// Switching a node from DRA to device-plugin mode while a claim is
// prepared there is refused: the node's agent, restarted in device-plugin
// mode, does not start and names the claim, read from the DRA plugin's real
// checkpoint; switched back, DRA mode starts with the claim still prepared
// and its pod untouched. The other way round: the device-plugin node's
// agent, restarted in DRA mode, is refused while the kubelet's pod-resources
// API (fed by its real device manager) lists a pod holding a GPU there, and
// switched back it serves the same devices again.
func TestDevicePluginModeSwitchRefused(t *testing.T) {
	ctx := context.Background()
	const draNode = "dgx-h100-1"
	node := cluster.Node(draNode)
	require.NotNil(t, node)
	ns := namespace(t)
	pod := gpuPod("holder", "one-gpu")
	pod.Spec.NodeSelector = map[string]string{"kubernetes.io/hostname": draNode}
	create(t, ns, template("one-gpu", resourceapi.DeviceRequest{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.gpudra.dev"}}, nil, nil), pod)
	holder := waitRunning(t, ns, "holder")
	claim := podClaim(t, holder, "gpu")

	err := node.SwitchMode(nodeagent.ModeDevicePlugin)
	require.Error(t, err, "device plugin mode must be refused while a claim is prepared")
	assert.Contains(t, err.Error(), "device plugin mode refused")
	assert.Contains(t, err.Error(), claim.Namespace+"/"+claim.Name)
	assert.Contains(t, err.Error(), string(claim.UID))
	assert.Contains(t, err.Error(), deviceplugin.DrainAdvice)
	t.Logf("refusal: %v", err)
	require.NoError(t, node.SwitchMode(nodeagent.ModeDRA), "back to DRA mode")
	require.NoError(t, node.WaitForSlices(ctx))
	assert.Error(t, deviceplugin.CheckDRADrained(node.PluginDataDir()), "the claim is still prepared")
	after, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, "holder", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, v1.PodRunning, after.Status.Phase)
	assert.Equal(t, views(t, holder)["cuda"].VisibleGPUs(), views(t, after)["cuda"].VisibleGPUs())

	// Drained, the check passes.
	require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(ctx, "holder", metav1.DeleteOptions{}))
	waitPodGone(t, ns, "holder")
	require.NoError(t, wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 20*time.Second, true, func(context.Context) (bool, error) {
		return deviceplugin.CheckDRADrained(node.PluginDataDir()) == nil, nil
	}), "drained node still refused")

	// The other way round, from the kubelet's device manager checkpoint.
	dp := cluster.Node(dpNode)
	require.NotNil(t, dp)
	_, gpusBefore := nodeResource(t, dpNode, "nvidia.com/gpu")
	create(t, ns, nil, dpPod("dp-holder", dpNode, map[string]int64{"nvidia.com/gpu": 1}))
	held := waitRunning(t, ns, "dp-holder")
	err = dp.SwitchMode(nodeagent.ModeDRA)
	require.Error(t, err, "DRA mode must be refused while a pod holds a device plugin GPU")
	assert.Contains(t, err.Error(), "DRA mode refused: the kubelet's pod-resources API ("+dp.PodResourcesSocket()+") lists 1 pod(s)")
	assert.Contains(t, err.Error(), "pod "+held.Namespace+"/"+held.Name+" (nvidia.com/gpu)")
	assert.Nil(t, dp.Plugin(), "no DRA plugin started")
	require.NoError(t, dp.SwitchMode(nodeagent.ModeDevicePlugin), "back to device-plugin mode")
	require.NoError(t, dp.WaitForDevicePlugin(ctx))
	waitAllocatable(t, dpNode, "nvidia.com/gpu", gpusBefore)
	assert.Equal(t, v1.PodRunning, waitRunning(t, ns, "dp-holder").Status.Phase)
}

// labelMode labels the node gpu.gpudra.dev/mode=mode, as an administrator
// does to move a node to the other DaemonSet of the chart
// (kubeletPlugin.perNodeMode).
func labelMode(t *testing.T, node, mode string) {
	t.Helper()
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%q}}}`, nodeagent.DevicePluginModeLabel, mode)
	_, err := cluster.Client.CoreV1().Nodes().Patch(context.Background(), node, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
	require.NoError(t, err)
}

// podResources is the kubelet's pod-resources answer for one pod, nil if
// it does not list the pod.
func podResources(t *testing.T, node *nodeagent.Node, ns, name string) *podresourcesv1.PodResources {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+node.PodResourcesSocket(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer func() { _ = conn.Close() }()
	resp, err := podresourcesv1.NewPodResourcesListerClient(conn).List(context.Background(), &podresourcesv1.ListPodResourcesRequest{})
	require.NoError(t, err)
	for _, p := range resp.GetPodResources() {
		if p.GetNamespace() == ns && p.GetName() == name {
			return p
		}
	}
	return nil
}

// podDeviceIDs are the device IDs of resource the pod's containers hold,
// as the kubelet's pod-resources API lists them.
func podDeviceIDs(t *testing.T, node *nodeagent.Node, ns, name, resource string) []string {
	t.Helper()
	pr := podResources(t, node, ns, name)
	require.NotNil(t, pr, "the pod-resources API does not list %s/%s", ns, name)
	var ids []string
	for _, c := range pr.GetContainers() {
		for _, d := range c.GetDevices() {
			if d.GetResourceName() == resource {
				ids = append(ids, d.GetDeviceIds()...)
			}
		}
	}
	return ids
}

// A node switched between modes, node by node as the chart's perNodeMode
// lets an administrator do it: drain the node, label it, the other mode's
// agent takes over (SwitchMode). Device plugin to DRA: refused while a pod
// holds the GPU (named by namespace/name, from the kubelet's pod-resources
// API); once the pod is deleted the kubelet's device checkpoint still
// records it, which alone would refuse, but the pod-resources API lists
// nobody and DRA mode starts. DRA to device plugin again once the claim's
// pod is gone: the node's kubelet runs the DRA and the device manager
// both, as a real one does, also on a node added in DRA mode.
func TestDevicePluginModeSwitchNodeByNode(t *testing.T) {
	ctx := context.Background()
	node := cluster.Node(dpSwitchNode)
	if node == nil {
		var err error
		node, err = cluster.AddNode(ctx, nodeagent.DevicePluginNode(dpSwitchNode, filepath.Join(examples, "machines", "one-h100.yaml"), nil))
		require.NoError(t, err)
	}
	require.Equal(t, nodeagent.ModeDevicePlugin, node.Mode())
	require.NoError(t, node.WaitForDevicePlugin(ctx))
	gpus, _ := inventory(t, node)
	require.Len(t, gpus, 1)
	var only string
	for uuid := range gpus {
		only = uuid
	}
	ns := namespace(t)
	resources := deviceplugin.OurResourceNames("", nil)

	// A pod holds the GPU: DRA mode is refused, naming it.
	create(t, ns, nil, dpPod("dp-holder", dpSwitchNode, map[string]int64{"nvidia.com/gpu": 1}))
	held := waitRunning(t, ns, "dp-holder")
	assert.Equal(t, []string{only}, podDeviceIDs(t, node, ns, "dp-holder", "nvidia.com/gpu"))
	labelMode(t, dpSwitchNode, nodeagent.ModeDRA)
	err := node.SwitchMode(nodeagent.ModeDRA)
	require.Error(t, err, "DRA mode must be refused while a pod holds the GPU")
	assert.Contains(t, err.Error(), "DRA mode refused: the kubelet's pod-resources API ("+node.PodResourcesSocket()+
		") lists 1 pod(s) holding GPUs through a device plugin: pod "+ns+"/dp-holder (nvidia.com/gpu); drain them")
	t.Logf("refusal: %v", err)
	labelMode(t, dpSwitchNode, nodeagent.ModeDevicePlugin)
	require.NoError(t, node.SwitchMode(nodeagent.ModeDevicePlugin), "back to device-plugin mode")
	require.NoError(t, node.WaitForDevicePlugin(ctx))

	// Drained: the checkpoint keeps the deleted pod's entry, the
	// pod-resources API does not list it.
	require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(ctx, "dp-holder", metav1.DeleteOptions{}))
	waitPodGone(t, ns, "dp-holder")
	checkpoint := filepath.Join(node.DevicePluginDir(), filepath.Base(deviceplugin.DefaultKubeletCheckpoint))
	stale, err := deviceplugin.DevicePluginAllocations(checkpoint, resources)
	require.NoError(t, err)
	// The kubelet drops the entry at its next UpdateAllocatedDevices (an
	// Allocate, or any pod-resources List): usually it is still there.
	if len(stale) > 0 {
		require.Len(t, stale, 1)
		assert.Equal(t, "UID "+string(held.UID), stale[0].Pod)
		err = deviceplugin.CheckDevicePluginDrained(ctx, deviceplugin.DeviceHolders{KubeletCheckpoint: checkpoint}, resources)
		require.Error(t, err, "the checkpoint alone would refuse")
		assert.Contains(t, err.Error(), "records 1 pod(s) holding GPUs through a device plugin: pod UID "+string(held.UID))
	} else {
		t.Log("the kubelet dropped the deleted pod's checkpoint entry already (a pod-resources List updates it)")
	}

	// To DRA mode: it starts, publishes the GPU, and a claim gets it.
	labelMode(t, dpSwitchNode, nodeagent.ModeDRA)
	require.NoError(t, node.SwitchMode(nodeagent.ModeDRA), "DRA mode on a drained node")
	assert.Nil(t, podResources(t, node, ns, "dp-holder"), "the pod-resources API lists no deleted pod")
	require.NoError(t, node.WaitForSlices(ctx))
	pod := gpuPod("dra-user", "one-gpu")
	pod.Spec.NodeSelector = map[string]string{"kubernetes.io/hostname": dpSwitchNode}
	pod.Spec.Tolerations = []v1.Toleration{{Key: nodeagent.DevicePluginTaintKey, Operator: v1.TolerationOpExists}}
	create(t, ns, template("one-gpu", resourceapi.DeviceRequest{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.gpudra.dev"}}, nil, nil), pod)
	user := waitRunning(t, ns, "dra-user")
	assert.Equal(t, []string{only}, views(t, user)["cuda"].VisibleGPUs())
	claim := podClaim(t, user, "gpu")
	// The kubelet's pod-resources API reports the claim (its DRA
	// manager), and no device plugin device.
	pr := podResources(t, node, ns, "dra-user")
	require.NotNil(t, pr)
	require.Len(t, pr.GetContainers(), 1)
	c := pr.GetContainers()[0]
	assert.Empty(t, c.GetDevices())
	require.Len(t, c.GetDynamicResources(), 1)
	assert.Equal(t, claim.Name, c.GetDynamicResources()[0].GetClaimName())
	require.Len(t, c.GetDynamicResources()[0].GetClaimResources(), 1)
	assert.Equal(t, slicebuilder.DriverName, c.GetDynamicResources()[0].GetClaimResources()[0].GetDriverName())
	assert.Equal(t, dpSwitchNode, c.GetDynamicResources()[0].GetClaimResources()[0].GetPoolName())

	// Back to device-plugin mode once the claim's pod is gone (the DRA
	// plugin unprepares it): the device manager takes the GPU again.
	require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(ctx, "dra-user", metav1.DeleteOptions{}))
	waitPodGone(t, ns, "dra-user")
	require.NoError(t, wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 20*time.Second, true, func(context.Context) (bool, error) {
		return deviceplugin.CheckDRADrained(node.PluginDataDir()) == nil, nil
	}), "drained node still refused")
	labelMode(t, dpSwitchNode, nodeagent.ModeDevicePlugin)
	require.NoError(t, node.SwitchMode(nodeagent.ModeDevicePlugin), "device-plugin mode on a drained node")
	require.NoError(t, node.WaitForDevicePlugin(ctx))
	waitAllocatable(t, dpSwitchNode, "nvidia.com/gpu", 1)
	create(t, ns, nil, dpPod("dp-again", dpSwitchNode, map[string]int64{"nvidia.com/gpu": 1}))
	waitRunning(t, ns, "dp-again")
	assert.Equal(t, []string{only}, podDeviceIDs(t, node, ns, "dp-again", "nvidia.com/gpu"))

	// A node added in DRA mode has a device manager too: labelled, it goes
	// to device-plugin mode and a pod gets its GPU there.
	dra := cluster.Node(draSwitchNode)
	if dra == nil {
		var err error
		dra, err = cluster.AddNode(ctx, nodeagent.NodeOptions{Name: draSwitchNode, Machine: filepath.Join(examples, "machines", "one-h100.yaml"),
			Taints: []v1.Taint{{Key: nodeagent.DevicePluginTaintKey, Value: "true", Effect: v1.TaintEffectNoSchedule}}})
		require.NoError(t, err)
		require.NoError(t, dra.WaitForSlices(ctx))
	}
	if dra.Mode() == nodeagent.ModeDRA {
		labelMode(t, draSwitchNode, nodeagent.ModeDevicePlugin)
		require.NoError(t, dra.SwitchMode(nodeagent.ModeDevicePlugin), "device-plugin mode on a node added in DRA mode")
	}
	require.NoError(t, dra.WaitForDevicePlugin(ctx))
	draGPUs, _ := inventory(t, dra)
	require.Len(t, draGPUs, 1)
	create(t, ns, nil, dpPod("dp-on-dra-node", draSwitchNode, map[string]int64{"nvidia.com/gpu": 1}))
	waitRunning(t, ns, "dp-on-dra-node")
	for uuid := range draGPUs {
		assert.Equal(t, []string{uuid}, podDeviceIDs(t, dra, ns, "dp-on-dra-node", "nvidia.com/gpu"))
	}
}
