package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpudra/gpudra/devcluster/noderuntime"
	"github.com/gpudra/gpudra/pkg/probe"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// assertSeesExactly checks a container's CDI view: the GPUs its device
// nodes give it, each device's identity in its environment, their device
// nodes, and no other GPU's node.
func assertSeesExactly(t *testing.T, pod *v1.Pod, container string, uuids []string, gpuMinors []string) {
	t.Helper()
	view, ok := views(t, pod)[container]
	require.True(t, ok, "no view for container %s", container)
	assert.ElementsMatch(t, uuids, view.VisibleGPUs(), "GPUs of %s, from its device nodes", container)
	assert.ElementsMatch(t, uuids, deviceEnvUUIDs(view.Env), "device identities in the env of %s", container)
	assert.Equal(t, "void", view.Env["NVIDIA_VISIBLE_DEVICES"], container)
	assert.NotContains(t, view.Env, "CUDA_VISIBLE_DEVICES", container)
	assert.Contains(t, view.DeviceNodes, "/dev/nvidiactl")
	var gpuNodes []string
	for _, d := range view.DeviceNodes {
		if strings.TrimLeft(strings.TrimPrefix(d, "/dev/nvidia"), "0123456789") == "" && d != "/dev/nvidia" {
			gpuNodes = append(gpuNodes, d)
		}
	}
	var want []string
	for _, m := range gpuMinors {
		want = append(want, "/dev/nvidia"+m)
	}
	assert.ElementsMatch(t, want, gpuNodes, "GPU device nodes of %s", container)
	assertDriverMounted(t, pod.Spec.NodeName, container, view)
	assertSeesFromInside(t, container, view, want)
}

// realContainers says whether the suite's nodes run containers for real
// (make test-e2e as root: runc and the probe); then the checks above are
// made again from inside, on what the container's probe reported.
func realContainers() bool {
	return os.Getenv("RUNC") != "" && os.Getenv("PROBE") != "" && os.Geteuid() == 0
}

// realMPSContainers says whether MPS server pods run in containers of
// their own too (make test-e2e gives MPS_SERVER, a static gpudra-mps-server).
func realMPSContainers() bool { return realContainers() && os.Getenv("MPS_SERVER") != "" }

// assertSeesFromInside: the container's probe saw exactly these GPU device
// nodes, as character devices the device cgroup lets it open, the same
// NVIDIA_VISIBLE_DEVICES, and the driver's files mounted read-only.
func assertSeesFromInside(t *testing.T, container string, view noderuntime.ContainerView, gpuNodes []string) {
	t.Helper()
	if !realContainers() {
		return
	}
	r := view.Report
	require.NotNil(t, r, "container %s ran and reported from inside", container)
	assert.Equal(t, 1, r.PID, "%s: its own PID namespace", container)
	for _, d := range r.Devices {
		assert.Equal(t, "c", d.Type, "%s: %s", container, d.Path)
		assert.NotEqual(t, "EPERM", d.OpenError, "%s: the device cgroup allows %s", container, d.Path)
	}
	assert.ElementsMatch(t, gpuNodes, gpuNodesInside(r), "%s: GPU device nodes seen from inside", container)
	assert.Equal(t, "void", r.Env["NVIDIA_VISIBLE_DEVICES"], "%s, from inside", container)
	driver := 0
	for _, m := range r.Mounts {
		if m.Driver {
			driver++
			assert.True(t, m.ReadOnly, "%s: driver file %s is read-only from inside", container, m.MountPoint)
		}
	}
	assert.Positive(t, driver, "%s: the driver's files are mounted", container)
}

// assertDriverMounted checks that the container gets the driver's
// user-space files from the node's common driver spec, read-only and from
// the node's driver root: a runtime without the NVIDIA toolkit runs CUDA.
func assertDriverMounted(t *testing.T, node, container string, view noderuntime.ContainerView) {
	t.Helper()
	root := cluster.Node(node).DriverRoot()
	dests := map[string]bool{}
	for _, m := range view.DriverMounts {
		parts := strings.Split(m, ":")
		require.Len(t, parts, 3, "driver mount %s of %s", m, container)
		assert.True(t, strings.HasPrefix(parts[0], root+"/"), "driver mount %s of %s comes from the driver root %s", m, container, root)
		assert.Contains(t, strings.Split(parts[2], ","), "ro", "driver mount %s of %s is read-only", m, container)
		dests[parts[1]] = true
	}
	for _, want := range []string{"/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
		"/usr/lib/x86_64-linux-gnu/libnvidia-ptxjitcompiler.so.1", "/usr/bin/nvidia-smi"} {
		assert.True(t, dests[want], "%s of %s gets %s from the driver spec", container, node, want)
	}
}

// seenUUID is what a container is given for a whole GPU: the GPU's UUID,
// or, for a GPU in MIG mode, the UUID of the instance that spans it.
func seenUUID(t *testing.T, node string, dev resourceapi.Device) string {
	t.Helper()
	if attr(dev, "migEnabled") != "true" {
		return attr(dev, "uuid")
	}
	inv, err := cluster.Node(node).Machine.Inventory(context.Background())
	require.NoError(t, err)
	for _, g := range inv.GPUs {
		if g.UUID != attr(dev, "uuid") {
			continue
		}
		for _, m := range g.MIG.Devices {
			if m.Placement.Start == 0 && m.Placement.Size == 8 {
				return m.UUID
			}
		}
	}
	t.Fatalf("GPU %s is in MIG mode but has no instance spanning it", attr(dev, "uuid"))
	return ""
}

func TestSingleGPU(t *testing.T) {
	ns := namespace(t)
	apply(t, ns, filepath.Join(examples, "single-gpu"))
	pod := waitRunning(t, ns, "single-gpu")
	claim := podClaim(t, pod, "gpu")
	r, dev := onlyDevice(t, claim)
	assert.Equal(t, slicebuilder.DriverName, r.Driver)
	assert.Equal(t, pod.Spec.NodeName, r.Pool, "one pool per node, named after it")
	assert.Equal(t, "gpu", attr(dev, "type"))
	assert.Equal(t, "gpu-"+attr(dev, "minor"), r.Device)
	assertSeesExactly(t, pod, "cuda", []string{seenUUID(t, pod.Spec.NodeName, dev)}, []string{attr(dev, "minor")})
	assert.True(t, hasSpecFor(t, pod.Spec.NodeName, string(claim.UID)), "CDI spec for the claim")
}

func TestNVLinkPair(t *testing.T) {
	ns := namespace(t)
	apply(t, ns, filepath.Join(examples, "nvlink-pair"))
	pod := waitRunning(t, ns, "nvlink-pair")
	results := podClaim(t, pod, "gpus").Status.Allocation.Devices.Results
	require.Len(t, results, 2)
	var uuids, minors []string
	domains := map[string]bool{}
	for _, r := range results {
		dev := device(t, r.Pool, r.Device)
		uuids, minors = append(uuids, attr(dev, "uuid")), append(minors, attr(dev, "minor"))
		domains[attr(dev, "nvlinkDomain")] = true
	}
	assert.Len(t, domains, 1, "both GPUs on one NVLink domain")
	assert.NotContains(t, domains, "")
	assert.NotEqual(t, uuids[0], uuids[1])
	assertSeesExactly(t, pod, "trainer", uuids, minors)
}

func TestMIG(t *testing.T) {
	ns := namespace(t)
	apply(t, ns, filepath.Join(examples, "mig"))
	pod := waitRunning(t, ns, "mig")
	node := cluster.Node(pod.Spec.NodeName)
	inv, err := node.Machine.Inventory(context.Background())
	require.NoError(t, err)
	for podClaimName, profile := range map[string]string{"small": "1g.10gb", "medium": "3g.40gb"} {
		_, dev := onlyDevice(t, podClaim(t, pod, podClaimName))
		assert.Equal(t, "mig", attr(dev, "type"))
		assert.Equal(t, profile, attr(dev, "migProfile"))
		// The instance exists on the (simulated) GPU now, and the container
		// sees it and nothing else.
		view := views(t, pod)[podClaimName]
		require.Len(t, view.VisibleGPUs(), 1)
		migUUID := view.VisibleGPUs()[0]
		assert.True(t, strings.HasPrefix(migUUID, "MIG-"), migUUID)
		found := false
		for _, g := range inv.GPUs {
			for _, m := range g.MIG.Devices {
				if m.UUID == migUUID {
					found = true
					assert.Equal(t, profile, m.Profile)
					assert.Equal(t, attr(dev, "parentUUID"), g.UUID)
				}
			}
		}
		assert.True(t, found, "MIG device %s exists on node %s", migUUID, node.Name)
		caps := 0
		for _, d := range view.DeviceNodes {
			if strings.HasPrefix(d, "/dev/nvidia-caps/") {
				caps++
			}
		}
		assert.Equal(t, 2, caps, "GPU-instance and compute-instance capability nodes")
	}
	if os.Geteuid() == 0 {
		// The control nodes, the GPUs' and both MIG devices' capability
		// nodes at least.
		assert.GreaterOrEqual(t, assertCDISpecsNameRealNodes(t, node), 3+2*3)
	}
	// Deleting the pod destroys the instances it created.
	require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(context.Background(), "mig", metav1.DeleteOptions{}))
	waitPodGone(t, ns, "mig")
	inv, err = node.Machine.Inventory(context.Background())
	require.NoError(t, err)
	for _, g := range inv.GPUs {
		for _, m := range g.MIG.Devices {
			for _, v := range views(t, pod) {
				assert.NotContains(t, v.VisibleGPUs(), m.UUID, "MIG device left behind after unprepare")
			}
		}
	}
}

func TestPrioritizedList(t *testing.T) {
	ns := namespace(t)
	apply(t, ns, filepath.Join(examples, "prioritized-list"))
	pod := waitRunning(t, ns, "gpu-or-mig")
	r, dev := onlyDevice(t, podClaim(t, pod, "gpu"))
	// Whole GPUs are free, so the first alternative wins.
	assert.Equal(t, "gpu/full", r.Request)
	assert.Equal(t, "gpu", attr(dev, "type"))
	assertSeesExactly(t, pod, "inference", []string{seenUUID(t, pod.Spec.NodeName, dev)}, []string{attr(dev, "minor")})
}

func TestSharedClaimPrimaryAndShadow(t *testing.T) {
	ns := namespace(t)
	apply(t, ns, filepath.Join(examples, "shared-claim"))
	primary := waitRunning(t, ns, "primary")
	shadow := waitRunning(t, ns, "shadow")
	assert.Equal(t, primary.Spec.NodeName, shadow.Spec.NodeName)
	claim := podClaim(t, primary, "gpu")
	assert.Len(t, claim.Status.ReservedFor, 2, "both pods are consumers of the claim")
	assert.Equal(t, views(t, primary)["engine"].VisibleGPUs(), views(t, shadow)["engine"].VisibleGPUs())
	assert.Len(t, views(t, primary)["engine"].VisibleGPUs(), 1)
	// The same IPC directory in both, from the claim's sharing.ipc.
	pv, sv := views(t, primary)["engine"], views(t, shadow)["engine"]
	require.Len(t, pv.Mounts, 1)
	assert.True(t, strings.HasSuffix(pv.Mounts[0], ":/var/run/gpudra/ipc"), pv.Mounts[0])
	assert.Equal(t, pv.Mounts, sv.Mounts)
	assert.Equal(t, "/var/run/gpudra/ipc", sv.Env["GPUDRA_IPC_DIR"])
	ipcDir := strings.TrimSuffix(pv.Mounts[0], ":/var/run/gpudra/ipc")
	assert.DirExists(t, ipcDir)
	if realContainers() {
		// From inside: each probe wrote a file into the IPC directory
		// before looking; the one that started second read both.
		pr, sr := pv.Report, sv.Report
		require.NotNil(t, pr)
		require.NotNil(t, sr)
		both := []string{pr.Hostname, sr.Hostname}
		pd, sd := pr.Dirs["/var/run/gpudra/ipc"], sr.Dirs["/var/run/gpudra/ipc"]
		assert.True(t, subset(both, pd) || subset(both, sd), "one container reads what the other wrote: primary saw %v, shadow saw %v", pd, sd)
		assert.Equal(t, insideGPUs(pr), insideGPUs(sr), "the same device nodes from inside")
	}

	// The claim stays prepared while one consumer is left, IPC directory
	// included.
	ctx := context.Background()
	require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(ctx, "primary", metav1.DeleteOptions{}))
	waitPodGone(t, ns, "primary")
	assert.True(t, hasSpecFor(t, shadow.Spec.NodeName, string(claim.UID)), "unprepared while the shadow still runs")
	assert.DirExists(t, ipcDir)
	require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(ctx, "shadow", metav1.DeleteOptions{}))
	waitPodGone(t, ns, "shadow")
	assert.False(t, hasSpecFor(t, shadow.Spec.NodeName, string(claim.UID)), "unprepared after the last consumer")
	assert.NoDirExists(t, ipcDir, "IPC directory removed with the claim")
}

func TestCELSelector(t *testing.T) {
	ns := namespace(t)
	apply(t, ns, filepath.Join(examples, "cel-selector"))
	pod := waitRunning(t, ns, "hopper-80gb")
	_, dev := onlyDevice(t, podClaim(t, pod, "gpu"))
	mem := dev.Capacity[resourceapi.QualifiedName("memory")].Value
	assert.GreaterOrEqual(t, mem.Cmp(resource.MustParse("79Gi")), 0, "memory %s", mem.String())
	assert.Equal(t, "9.0.0", attr(dev, "cudaComputeCapability"))
}

func subset(want, in []string) bool {
	for _, w := range want {
		if !slices.Contains(in, w) {
			return false
		}
	}
	return true
}

// insideGPUs are the device nodes a probe saw, as major:minor.
func insideGPUs(r *probe.Report) []string {
	var out []string
	for _, d := range r.Devices {
		out = append(out, fmt.Sprintf("%s=%d:%d", d.Path, d.Major, d.Minor))
	}
	return out
}
