package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
	cdispecs "tags.cncf.io/container-device-interface/specs-go"

	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/devcluster/noderuntime"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
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
	// The path make gpu-smoke takes with NVML: the node's GPUs are a
	// Backend (here a simulated machine with a driver root of its own),
	// its containers' image is the host's /usr, and a pod's probe runs a
	// command first.
	machine, err := sim.NewBuiltin("dgx-h100-nomig", node)
	require.NoError(t, err)
	driverRoot := t.TempDir()
	require.NoError(t, sim.WriteDriverRoot(driverRoot, machine.DriverVersion()))
	machine.SetDriverRoot(driverRoot)
	n, err := cluster.AddNode(ctx, nodeagent.NodeOptions{Name: node, Backend: machine, DriverRoot: driverRoot,
		Runtime: &noderuntime.OCIRuntime{Runc: runc, Probe: probeBin, HostImage: true},
		Taints:  []v1.Taint{{Key: "gpu.gpudra.dev/e2e", Value: "runc", Effect: v1.TaintEffectNoSchedule}}})
	require.NoError(t, err)
	assert.Nil(t, n.Machine, "a node with a Backend has no simulated Machine of its own")
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
	one := onNode(gpuPod("one-gpu", "one"))
	one.Annotations = map[string]string{nodeagent.ProbeCommandAnnotation: `["sh", "-c", "echo visible=$NVIDIA_VISIBLE_DEVICES; ls /dev"]`}
	create(t, ns, gpus("one", 1), one)
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
		if tc.pod == "one-gpu" {
			require.NotNil(t, r.Command, "the probe ran the pod's command")
			assert.Equal(t, 0, r.Command.ExitCode, r.Command.Output)
			assert.Contains(t, r.Command.Output, "visible=void", "the command ran in the container's environment")
			assert.Contains(t, strings.Fields(r.Command.Output), want[0], "the command, from the host's /usr, sees the claimed GPU's node")
		}
		assert.True(t, strings.HasPrefix(pod.Status.ContainerStatuses[0].ContainerID, "runc://"), "%s: %s", tc.pod, pod.Status.ContainerStatuses[0].ContainerID)
	}
	pod := waitRunning(t, ns, "no-claim")
	r := views(t, pod)["cuda"].Report
	require.NotNil(t, r, "the container without a claim ran too")
	assert.Empty(t, r.Devices, "no claim: no /dev/nvidia*, whatever the image's NVIDIA_VISIBLE_DEVICES says")
}

// TestInsideCheckCatchesAnotherGPUsNode: the from-inside check is not
// satisfied by construction. The CDI spec the plugin wrote for a running
// one-GPU pod is copied and mutated to hand its container another GPU's
// node as well; a container run from it by the same runtime shows that
// node from inside, so the check (exactly the claimed GPUs' nodes) fails.
func TestInsideCheckCatchesAnotherGPUsNode(t *testing.T) {
	if !realContainers() {
		t.Skip("needs real containers (RUNC, PROBE, root)")
	}
	ns := namespace(t)
	create(t, ns, gpus("one", 1), gpuPod("one-gpu", "one"))
	pod := waitRunning(t, ns, "one-gpu")
	view := views(t, pod)["cuda"]
	claimed := "/dev/nvidia" + strings.TrimPrefix(podClaim(t, pod, "gpu").Status.Allocation.Devices.Results[0].Device, "gpu-")
	require.Equal(t, []string{claimed}, gpuNodesInside(view.Report), "the real container sees its GPU")

	// A copy of the node's CDI specs, the claim's spec handing a second
	// GPU's node too.
	node := cluster.Node(pod.Spec.NodeName)
	dir := t.TempDir()
	other := "/dev/nvidia7"
	if claimed == other {
		other = "/dev/nvidia6"
	}
	entries, err := os.ReadDir(node.CDIDir())
	require.NoError(t, err)
	mutated := false
	for _, e := range entries {
		data, err := os.ReadFile(filepath.Join(node.CDIDir(), e.Name()))
		require.NoError(t, err)
		var spec cdispecs.Spec
		require.NoError(t, yaml.Unmarshal(data, &spec))
		for i := range spec.Devices {
			for _, n := range spec.Devices[i].ContainerEdits.DeviceNodes {
				if n.Path == claimed && !mutated {
					extra := *n
					extra.Path = other
					if extra.HostPath != "" {
						extra.HostPath = filepath.Join(filepath.Dir(extra.HostPath), filepath.Base(other))
					}
					var minor int64
					_, err := fmt.Sscanf(other, "/dev/nvidia%d", &minor)
					require.NoError(t, err)
					extra.Minor = minor
					spec.Devices[i].ContainerEdits.DeviceNodes = append(spec.Devices[i].ContainerEdits.DeviceNodes, &extra)
					mutated = true
					break
				}
			}
		}
		out, err := yaml.Marshal(&spec)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(dir, strings.TrimSuffix(e.Name(), filepath.Ext(e.Name()))+".yaml"), out, 0o644))
	}
	require.True(t, mutated, "the claim's spec hands %s", claimed)
	_, spec, err := noderuntime.ResolveContainerSpec(dir, noderuntime.RuntimeEdits{CDIDevices: view.CDIDevices}, nil, nil)
	require.NoError(t, err)
	rt := &noderuntime.OCIRuntime{Runc: os.Getenv("RUNC"), Probe: os.Getenv("PROBE"), Root: t.TempDir()}
	report, err := rt.Start(context.Background(), "mutated-"+string(pod.UID), spec)
	require.NoError(t, err)
	t.Cleanup(func() { _ = rt.Stop(context.Background(), "mutated-"+string(pod.UID)) })
	seen := gpuNodesInside(report)
	assert.ElementsMatch(t, []string{claimed, other}, seen, "the mutated spec's second GPU is visible from inside")
	assert.NotEqual(t, []string{claimed}, seen, "so the from-inside check (exactly the claimed GPUs' nodes) fails on it")
}

// gpuNodesInside are the /dev/nvidia<N> nodes a probe saw.
func gpuNodesInside(r *probe.Report) []string {
	if r == nil {
		return nil
	}
	var out []string
	for _, d := range r.Devices {
		if strings.TrimLeft(strings.TrimPrefix(d.Path, "/dev/nvidia"), "0123456789") == "" && d.Path != "/dev/nvidia" {
			out = append(out, d.Path)
		}
	}
	sort.Strings(out)
	return out
}

// assertCDISpecsNameRealNodes: every device node in every CDI spec the
// node's plugin wrote is a real character device of the simulated
// machine's /dev, with the same major and minor (sim.Machine.WriteDevNodes),
// so the specs, the runtime and the device cgroup deal with real numbers.
// It returns how many nodes it checked.
func assertCDISpecsNameRealNodes(t *testing.T, node *nodeagent.Node) int {
	t.Helper()
	if os.Geteuid() != 0 {
		return 0 // mknod refused: the machine's /dev is only its model
	}
	files, err := filepath.Glob(filepath.Join(node.CDIDir(), "*"))
	require.NoError(t, err)
	checked := 0
	for _, f := range files {
		data, err := os.ReadFile(f)
		require.NoError(t, err)
		var spec cdispecs.Spec
		require.NoError(t, yaml.Unmarshal(data, &spec), f)
		edits := []cdispecs.ContainerEdits{spec.ContainerEdits}
		for _, d := range spec.Devices {
			edits = append(edits, d.ContainerEdits)
		}
		for _, e := range edits {
			for _, dn := range e.DeviceNodes {
				var st unix.Stat_t
				if !assert.NoError(t, unix.Stat(filepath.Join(node.Dir, dn.Path), &st), "%s: %s is not on the node's /dev", f, dn.Path) {
					continue
				}
				assert.Equal(t, uint32(unix.S_IFCHR), st.Mode&unix.S_IFMT, "%s: %s is a character device", f, dn.Path)
				assert.Equal(t, dn.Major, int64(unix.Major(st.Rdev)), "%s: %s major", f, dn.Path)
				assert.Equal(t, dn.Minor, int64(unix.Minor(st.Rdev)), "%s: %s minor", f, dn.Path)
				checked++
			}
		}
	}
	return checked
}
