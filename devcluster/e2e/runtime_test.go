package e2e

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/pkg/probe"
)

// TestRealContainers (issue 27, first part): on a node whose kubelet runs
// containers for real (runc, from the OCI spec the CDI library made, the
// probe as the container's process), each container reports from inside
// its own PID namespace: a pod with a one-GPU claim sees its GPU's
// /dev/nvidia<minor> and the control nodes, and the device cgroup lets it
// open them (not EPERM; ENXIO on a host without NVIDIA's driver); a
// two-GPU pod sees exactly its two; a pod without a claim sees no
// /dev/nvidia* at all, even when its image asks for every GPU.
func TestRealContainers(t *testing.T) {
	runc, probeBin := os.Getenv("RUNC"), os.Getenv("PROBE")
	if runc == "" || probeBin == "" {
		t.Skip("RUNC and PROBE name runc and gpudra-probe (make test-e2e sets them)")
	}
	if os.Geteuid() != 0 {
		t.Skip("real containers need root")
	}
	ctx := context.Background()
	const node = "dgx-h100-runc"
	n, err := cluster.AddNode(ctx, devcluster.NodeOptions{Name: node, Machine: "dgx-h100-nomig",
		Runtime: &devcluster.OCIRuntime{Runc: runc, Probe: probeBin},
		Taints:  []v1.Taint{{Key: "gpu.gpudra.dev/e2e", Value: "runc", Effect: v1.TaintEffectNoSchedule}}})
	require.NoError(t, err)
	require.NoError(t, n.WaitForSlices(ctx))

	ns := namespace(t)
	onNode := func(p *v1.Pod) *v1.Pod {
		p.Spec.NodeSelector = map[string]string{"kubernetes.io/hostname": node}
		p.Spec.Tolerations = []v1.Toleration{{Key: "gpu.gpudra.dev/e2e", Operator: v1.TolerationOpExists}}
		return p
	}
	none := onNode(&v1.Pod{Spec: v1.PodSpec{RestartPolicy: v1.RestartPolicyNever, Containers: []v1.Container{{Name: "cuda", Image: "x",
		// An image whose environment asks for every GPU gets nothing more.
		Env: []v1.EnvVar{{Name: "NVIDIA_VISIBLE_DEVICES", Value: "all"}}}}}})
	none.Name = "no-claim"
	create(t, ns, gpus("one", 1), onNode(gpuPod("one-gpu", "one")))
	create(t, ns, gpus("two", 2), onNode(gpuPod("two-gpus", "two")), none)

	minors := func(r *probe.Report) (gpus []string, control []string) {
		for _, d := range r.Devices {
			name := strings.TrimPrefix(d.Path, "/dev/")
			var m int
			if _, err := fmt.Sscanf(name, "nvidia%d", &m); err == nil && fmt.Sprintf("nvidia%d", m) == name {
				gpus = append(gpus, name)
			} else {
				control = append(control, name)
			}
		}
		sort.Strings(gpus)
		return gpus, control
	}
	for _, tc := range []struct {
		pod  string
		gpus int
	}{{"one-gpu", 1}, {"two-gpus", 2}} {
		pod := waitRunning(t, ns, tc.pod)
		view := views(t, pod)["cuda"]
		require.NotNil(t, view.Report, "%s: the container ran and reported", tc.pod)
		r := view.Report
		assert.Equal(t, 1, r.PID, "%s: the probe is PID 1 of its own PID namespace", tc.pod)
		seen, control := minors(r)
		var want []string
		for _, d := range podClaim(t, pod, "gpu").Status.Allocation.Devices.Results {
			want = append(want, "nvidia"+strings.TrimPrefix(d.Device, "gpu-"))
		}
		sort.Strings(want)
		assert.Len(t, seen, tc.gpus, "%s: device nodes %v", tc.pod, r.Devices)
		assert.Equal(t, want, seen, "%s: exactly the claimed GPUs' nodes (names carry the minor)", tc.pod)
		assert.Contains(t, control, "nvidiactl", tc.pod)
		for _, d := range r.Devices {
			assert.Equal(t, "c", d.Type, "%s: %s is a character device", tc.pod, d.Path)
			assert.NotEqual(t, "EPERM", d.OpenError, "%s: %s is allowed by the device cgroup", tc.pod, d.Path)
		}
		assert.Equal(t, "void", r.Env["NVIDIA_VISIBLE_DEVICES"], tc.pod)
		assert.True(t, strings.HasPrefix(pod.Status.ContainerStatuses[0].ContainerID, "runc://"), "%s: %s", tc.pod, pod.Status.ContainerStatuses[0].ContainerID)
	}
	pod := waitRunning(t, ns, "no-claim")
	r := views(t, pod)["cuda"].Report
	require.NotNil(t, r, "the container without a claim ran too")
	assert.Empty(t, r.Devices, "no claim: no /dev/nvidia*, whatever the image's NVIDIA_VISIBLE_DEVICES says")
}
