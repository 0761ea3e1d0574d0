package realnode

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/devcluster/realnode"
	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// gpuPod is a pod on the real node with a claim for one whole GPU, made
// from a template, its container the probe.
func gpuPod(t *testing.T, c *devcluster.Cluster, node, name string) *v1.Pod {
	t.Helper()
	ctx := context.Background()
	tmpl := &resourceapi.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Name: "one-gpu", Namespace: "default"},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: slicebuilder.DriverName}}}}}}}
	if _, err := c.Client.ResourceV1().ResourceClaimTemplates("default").Create(ctx, tmpl, metav1.CreateOptions{}); err != nil {
		require.True(t, strings.Contains(err.Error(), "already exists"), err.Error())
	}
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec: v1.PodSpec{NodeSelector: map[string]string{v1.LabelHostname: node}, TerminationGracePeriodSeconds: ptr.To(int64(1)),
			ResourceClaims: []v1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: ptr.To(tmpl.Name)}},
			Containers: []v1.Container{{Name: "probe", Image: realnode.ProbeImage, ImagePullPolicy: v1.PullNever,
				Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu"}}}}}}}
	_, err := c.Client.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{})
	require.NoError(t, err)
	return pod
}

// podGPU is the one GPU the running pod's probe sees, after checking that
// it is exactly its claim's.
func podGPU(t *testing.T, c *devcluster.Cluster, pod *v1.Pod) string {
	t.Helper()
	rs, err := c.RealProbeReports(context.Background(), pod, 30*time.Second)
	require.NoError(t, err)
	assertSeesExactly(t, c, pod, pod.Spec.Containers[0], rs["probe"])
	nodes := gpuNodes(rs["probe"])
	require.Len(t, nodes, 1, "pod %s", pod.Name)
	return nodes[0]
}

// pluginPod is the plugin pod of that name, with its container's status.
func pluginPod(t *testing.T, c *devcluster.Cluster, name string) (*v1.Pod, v1.ContainerStatus) {
	t.Helper()
	p, err := c.Client.CoreV1().Pods(chart.PluginNamespace).Get(context.Background(), name, metav1.GetOptions{})
	require.NoError(t, err)
	for _, cs := range p.Status.ContainerStatuses {
		if cs.Name == "plugin" {
			return p, cs
		}
	}
	t.Fatalf("plugin pod %s has no plugin container status", name)
	return nil, v1.ContainerStatus{}
}

// TestRealNodeSurvivesRestartsAndARollingUpdate: with claims prepared on
// the real node, (1) the kubelet is killed and started again, (2) the
// plugin's container is killed and the kubelet restarts it, (3) a second
// plugin pod starts beside the first, as a rolling update with surge
// does, and the first then goes, and (4) a pod is deleted while its claim
// is being prepared. After each, the pods already running keep their
// containers and devices, a new pod gets a claim prepared on a GPU no other
// container has, and a deleted pod's claim is unprepared: its CDI spec
// goes.
func TestRealNodeSurvivesRestartsAndARollingUpdate(t *testing.T) {
	b := binaries(t)
	img := imageTarball(t)
	ctx := context.Background()
	c, err := devcluster.Start(ctx, devcluster.Options{RealNodes: true, Chart: chart.Default(repo)})
	require.NoError(t, err)
	t.Cleanup(c.Stop)
	const name = "real-node-0"
	n, err := c.AddRealNode(ctx, devcluster.RealNodeOptions{Name: name, Binaries: b, Image: img, Machine: "dgx-h100-nomig"})
	require.NoError(t, err)
	_, err = c.InstallChartDeviceClasses(ctx)
	require.NoError(t, err)
	cdiDir := filepath.Join(n.KubeletRootDir(), "cdi")
	firstPlugin := nodeagent.MetricsPodName(name)

	// held are the running pods and the GPU each sees: no GPU twice.
	held := map[string]string{}
	hold := func(pod *v1.Pod) {
		t.Helper()
		running := runs(t, c, pod, "pod "+pod.Name)
		gpu := podGPU(t, c, running)
		for other, g := range held {
			assert.NotEqual(t, g, gpu, "pods %s and %s both see %s", pod.Name, other, gpu)
		}
		held[pod.Name] = gpu
	}
	// stillHeld: every held pod runs its first container, unrestarted,
	// and sees the same GPU.
	containerIDs := map[string]string{}
	stillHeld := func(after string) {
		t.Helper()
		for podName, gpu := range held {
			p, err := c.Client.CoreV1().Pods("default").Get(ctx, podName, metav1.GetOptions{})
			require.NoError(t, err, after)
			require.Equal(t, v1.PodRunning, p.Status.Phase, "%s: pod %s", after, podName)
			require.Len(t, p.Status.ContainerStatuses, 1)
			cs := p.Status.ContainerStatuses[0]
			if id, ok := containerIDs[podName]; ok {
				assert.Equal(t, id, cs.ContainerID, "%s: pod %s keeps its container", after, podName)
			}
			containerIDs[podName] = cs.ContainerID
			assert.Zero(t, cs.RestartCount, "%s: pod %s", after, podName)
			assert.Equal(t, gpu, podGPU(t, c, p), "%s: pod %s sees its GPU still", after, podName)
		}
	}
	claimUID := func(pod string) string {
		t.Helper()
		p, err := c.Client.CoreV1().Pods("default").Get(ctx, pod, metav1.GetOptions{})
		require.NoError(t, err)
		require.Len(t, p.Status.ResourceClaimStatuses, 1)
		claim, err := c.Client.ResourceV1().ResourceClaims("default").Get(ctx, *p.Status.ResourceClaimStatuses[0].ResourceClaimName, metav1.GetOptions{})
		require.NoError(t, err)
		return string(claim.UID)
	}
	// release deletes a pod and waits until the kubelet has unprepared
	// its claim: the pod is gone, and so is its claim's CDI spec.
	release := func(pod string) {
		t.Helper()
		uid := claimUID(pod)
		require.NotEmpty(t, specsOf(t, cdiDir, []string{uid}), "pod %s's claim has a CDI spec while it runs", pod)
		require.NoError(t, c.Client.CoreV1().Pods("default").Delete(ctx, pod, metav1.DeleteOptions{}))
		err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
			_, err := c.Client.CoreV1().Pods("default").Get(ctx, pod, metav1.GetOptions{})
			return err != nil && len(specsOf(t, cdiDir, []string{uid})) == 0, nil
		})
		require.NoError(t, err, "pod %s goes and its claim is unprepared: %v", pod, specsOf(t, cdiDir, []string{uid}))
		delete(held, pod)
		delete(containerIDs, pod)
	}

	hold(gpuPod(t, c, name, "before-0"))
	hold(gpuPod(t, c, name, "before-1"))
	stillHeld("at first")

	// (1) The kubelet crashes and comes back: it reads its DRA manager's
	// checkpoint, finds the plugin again through its registry, and leaves
	// the running containers alone.
	sliceUIDs := func() (map[string]bool, int) {
		list, err := c.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil {
			return nil, 0
		}
		uids, devices := map[string]bool{}, 0
		for _, s := range list.Items {
			if s.Spec.Pool.Name == name {
				uids[string(s.UID)] = true
				devices += len(s.Spec.Devices)
			}
		}
		return uids, devices
	}
	before, _ := sliceUIDs()
	require.NotEmpty(t, before)
	require.NoError(t, n.RestartKubelet(ctx))
	restarted := time.Now()
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		lease, err := c.Client.CoordinationV1().Leases("kube-node-lease").Get(ctx, name, metav1.GetOptions{})
		// Renewed by the new kubelet: after the restart.
		return err == nil && lease.Spec.RenewTime != nil && lease.Spec.RenewTime.After(restarted), nil
	})
	require.NoError(t, err, "the restarted kubelet renews its Lease")
	// A starting kubelet deletes its node's ResourceSlices; the plugin,
	// registered again, publishes them anew.
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		uids, devices := sliceUIDs()
		for uid := range uids {
			if before[uid] {
				return false, nil // not deleted yet
			}
		}
		return devices == 8, nil
	})
	require.NoError(t, err, "the plugin publishes the node's 8 GPUs again after the kubelet's restart")
	// The kubeletplugin helper alone waits its 30 s sync delay; the
	// plugin publishes at the deletion (gpudra_plugin_resourceslices_deleted_total).
	back := time.Since(restarted)
	t.Logf("the node's slices were deleted and back %s after the kubelet was started again", back.Round(100*time.Millisecond))
	assert.Less(t, back, 10*time.Second, "the plugin publishes as soon as the kubelet has deleted its node's slices")
	stillHeld("after the kubelet's restart")
	hold(gpuPod(t, c, name, "after-kubelet-restart"))
	release("before-0")

	// (2) The plugin's container is killed; the kubelet starts it again
	// in the same pod (restartPolicy Always), and it re-registers.
	_, cs := pluginPod(t, c, firstPlugin)
	out, err := exec.CommandContext(ctx, b.Ctr, "--address", n.ContainerdSocket(), "--namespace", "k8s.io", "tasks", "kill", "--signal", "SIGKILL",
		strings.TrimPrefix(cs.ContainerID, "containerd://")).CombinedOutput()
	require.NoError(t, err, "ctr tasks kill: %s", out)
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		p, cs := pluginPod(t, c, firstPlugin)
		return cs.RestartCount == 1 && cs.Ready && p.Status.Phase == v1.PodRunning, nil
	})
	require.NoError(t, err, "the kubelet restarts the plugin's container: %s", n.ContainerLog(chart.PluginNamespace, firstPlugin, "plugin", 10))
	stillHeld("after the plugin's container restart")
	hold(gpuPod(t, c, name, "after-plugin-restart"))
	release("before-1")

	// (3) A rolling update with surge: a second plugin pod runs beside
	// the first, each registered under its own pod UID; the kubelet
	// uses the newer. Then the first goes.
	const secondPlugin = "gpudra-kubelet-plugin-surge"
	require.NoError(t, c.RunRealPluginPod(ctx, name, secondPlugin))
	p1, cs1 := pluginPod(t, c, firstPlugin)
	p2, cs2 := pluginPod(t, c, secondPlugin)
	assert.Equal(t, v1.PodRunning, p1.Status.Phase, "the old plugin pod still runs beside the new one")
	assert.Equal(t, v1.PodRunning, p2.Status.Phase)
	assert.True(t, cs1.Ready && cs2.Ready, "both plugin pods are Ready side by side")
	stillHeld("with two plugin pods")
	hold(gpuPod(t, c, name, "during-update"))
	require.NoError(t, c.Client.CoreV1().Pods(chart.PluginNamespace).Delete(ctx, firstPlugin, metav1.DeleteOptions{}))
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := c.Client.CoreV1().Pods(chart.PluginNamespace).Get(ctx, firstPlugin, metav1.GetOptions{})
		return err != nil, nil
	})
	require.NoError(t, err, "the old plugin pod goes")
	stillHeld("after the update")
	hold(gpuPod(t, c, name, "after-update"))
	release("after-kubelet-restart")

	// (4) A pod deleted while its claim is prepared: as soon as the
	// scheduler has placed it. Its claim ends unprepared, and its GPU is
	// free for the next pod.
	gone := gpuPod(t, c, name, "deleted-in-prepare")
	var uid string
	err = wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		p, err := c.Client.CoreV1().Pods("default").Get(ctx, gone.Name, metav1.GetOptions{})
		if err != nil || p.Spec.NodeName == "" || len(p.Status.ResourceClaimStatuses) == 0 {
			return false, nil
		}
		claim, err := c.Client.ResourceV1().ResourceClaims("default").Get(ctx, *p.Status.ResourceClaimStatuses[0].ResourceClaimName, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		uid = string(claim.UID)
		return true, nil
	})
	require.NoError(t, err, "the scheduler places the pod")
	require.NoError(t, c.Client.CoreV1().Pods("default").Delete(ctx, gone.Name, metav1.DeleteOptions{}))
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := c.Client.CoreV1().Pods("default").Get(ctx, gone.Name, metav1.GetOptions{})
		return err != nil && len(specsOf(t, cdiDir, []string{uid})) == 0, nil
	})
	require.NoError(t, err, "the pod deleted in prepare goes, its claim unprepared: %v", specsOf(t, cdiDir, []string{uid}))
	hold(gpuPod(t, c, name, "last"))
	stillHeld("at the end")

	// No plugin container restarted but the one killed, and no claim's
	// CDI spec is left but the running pods'.
	_, cs2 = pluginPod(t, c, secondPlugin)
	assert.Zero(t, cs2.RestartCount, "the new plugin pod never restarted: %s", n.ContainerLog(chart.PluginNamespace, secondPlugin, "plugin", 10))
	var uids []string
	for pod := range held {
		uids = append(uids, claimUID(pod))
	}
	entries, err := os.ReadDir(cdiDir)
	require.NoError(t, err)
	claimSpecs := 0
	for _, e := range entries {
		// A claim's spec is named for its UID (cdi.SpecName).
		if strings.HasPrefix(e.Name(), cdi.SpecName("")) {
			claimSpecs++
		}
	}
	assert.Len(t, specsOf(t, cdiDir, uids), len(held), "each running pod's claim has its CDI spec")
	assert.Equal(t, len(held), claimSpecs, "no other claim's CDI spec is left: %v", entries)
}
