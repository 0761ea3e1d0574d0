package sharing

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

func TestMPSServerPod(t *testing.T) {
	ctx := context.Background()
	client := fake.NewSimpleClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "gpu-node-1.example.com", UID: "node-uid"}})
	p := &PodServers{Client: client, LogArgs: []string{"--logging-format=json", "-v=3"}, Namespace: "gpudra", NodeName: "gpu-node-1.example.com", Image: "ghcr.io/gpudra/gpudra:v1",
		HostDriverRoot: "/run/nvidia/driver", ServiceAccount: "gpudra-mps-server"}
	s := MPSServerFor("/var/lib/kubelet/plugins/gpu.gpudra.dev/sharing/mps", []string{"GPU-b", "GPU-a"})
	assert.Equal(t, []string{"GPU-a", "GPU-b"}, s.Devices)

	started, err := p.Ensure(ctx, s)
	require.NoError(t, err)
	assert.True(t, started)
	pods, err := client.CoreV1().Pods("gpudra").List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	require.Len(t, pods.Items, 1)
	pod := pods.Items[0]
	assert.Regexp(t, `^gpudra-mps-gpu-node-1-example-com-[0-9a-f]{10}$`, pod.Name)
	assert.Equal(t, "gpu-node-1.example.com", pod.Spec.NodeName, "bound to the node: no scheduling")
	assert.Equal(t, []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: "gpu-node-1.example.com", UID: "node-uid"}}, pod.OwnerReferences,
		"owned by the Node, not by the plugin pod: a plugin upgrade must not delete it")
	c := pod.Spec.Containers[0]
	assert.Equal(t, []string{"gpudra-mps-server"}, c.Command)
	assert.Equal(t, []string{"--driver-root=/driver-root", "--dir=" + ServerContainerDir, "--devices=GPU-a,GPU-b",
		"--logging-format=json", "-v=3"}, c.Args, "no --control-binary: the driver root's own")
	require.NotNil(t, c.SecurityContext.RunAsUser)
	assert.Equal(t, int64(0), *c.SecurityContext.RunAsUser, "root, explicitly: the image's default user is the controller's non-root one")
	assert.Equal(t, "gpudra-mps-server", pod.Spec.ServiceAccountName, "a ServiceAccount without permissions")
	assert.Equal(t, false, *pod.Spec.AutomountServiceAccountToken, "and no token")
	mounts := map[string]string{}
	for _, m := range c.VolumeMounts {
		for _, v := range pod.Spec.Volumes {
			if v.Name == m.Name {
				mounts[m.MountPath] = v.HostPath.Path
			}
		}
	}
	assert.Equal(t, map[string]string{ServerContainerDir: s.Dir, "/dev/shm": s.ShmDir(), "/driver-root": "/run/nvidia/driver"}, mounts)

	// Again (a retry, the other plugin instance, supervision): nothing new.
	started, err = p.Ensure(ctx, s)
	require.NoError(t, err)
	assert.False(t, started)
	listed, err := p.List(ctx)
	require.NoError(t, err)
	assert.Equal(t, []MPSServer{s}, listed)

	// Another node's servers are not this node's.
	other := *p
	other.NodeName = "gpu-node-2"
	listed, err = other.List(ctx)
	require.NoError(t, err)
	assert.Empty(t, listed)

	// An evicted server pod does not come back by itself: it is replaced.
	pod.Status.Phase, pod.Status.Reason = corev1.PodFailed, "Evicted"
	_, err = client.CoreV1().Pods("gpudra").UpdateStatus(ctx, &pod, metav1.UpdateOptions{})
	require.NoError(t, err)
	started, err = p.Ensure(ctx, s)
	require.NoError(t, err)
	assert.True(t, started, "replaced")
	replaced, err := client.CoreV1().Pods("gpudra").Get(ctx, pod.Name, metav1.GetOptions{})
	require.NoError(t, err)
	assert.Empty(t, replaced.Status.Phase, "a new pod, not the evicted one")

	require.NoError(t, p.Stop(ctx, s))
	listed, err = p.List(ctx)
	require.NoError(t, err)
	assert.Empty(t, listed)
	require.NoError(t, p.Stop(ctx, s), "stopping a server that is gone is done")
}
