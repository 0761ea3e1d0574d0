package realnode

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/devcluster/realnode"
)

// TestRealNodeServesTheDevicePluginFront: the chart in device-plugin mode
// (kubeletPlugin.mode) on a real node, with NVIDIA's config shape: MIG
// strategy mixed and two time-slicing replicas of each whole GPU. The real
// kubelet's device manager takes the plugin's registration at its fixed
// socket, advertises what it serves, and allocates it to pods through
// the plugin; containerd injects the devices from the CDI names the
// kubelet passes it (deviceListStrategy cdi-cri: the default, envvar,
// hands the kubelet host device nodes, which a simulated machine does not
// have in the host's /dev; containerd then fails with "lstat
// /dev/nvidiactl: no such file or directory"). On two H100s, GPU 0 in MIG
// mode with a 3g.40gb instance and GPU 1 whole: nvidia.com/gpu is GPU 1's
// two replicas and nvidia.com/mig-3g.40gb the instance. Two pods of one
// GPU each see GPU 1, time-sliced; a pod of the MIG resource sees GPU 0's
// node and the instance's two capability nodes; nothing else.
func TestRealNodeServesTheDevicePluginFront(t *testing.T) {
	b := binaries(t)
	img := imageTarball(t)
	ctx := context.Background()
	opts := chart.Default(repo)
	opts.Values = append(opts.Values, "--set", "kubeletPlugin.mode=device-plugin", "--set-json",
		`devicePlugin.config={"version":"v1","flags":{"migStrategy":"mixed","plugin":{"deviceListStrategy":"cdi-cri"}},"sharing":{"timeSlicing":{"resources":[{"name":"nvidia.com/gpu","replicas":2}]}}}`)
	c, err := devcluster.Start(ctx, devcluster.Options{RealNodes: true, Chart: opts})
	require.NoError(t, err)
	t.Cleanup(c.Stop)
	machine, err := filepath.Abs(filepath.Join(repo, "examples", "machines", "two-h100-mig.yaml"))
	require.NoError(t, err)
	const name = "real-node-0"
	_, err = c.AddRealNode(ctx, devcluster.RealNodeOptions{Name: name, Binaries: b, Image: img, Machine: machine})
	require.NoError(t, err)

	const mig = v1.ResourceName("nvidia.com/mig-3g.40gb")
	var node *v1.Node
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		node, err = c.Client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		return err == nil && !node.Status.Allocatable.Name(mig, resource.DecimalSI).IsZero() &&
			!node.Status.Allocatable.Name("nvidia.com/gpu", resource.DecimalSI).IsZero(), nil
	})
	require.NoError(t, err, "the kubelet advertises the device plugin's resources")
	assert.Equal(t, int64(2), node.Status.Allocatable.Name("nvidia.com/gpu", resource.DecimalSI).Value(), "GPU 1's two time-slicing replicas")
	assert.Equal(t, int64(1), node.Status.Allocatable.Name(mig, resource.DecimalSI).Value(), "GPU 0's 3g.40gb instance")

	podOf := func(podName string, res v1.ResourceName) *v1.Pod {
		pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: podName, Namespace: "default"},
			Spec: v1.PodSpec{NodeSelector: map[string]string{v1.LabelHostname: name}, TerminationGracePeriodSeconds: ptr.To(int64(1)),
				Containers: []v1.Container{{Name: "probe", Image: realnode.ProbeImage, ImagePullPolicy: v1.PullNever,
					Resources: v1.ResourceRequirements{Limits: v1.ResourceList{res: resource.MustParse("1")}}}}}}
		_, err := c.Client.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{})
		require.NoError(t, err)
		return runs(t, c, pod, "pod "+podName+" with "+string(res))
	}
	seen := func(pod *v1.Pod) (gpus []string, caps int) {
		rs, err := c.RealProbeReports(ctx, pod, 30*time.Second)
		require.NoError(t, err)
		r := rs["probe"]
		for _, d := range r.Devices {
			assert.Equal(t, "c", d.Type, d.Path)
			assert.NotEqual(t, "EPERM", d.OpenError, "the device cgroup allows %s", d.Path)
			if strings.HasPrefix(d.Path, "/dev/nvidia-caps/") {
				caps++
			}
		}
		return gpuNodes(r), caps
	}
	for _, p := range []string{"replica-a", "replica-b"} {
		gpus, caps := seen(podOf(p, "nvidia.com/gpu"))
		assert.Equal(t, []string{"/dev/nvidia1"}, gpus, "%s: a replica of GPU 1, the one GPU with MIG off", p)
		assert.Zero(t, caps, p)
	}
	gpus, caps := seen(podOf("mig-3g", mig))
	assert.Equal(t, []string{"/dev/nvidia0"}, gpus, "the MIG instance's parent")
	assert.Equal(t, 2, caps, "the instance's GPU-instance and compute-instance capability nodes")

	// Both replicas are taken: a third pod of nvidia.com/gpu waits.
	extra := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "replica-c", Namespace: "default"},
		Spec: v1.PodSpec{NodeSelector: map[string]string{v1.LabelHostname: name},
			Containers: []v1.Container{{Name: "probe", Image: realnode.ProbeImage, ImagePullPolicy: v1.PullNever,
				Resources: v1.ResourceRequirements{Limits: v1.ResourceList{"nvidia.com/gpu": resource.MustParse("1")}}}}}}
	_, err = c.Client.CoreV1().Pods("default").Create(ctx, extra, metav1.CreateOptions{})
	require.NoError(t, err)
	var why string
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		got, err := c.Client.CoreV1().Pods("default").Get(ctx, extra.Name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for _, cond := range got.Status.Conditions {
			if cond.Type == v1.PodScheduled && cond.Status == v1.ConditionFalse && cond.Reason == v1.PodReasonUnschedulable {
				why = cond.Message
				return got.Spec.NodeName == "", nil
			}
		}
		return false, nil
	})
	require.NoError(t, err, "no third replica to give: kube-scheduler finds the pod unschedulable")
	assert.Contains(t, why, "Insufficient nvidia.com/gpu")

	// The kubelet's device manager wrote its checkpoint in the machine's
	// /var/lib/kubelet/device-plugins; the node takes it with it, or any
	// DRA-mode plugin on this machine reading the default path would
	// refuse to start over its pods.
	checkpoint := filepath.Join(realnode.KubeletDevicePluginDir, "kubelet_internal_checkpoint")
	_, err = os.Stat(checkpoint)
	require.NoError(t, err, "the real kubelet's device manager checkpoints there")
	c.Stop()
	_, err = os.Stat(checkpoint)
	assert.True(t, errors.Is(err, os.ErrNotExist), "the checkpoint is gone with the node: %v", err)
}
