// Package realnode is the end-to-end suite of devcluster's real node: the
// kubelet binary and containerd (devcluster/realnode) joined to
// devcluster's control plane beside a simulated node.
package realnode

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
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
	"github.com/gpudra/gpudra/pkg/probe"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

const repo = "../../.."

// binaries are make real-node's (REAL_NODE_BIN) and make probe's (PROBE).
// Without them, or without root, the test skips, except under
// GPUDRA_REQUIRE_REAL_NODE=1 (make test), where it fails.
func binaries(t *testing.T) realnode.Binaries {
	t.Helper()
	dir := os.Getenv("REAL_NODE_BIN")
	if dir == "" {
		dir = filepath.Join(repo, "bin", "real-node")
	}
	dir, _ = filepath.Abs(dir)
	probeBin := os.Getenv("PROBE")
	if probeBin == "" {
		probeBin, _ = filepath.Abs(filepath.Join(repo, "bin", "gpudra-probe"))
	}
	b := realnode.Binaries{Kubelet: filepath.Join(dir, "kubelet"), Containerd: filepath.Join(dir, "containerd"),
		Shim: filepath.Join(dir, "containerd-shim-runc-v2"), Ctr: filepath.Join(dir, "ctr"), Runc: filepath.Join(dir, "runc"),
		CNI: filepath.Join(dir, "cni"), Pause: filepath.Join(dir, "pause"), Probe: probeBin,
		MPSControl: filepath.Join(dir, "nvidia-cuda-mps-control")}
	skip := func(reason string) {
		if os.Getenv("GPUDRA_REQUIRE_REAL_NODE") == "1" {
			t.Fatalf("a real node cannot run: %s", reason)
		}
		t.Skip(reason)
	}
	if os.Geteuid() != 0 {
		skip("containerd and the kubelet need root")
	}
	for _, p := range []string{b.Kubelet, b.Containerd, b.Shim, b.Ctr, b.Runc, b.Pause, b.Probe, b.MPSControl} {
		if _, err := os.Stat(p); err != nil {
			skip(err.Error() + " (make real-node probe builds it)")
		}
	}
	return b
}

// TestRealNodeRunsAPod: the kubelet binary, joined with a node credential,
// registers its Node (its own version, containerd's), holds its Lease as
// the Node authorizer lets only that node, and runs a pod the scheduler
// places there through containerd's CRI plugin, runc and the CNI bridge:
// the probe inside is PID 1 of its own namespace, has the pod's address
// and no GPU device node, and the pod's deletion ends its container.
func TestRealNodeRunsAPod(t *testing.T) {
	b := binaries(t)
	ctx := context.Background()
	c, err := devcluster.Start(ctx, devcluster.Options{RealNodes: true, Chart: chart.Default(repo)})
	require.NoError(t, err)
	t.Cleanup(c.Stop)
	_, err = c.AddNode(ctx, nodeagent.NodeOptions{Name: "dgx-h100-0", Machine: "dgx-h100-nomig"})
	require.NoError(t, err, "a simulated node beside the real one")
	const name = "real-node-0"
	n, err := c.AddRealNode(ctx, devcluster.RealNodeOptions{Name: name, Binaries: b})
	require.NoError(t, err)

	node, err := c.Client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, "v1.37.1", node.Status.NodeInfo.KubeletVersion, "the kubelet binary's own version")
	assert.True(t, strings.HasPrefix(node.Status.NodeInfo.ContainerRuntimeVersion, "containerd://2.4."), node.Status.NodeInfo.ContainerRuntimeVersion)
	var holder string
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		lease, err := c.Client.CoordinationV1().Leases("kube-node-lease").Get(ctx, name, metav1.GetOptions{})
		if err != nil || lease.Spec.HolderIdentity == nil {
			return false, nil
		}
		holder = *lease.Spec.HolderIdentity
		return true, nil
	})
	require.NoError(t, err, "the kubelet keeps its node's Lease, as system:node:%s: %s", name, grep(filepath.Join(n.Dir, "kubelet.log"), "ease"))
	assert.Equal(t, name, holder)

	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "plain-probe", Namespace: "default"},
		Spec: v1.PodSpec{NodeSelector: map[string]string{"kubernetes.io/hostname": name},
			TerminationGracePeriodSeconds: ptr.To(int64(1)),
			Containers:                    []v1.Container{{Name: "probe", Image: realnode.ProbeImage, ImagePullPolicy: v1.PullNever}}}}
	_, err = c.Client.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{})
	require.NoError(t, err)
	running := runs(t, c, pod, "the pod runs on the real node")
	assert.Equal(t, name, running.Spec.NodeName, "kube-scheduler placed it there")
	require.Len(t, running.Status.ContainerStatuses, 1)
	assert.True(t, strings.HasPrefix(running.Status.ContainerStatuses[0].ContainerID, "containerd://"), running.Status.ContainerStatuses[0].ContainerID)
	require.NotEmpty(t, running.Status.PodIP, "the CNI bridge gave the pod an address")
	assert.True(t, strings.HasPrefix(running.Status.PodIP, "10.244."), running.Status.PodIP)

	report := probeReport(t, n, running)
	assert.Equal(t, 1, report.PID, "the probe is PID 1 of the pod's own PID namespace")
	assert.Equal(t, pod.Name, report.Hostname)
	assert.Empty(t, report.Devices, "a pod without claims sees no GPU device node")

	require.NoError(t, c.Client.CoreV1().Pods("default").Delete(ctx, pod.Name, metav1.DeleteOptions{}))
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := c.Client.CoreV1().Pods("default").Get(ctx, pod.Name, metav1.GetOptions{})
		return err != nil, nil
	})
	require.NoError(t, err, "the kubelet ends the pod's container and the pod goes")

	// Stopping the cluster leaves nothing of the node mounted (the
	// kubelet's root, the pods' volumes, containers' roots, network
	// namespaces) and no process of it running.
	c.Stop()
	mounts, err := os.ReadFile("/proc/self/mountinfo")
	require.NoError(t, err)
	for _, l := range strings.Split(string(mounts), "\n") {
		assert.NotContains(t, l, " "+c.Dir+"/", "a mount of the stopped node is left")
	}
	for _, bin := range []string{b.Kubelet, b.Containerd, b.Shim} {
		out, err := exec.Command("pgrep", "-f", bin).Output()
		// pgrep exits 1 when nothing matches; anything else is no answer.
		var exit *exec.ExitError
		require.True(t, errors.As(err, &exit) && exit.ExitCode() == 1, "pgrep -f %s: %v %s", bin, err, out)
	}
}

// probeReport waits for the probe's report in the pod's container
// "probe", from the kubelet's pod log.
func probeReport(t *testing.T, n *realnode.Node, pod *v1.Pod) probe.Report {
	t.Helper()
	var report *probe.Report
	var last error
	err := wait.PollUntilContextTimeout(context.Background(), 200*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		report, last = n.ProbeReport(pod.Namespace, pod.Name, string(pod.UID), "probe")
		return last == nil, nil
	})
	require.NoError(t, err, "the probe's report: %v", last)
	return *report
}

// grep is the lines of file that hold s, for a failure's message.
func grep(file, s string) string {
	b, err := os.ReadFile(file)
	if err != nil {
		return err.Error()
	}
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, s) && len(out) < 10 {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// imageTarball is make image's docker tarball for this machine's
// architecture (GPUDRA_IMAGE_TARBALL; make test passes test-image's).
func imageTarball(t *testing.T) string {
	t.Helper()
	f := os.Getenv("GPUDRA_IMAGE_TARBALL")
	if f == "" {
		if os.Getenv("GPUDRA_REQUIRE_REAL_NODE") == "1" {
			t.Fatal("GPUDRA_IMAGE_TARBALL names no image tarball (make test passes test-image's)")
		}
		t.Skip("GPUDRA_IMAGE_TARBALL names no image tarball (make image builds one; make test-e2e REAL_NODE_IMAGE=<its absolute path> passes it)")
	}
	_, err := os.Stat(f)
	require.NoError(t, err, "GPUDRA_IMAGE_TARBALL")
	return f
}

// TestRealNodeRunsThePluginAndAClaim: the chart's kubelet plugin DaemonSet
// pod runs from make image's image under the real kubelet, registers
// through the kubelet's plugin registry and publishes the node's pool; a
// pod with a one-GPU claim then runs there, and from inside its container
// the probe sees exactly the allocated GPU's device node, which
// containerd made from the plugin's CDI spec.
func TestRealNodeRunsThePluginAndAClaim(t *testing.T) {
	b := binaries(t)
	img := imageTarball(t)
	ctx := context.Background()
	// GPUDRA_REAL_NODE_E2E_VALUES: helm flags added to the chart, to show
	// what a broken value does (kubeletPlugin.cdiDir where containerd does
	// not read fails the claim's pod, with the reason).
	chartOpts := chart.Default(repo)
	chartOpts.Values = strings.Fields(os.Getenv("GPUDRA_REAL_NODE_E2E_VALUES"))
	c, err := devcluster.Start(ctx, devcluster.Options{RealNodes: true, Chart: chartOpts})
	require.NoError(t, err)
	t.Cleanup(c.Stop)
	const name = "real-node-0"
	n, err := c.AddRealNode(ctx, devcluster.RealNodeOptions{Name: name, Binaries: b, Image: img, Machine: "dgx-h100-nomig"})
	require.NoError(t, err)
	_, err = c.InstallChartDeviceClasses(ctx)
	require.NoError(t, err)

	claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "one-gpu", Namespace: "default"},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{Name: "gpu",
			Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: slicebuilder.DriverName}}}}}}
	_, err = c.Client.ResourceV1().ResourceClaims("default").Create(ctx, claim, metav1.CreateOptions{})
	require.NoError(t, err)
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "one-gpu", Namespace: "default"},
		Spec: v1.PodSpec{NodeSelector: map[string]string{"kubernetes.io/hostname": name}, TerminationGracePeriodSeconds: ptr.To(int64(1)),
			ResourceClaims: []v1.PodResourceClaim{{Name: "gpu", ResourceClaimName: ptr.To(claim.Name)}},
			Containers: []v1.Container{{Name: "probe", Image: realnode.ProbeImage, ImagePullPolicy: v1.PullNever,
				Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu"}}}}}}}
	_, err = c.Client.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{})
	require.NoError(t, err)
	running := runs(t, c, pod, "the pod with a claim runs on the real node")
	got, err := c.Client.ResourceV1().ResourceClaims("default").Get(ctx, claim.Name, metav1.GetOptions{})
	require.NoError(t, err)
	require.NotNil(t, got.Status.Allocation)
	require.Len(t, got.Status.Allocation.Devices.Results, 1)
	device := got.Status.Allocation.Devices.Results[0].Device
	minor := strings.TrimPrefix(device, "gpu-")

	report := probeReport(t, n, running)
	var gpus []string
	for _, d := range report.Devices {
		if strings.HasPrefix(filepath.Base(d.Path), "nvidia") && strings.TrimPrefix(filepath.Base(d.Path), "nvidia") != "" &&
			strings.Trim(strings.TrimPrefix(filepath.Base(d.Path), "nvidia"), "0123456789") == "" {
			gpus = append(gpus, filepath.Base(d.Path))
			assert.Equal(t, "c", d.Type, d.Path)
			assert.Equal(t, uint32(195), d.Major, d.Path)
			assert.Equal(t, minor, strconv.Itoa(int(d.Minor)), d.Path)
		}
	}
	assert.Equal(t, []string{"nvidia" + minor}, gpus, "the container sees exactly the allocated %s, from containerd's CDI injection", device)
}

// waiting says why a pod's containers wait: their reasons and messages.
func waiting(p *v1.Pod) string {
	if p == nil {
		return "no pod"
	}
	out := []string{string(p.Status.Phase)}
	for _, cs := range p.Status.ContainerStatuses {
		if w := cs.State.Waiting; w != nil {
			out = append(out, cs.Name+": "+w.Reason+": "+w.Message)
		}
	}
	return strings.Join(out, "; ")
}

// runs waits until the pod is Running and returns it; the failure says why
// its containers wait.
func runs(t *testing.T, c *devcluster.Cluster, pod *v1.Pod, what string) *v1.Pod {
	t.Helper()
	var running *v1.Pod
	err := wait.PollUntilContextTimeout(context.Background(), 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		p, err := c.Client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		running = p
		return p.Status.Phase == v1.PodRunning, nil
	})
	require.NoError(t, err, "%s: %s", what, waiting(running))
	return running
}
