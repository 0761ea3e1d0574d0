package realnode

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
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

	"k8s.io/client-go/kubernetes"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/devcluster/realnode"
	"github.com/gpudra/gpudra/pkg/metrics"
	"github.com/gpudra/gpudra/pkg/plugin"
	"github.com/gpudra/gpudra/pkg/probe"
	"github.com/gpudra/gpudra/pkg/sharing"
)

// realMachine is the real node's simulated DGX H100: GPUs 6 and 7 in MIG
// mode, so that whole GPUs and MIG instances are both on the one node.
const realMachine = repo + "/examples/machines/dgx-h100-mig67.yaml"

// TestRealNodeRunsTheExamples applies the examples, one after the other,
// pinned to the real node (devcluster.PinToRealNode: the probe image in
// place of the CUDA image) beside a simulated node: the kubelet binary
// prepares their claims through the chart's plugin pod, containerd injects
// the devices from gpudra's CDI specs, and the probe in every container
// reports exactly the allocated GPUs' device nodes and identities, and the
// driver's files read-only. Each example's pods are then deleted, and the
// kubelet unprepares their claims: no CDI spec of them is left.
func TestRealNodeRunsTheExamples(t *testing.T) {
	b := binaries(t)
	img := imageTarball(t)
	ctx := context.Background()
	c, err := devcluster.Start(ctx, devcluster.Options{RealNodes: true, Chart: chart.Default(repo)})
	require.NoError(t, err)
	t.Cleanup(c.Stop)
	_, err = c.AddNode(ctx, nodeagent.NodeOptions{Name: "dgx-h100-0", Machine: "dgx-h100-nomig"})
	require.NoError(t, err, "a simulated node beside the real one")
	const name = "real-node-0"
	machine, err := filepath.Abs(realMachine)
	require.NoError(t, err)
	// Every MIG placement is published on this node (the chart's default
	// publishes only instances that exist), as the node's annotation asks.
	n, err := c.AddRealNode(ctx, devcluster.RealNodeOptions{Name: name, Binaries: b, Image: img, Machine: machine,
		Annotations: map[string]string{plugin.AnnotationMigDevices: "all"}})
	require.NoError(t, err)
	_, err = c.ApplyFiles(ctx, "default", filepath.Join(repo, "examples", "deviceclasses"))
	require.NoError(t, err)

	for _, example := range []struct {
		dir  string
		pods int
		// check is what else the example promises, beyond each
		// container's exact devices.
		check func(t *testing.T, pods []*v1.Pod, reports map[string]*probe.Report)
	}{
		{dir: "single-gpu", pods: 1},
		{dir: "nvlink-pair", pods: 1, check: func(t *testing.T, pods []*v1.Pod, _ map[string]*probe.Report) {
			devs := allocated(t, c, pods[0], "gpus")
			require.Len(t, devs, 2)
			assert.Equal(t, devs[0].attr("nvlinkDomain"), devs[1].attr("nvlinkDomain"), "one NVLink domain")
			assert.NotEmpty(t, devs[0].attr("nvlinkDomain"))
		}},
		{dir: "mig", pods: 1, check: func(t *testing.T, pods []*v1.Pod, _ map[string]*probe.Report) {
			for claim, profile := range map[string]string{"small": "1g.10gb", "medium": "3g.40gb"} {
				devs := allocated(t, c, pods[0], claim)
				require.Len(t, devs, 1)
				assert.Equal(t, "mig", devs[0].attr("type"))
				assert.Equal(t, profile, devs[0].attr("migProfile"))
			}
		}},
		{dir: "shared-claim", pods: 2, check: func(t *testing.T, pods []*v1.Pod, reports map[string]*probe.Report) {
			assert.Equal(t, envUUIDs(reports["primary/engine"]), envUUIDs(reports["shadow/engine"]), "one GPU for both pods")
			for _, r := range reports {
				assert.NotEmpty(t, r.Env["GPUDRA_IPC_DIR"], "the shared IPC directory")
			}
			// Attribution from the real kubelet's pod-resources API: the
			// plugin's telemetry lists both pods' containers on the one
			// device, with the claim's name.
			dev := allocated(t, c, pods[0], "gpu")[0].Name
			var holders []string
			var last error
			err := wait.PollUntilContextTimeout(ctx, time.Second, time.Minute, true, func(context.Context) (bool, error) {
				m, err := scrapePlugin(t, c, n)
				if err != nil {
					last = err
					return false, nil
				}
				holders = nil
				for _, s := range m["gpudra_device_pod_info"] {
					if s.labels["namespace"] == "shared-claim" && s.value == 1 {
						holders = append(holders, s.labels["dra_device_name"]+" "+s.labels["pod"]+"/"+s.labels["container"]+" claim="+s.labels["dra_claim_name"])
					}
				}
				up := m["gpudra_telemetry_attribution_up"]
				return len(holders) == 2 && len(up) == 1 && up[0].value == 1, nil
			})
			require.NoError(t, err, "the plugin attributes the device from the kubelet's pod-resources API: %v; last scrape error: %v", holders, last)
			slices.Sort(holders)
			assert.Equal(t, []string{dev + " primary/engine claim=shared-gpu", dev + " shadow/engine claim=shared-gpu"}, holders)
			// And each container's processes, told apart by the cgroups
			// containerd made (the host's /proc) and the kubelet's
			// /var/log/containers links: the loads the example declares
			// (GPUDRA_SIM_LOAD: 20Gi and 4Gi), which devcluster feeds the
			// simulated GPU for the containers' host PIDs.
			used := map[string]float64{}
			err = wait.PollUntilContextTimeout(ctx, time.Second, time.Minute, true, func(context.Context) (bool, error) {
				m, err := scrapePlugin(t, c, n)
				if err != nil {
					last = err
					return false, nil
				}
				used = map[string]float64{}
				for _, s := range m["gpudra_container_gpu_memory_used_bytes"] {
					if s.labels["namespace"] == "shared-claim" {
						used[s.labels["dra_device_name"]+" "+s.labels["pod"]+"/"+s.labels["container"]] = s.value
					}
				}
				unresolved := m["gpudra_telemetry_unresolved_processes"]
				// The series exist at 0 from the first pass; the fed
				// processes come with a later one.
				return len(used) == 2 && used[dev+" primary/engine"] > 0 && used[dev+" shadow/engine"] > 0 &&
					len(unresolved) == 1 && unresolved[0].value == 0, nil
			})
			require.NoError(t, err, "the plugin attributes each container's processes: %v; last scrape error: %v", used, last)
			assert.Equal(t, map[string]float64{dev + " primary/engine": 20 << 30, dev + " shadow/engine": 4 << 30}, used)
			// The same figures through kube-apiserver's pods proxy (how
			// gpudra dashboard reads them), which reaches the real node's
			// pod subnet through devcluster's pod network egress.
			proxy, err := kubernetes.NewForConfig(metrics.WithProxiedBearerToken(c.RESTConfig))
			require.NoError(t, err)
			body, err := proxy.CoreV1().Pods(chart.PluginNamespace).ProxyGet("https", nodeagent.MetricsPodName(n.Name), pluginMetricsPort, "/metrics", nil).DoRaw(ctx)
			require.NoError(t, err, "the API server's pods proxy reaches the real node's plugin pod")
			assert.Contains(t, string(body), `gpudra_container_gpu_memory_used_bytes{`)
		}},
		{dir: "time-slicing", pods: 2, check: func(t *testing.T, _ []*v1.Pod, reports map[string]*probe.Report) {
			assert.Equal(t, envUUIDs(reports["ts-trainer-a/cuda"]), envUUIDs(reports["ts-trainer-b/cuda"]), "one time-sliced GPU")
		}},
		{dir: "mps", pods: 2, check: func(t *testing.T, pods []*v1.Pod, reports map[string]*probe.Report) {
			// The plugin's MPS server pod runs on the node, from the
			// image, under the real kubelet; the MPS control stand-in
			// in the driver root is its daemon.
			servers, err := c.Client.CoreV1().Pods(chart.PluginNamespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=" + sharing.MPSServerComponent})
			require.NoError(t, err)
			require.Len(t, servers.Items, 1, "one MPS server pod for the shared claim")
			server := servers.Items[0]
			assert.Equal(t, name, server.Spec.NodeName)
			assert.Equal(t, v1.PodRunning, server.Status.Phase)
			require.Len(t, server.Status.ContainerStatuses, 1)
			assert.True(t, strings.HasPrefix(server.Status.ContainerStatuses[0].ContainerID, "containerd://"), server.Status.ContainerStatuses[0].ContainerID)
			a, b := reports["mps-client-a/cuda"], reports["mps-client-b/cuda"]
			assert.Equal(t, envUUIDs(a), envUUIDs(b), "one GPU for both clients")
			for _, r := range []*probe.Report{a, b} {
				pipe := r.Env["CUDA_MPS_PIPE_DIRECTORY"]
				require.NotEmpty(t, pipe, "the client is told where its MPS daemon is")
				assert.Contains(t, r.Dirs[pipe], "control", "the daemon's pipe, seen from the client's container")
				assert.Equal(t, "50", r.Env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"])
			}
		}},
		{dir: "gang/plain-pods.yaml", pods: 4, check: func(t *testing.T, pods []*v1.Pod, _ map[string]*probe.Report) {
			// 8 GPUs: the node's all. The two in MIG mode have no NVLink
			// (MIG mode turns it off); the others share one domain.
			domains, gpus := map[string]bool{}, 0
			for _, p := range pods {
				for _, d := range allocated(t, c, p, "gpus") {
					gpus++
					if d.attr("migEnabled") != "true" {
						domains[d.attr("nvlinkDomain")] = true
					}
				}
			}
			assert.Equal(t, 8, gpus)
			assert.Len(t, domains, 1, "the gang's NVLink GPUs on one NVLink domain")
			assert.NotContains(t, domains, "")
		}},
	} {
		t.Run(example.dir, func(t *testing.T) { runExample(t, c, n, example.dir, example.pods, example.check) })
	}
}

// runExample applies an example pinned to the real node n, in a namespace
// of its own, waits for its pods, checks that every container sees exactly
// its devices (and what check adds), then deletes the pods and waits until
// the kubelet has unprepared their claims.
func runExample(t *testing.T, c *devcluster.Cluster, n *realnode.Node, dir string, wantPods int,
	check func(t *testing.T, pods []*v1.Pod, reports map[string]*probe.Report)) {
	ctx := context.Background()
	name := n.Name
	ns := strings.NewReplacer("/", "-", ".yaml", "").Replace(dir)
	_, err := c.Client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
	require.NoError(t, err)
	objs, err := devcluster.Manifests(filepath.Join(repo, "examples", dir))
	require.NoError(t, err)
	require.NoError(t, devcluster.PinToRealNode(objs, name))
	require.NoError(t, c.Apply(ctx, ns, objs))

	pods := allRunning(t, c, ns, wantPods)
	reports := map[string]*probe.Report{}
	var claimUIDs []string
	for _, p := range pods {
		assert.Equal(t, name, p.Spec.NodeName)
		for _, cs := range p.Status.ContainerStatuses {
			assert.True(t, strings.HasPrefix(cs.ContainerID, "containerd://"), "%s/%s: started by containerd: %s", p.Name, cs.Name, cs.ContainerID)
		}
		rs, err := c.RealProbeReports(ctx, p, 30*time.Second)
		require.NoError(t, err, "pod %s", p.Name)
		for _, ctr := range p.Spec.Containers {
			r := rs[ctr.Name]
			reports[p.Name+"/"+ctr.Name] = r
			assertSeesExactly(t, c, p, ctr, r)
		}
		for _, s := range p.Status.ResourceClaimStatuses {
			claim, err := c.Client.ResourceV1().ResourceClaims(ns).Get(ctx, *s.ResourceClaimName, metav1.GetOptions{})
			require.NoError(t, err)
			claimUIDs = append(claimUIDs, string(claim.UID))
		}
	}
	if check != nil {
		check(t, pods, reports)
	}

	// The pods go; the kubelet unprepares their claims, and the
	// plugin removes their CDI specs.
	for _, p := range pods {
		require.NoError(t, c.Client.CoreV1().Pods(ns).Delete(ctx, p.Name, metav1.DeleteOptions{}))
	}
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		list, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		return err == nil && len(list.Items) == 0, nil
	})
	require.NoError(t, err, "the example's pods go")
	cdiDir := filepath.Join(n.KubeletRootDir(), "cdi")
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return len(specsOf(t, cdiDir, claimUIDs)) == 0, nil
	})
	assert.NoError(t, err, "CDI specs left of the example's claims: %v", specsOf(t, cdiDir, claimUIDs))
}

// allRunning waits until the namespace holds want pods, all Running.
func allRunning(t *testing.T, c *devcluster.Cluster, ns string, want int) []*v1.Pod {
	t.Helper()
	var pods []*v1.Pod
	var why []string
	err := wait.PollUntilContextTimeout(context.Background(), 250*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		list, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		pods, why = nil, nil
		for i := range list.Items {
			p := &list.Items[i]
			pods = append(pods, p)
			if p.Status.Phase != v1.PodRunning {
				msg := waiting(p)
				for _, cond := range p.Status.Conditions {
					if cond.Status == v1.ConditionFalse && cond.Message != "" {
						msg += "; " + cond.Message
					}
				}
				why = append(why, p.Name+": "+msg)
			}
		}
		return len(pods) == want && len(why) == 0, nil
	})
	require.NoError(t, err, "%d pods of %s running: %d there; %s", want, ns, len(pods), strings.Join(why, "; "))
	return pods
}

// sliceDevice is a published device with its pool.
type sliceDevice struct {
	pool string
	resourceapi.Device
}

func (d sliceDevice) attr(name string) string {
	a, ok := d.Attributes[resourceapi.QualifiedName(name)]
	switch {
	case !ok:
		return ""
	case a.StringValue != nil:
		return *a.StringValue
	case a.IntValue != nil:
		return strconv.FormatInt(*a.IntValue, 10)
	case a.BoolValue != nil:
		return strconv.FormatBool(*a.BoolValue)
	case a.VersionValue != nil:
		return *a.VersionValue
	}
	return ""
}

// publishedDevice is the device of that pool and name in the published
// ResourceSlices.
func publishedDevice(t *testing.T, c *devcluster.Cluster, pool, name string) sliceDevice {
	t.Helper()
	list, err := c.Client.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	for _, s := range list.Items {
		if s.Spec.Pool.Name != pool {
			continue
		}
		for _, d := range s.Spec.Devices {
			if d.Name == name {
				return sliceDevice{pool: pool, Device: d}
			}
		}
	}
	t.Fatalf("no device %s in pool %s", name, pool)
	return sliceDevice{}
}

// parentGPU is the whole-GPU device of a MIG device (its parentUUID).
func parentGPU(t *testing.T, c *devcluster.Cluster, mig sliceDevice) sliceDevice {
	t.Helper()
	list, err := c.Client.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	for _, s := range list.Items {
		if s.Spec.Pool.Name != mig.pool {
			continue
		}
		for _, d := range s.Spec.Devices {
			dev := sliceDevice{pool: mig.pool, Device: d}
			if dev.attr("type") == "gpu" && dev.attr("uuid") == mig.attr("parentUUID") {
				return dev
			}
		}
	}
	t.Fatalf("no GPU %s in pool %s", mig.attr("parentUUID"), mig.pool)
	return sliceDevice{}
}

// allocated are the devices allocated to the pod's claim of that name.
func allocated(t *testing.T, c *devcluster.Cluster, pod *v1.Pod, podClaim string) []sliceDevice {
	t.Helper()
	return allocatedFor(t, c, pod, v1.ResourceClaim{Name: podClaim})
}

// allocatedFor are the devices a container's claim reference gives it: the
// claim's allocation, or only its request's when it names one.
func allocatedFor(t *testing.T, c *devcluster.Cluster, pod *v1.Pod, ref v1.ResourceClaim) []sliceDevice {
	t.Helper()
	var claimName string
	for _, s := range pod.Status.ResourceClaimStatuses {
		if s.Name == ref.Name && s.ResourceClaimName != nil {
			claimName = *s.ResourceClaimName
		}
	}
	for _, pc := range pod.Spec.ResourceClaims {
		if pc.Name == ref.Name && pc.ResourceClaimName != nil {
			claimName = *pc.ResourceClaimName
		}
	}
	require.NotEmpty(t, claimName, "pod %s: claim %s", pod.Name, ref.Name)
	claim, err := c.Client.ResourceV1().ResourceClaims(pod.Namespace).Get(context.Background(), claimName, metav1.GetOptions{})
	require.NoError(t, err)
	require.NotNil(t, claim.Status.Allocation, "claim %s is allocated", claimName)
	var out []sliceDevice
	for _, r := range claim.Status.Allocation.Devices.Results {
		if ref.Request != "" && r.Request != ref.Request && !strings.HasPrefix(r.Request, ref.Request+"/") {
			continue
		}
		out = append(out, publishedDevice(t, c, r.Pool, r.Device))
	}
	return out
}

// assertSeesExactly: what the probe in the container reported from inside
// is exactly what its claims were allocated. Its GPU device nodes are the
// allocated GPUs' (a MIG device's: its parent's, with the two capability
// nodes of its GPU and compute instance), each a character device the
// device cgroup lets it open; the CDI spec's environment names each
// device's identity (a whole GPU's UUID, or for a GPU in MIG mode and a MIG
// device, a MIG UUID); NVIDIA_VISIBLE_DEVICES is void (the NVIDIA
// runtime's hook has nothing to add); the driver's files are mounted
// read-only.
func assertSeesExactly(t *testing.T, c *devcluster.Cluster, pod *v1.Pod, ctr v1.Container, r *probe.Report) {
	t.Helper()
	where := pod.Name + "/" + ctr.Name
	require.NotNil(t, r, "%s reported from inside", where)
	assert.Equal(t, 1, r.PID, "%s: its own PID namespace", where)
	var wantNodes, wantUUIDs []string
	caps := 0
	for _, ref := range ctr.Resources.Claims {
		for _, d := range allocatedFor(t, c, pod, ref) {
			switch d.attr("type") {
			case "gpu":
				wantNodes = append(wantNodes, "/dev/nvidia"+d.attr("minor"))
				if d.attr("migEnabled") == "true" {
					// The MIG instance the plugin makes to span it.
					wantUUIDs = append(wantUUIDs, "MIG-")
					caps += 2
				} else {
					wantUUIDs = append(wantUUIDs, d.attr("uuid"))
				}
			case "mig":
				wantNodes = append(wantNodes, "/dev/nvidia"+parentGPU(t, c, d).attr("minor"))
				wantUUIDs = append(wantUUIDs, "MIG-")
				caps += 2
			default:
				t.Errorf("%s: device %s of unknown type %q", where, d.Name, d.attr("type"))
			}
		}
	}
	slices.Sort(wantNodes)
	wantNodes = slices.Compact(wantNodes)
	assert.Equal(t, wantNodes, gpuNodes(r), "%s: GPU device nodes, seen from inside", where)
	gotCaps := 0
	for _, d := range r.Devices {
		assert.Equal(t, "c", d.Type, "%s: %s", where, d.Path)
		assert.NotEqual(t, "EPERM", d.OpenError, "%s: the device cgroup allows %s", where, d.Path)
		if strings.HasPrefix(d.Path, "/dev/nvidia-caps/") {
			gotCaps++
		}
	}
	assert.Equal(t, caps, gotCaps, "%s: MIG capability nodes", where)
	got := envUUIDs(r)
	require.Len(t, got, len(wantUUIDs), "%s: device identities in its environment: %v", where, got)
	slices.Sort(wantUUIDs)
	for _, w := range wantUUIDs {
		i := slices.IndexFunc(got, func(g string) bool { return g == w || (w == "MIG-" && strings.HasPrefix(g, w)) })
		if assert.GreaterOrEqual(t, i, 0, "%s: %s in %v", where, w, got) {
			got = slices.Delete(got, i, i+1)
		}
	}
	assert.Equal(t, "void", r.Env["NVIDIA_VISIBLE_DEVICES"], where)
	assert.NotContains(t, r.Env, "CUDA_VISIBLE_DEVICES", where)
	driver := 0
	for _, m := range r.Mounts {
		if m.Driver {
			driver++
			assert.True(t, m.ReadOnly, "%s: driver file %s is read-only", where, m.MountPoint)
		}
	}
	assert.Positive(t, driver, "%s: the driver's files are mounted", where)
}

// gpuNodes are the GPU device nodes (/dev/nvidia<minor>) a probe saw.
func gpuNodes(r *probe.Report) []string {
	var out []string
	for _, d := range r.Devices {
		if rest := strings.TrimPrefix(d.Path, "/dev/nvidia"); rest != d.Path && rest != "" && strings.Trim(rest, "0123456789") == "" {
			out = append(out, d.Path)
		}
	}
	slices.Sort(out)
	return out
}

// envUUIDs are the device identities gpudra's CDI specs put in a
// container's environment.
func envUUIDs(r *probe.Report) []string {
	if r == nil {
		return nil
	}
	return devcluster.DeviceIdentities(r)
}

// specsOf are the CDI spec files in dir that belong to these claims.
func specsOf(t *testing.T, dir string, claimUIDs []string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	var out []string
	for _, e := range entries {
		for _, uid := range claimUIDs {
			if strings.Contains(e.Name(), uid) {
				out = append(out, fmt.Sprintf("%s (claim %s)", e.Name(), uid))
			}
		}
	}
	return out
}

// TestRealNodeRunsAFractionalGPU: the fractional example on a real node
// whose plugin shares its one H100 through consumable capacity (the
// chart's kubeletPlugin.fractionalGPUs, a value for every node, hence a
// cluster of its own), labelled and tainted as the example expects. Three
// pods share the GPU; each sees exactly it, with its MPS limits.
func TestRealNodeRunsAFractionalGPU(t *testing.T) {
	b := binaries(t)
	img := imageTarball(t)
	ctx := context.Background()
	opts := chart.Default(repo)
	opts.Values = append(opts.Values, "--set", "kubeletPlugin.fractionalGPUs=true")
	c, err := devcluster.Start(ctx, devcluster.Options{RealNodes: true, Chart: opts})
	require.NoError(t, err)
	t.Cleanup(c.Stop)
	machine, err := filepath.Abs(filepath.Join(repo, "examples", "machines", "one-h100.yaml"))
	require.NoError(t, err)
	const key = "gpu.gpudra.dev/fractional"
	n, err := c.AddRealNode(ctx, devcluster.RealNodeOptions{Name: "real-frac-0", Binaries: b, Image: img, Machine: machine,
		Labels: map[string]string{key: "true"}, Taints: []v1.Taint{{Key: key, Value: "true", Effect: v1.TaintEffectNoSchedule}}})
	require.NoError(t, err)
	_, err = c.ApplyFiles(ctx, "default", filepath.Join(repo, "examples", "deviceclasses"))
	require.NoError(t, err)
	runExample(t, c, n, "fractional", 3, func(t *testing.T, pods []*v1.Pod, reports map[string]*probe.Report) {
		uuids := map[string]bool{}
		for who, r := range reports {
			for _, u := range envUUIDs(r) {
				uuids[u] = true
			}
			assert.NotEmpty(t, r.Env["CUDA_MPS_PIPE_DIRECTORY"], "%s: its share's MPS daemon", who)
			assert.NotEmpty(t, r.Env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "%s: its share's memory limit", who)
		}
		assert.Len(t, uuids, 1, "the three shares are of the one GPU")
	})
}
