package e2e

import (
	"context"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// sample is one series of a scrape: its labels and value.
type sample struct {
	labels map[string]string
	value  float64
}

// scrape is a node's telemetry (Node.ScrapeMetrics), parsed, by metric
// name, and its text.
type scrape struct {
	node   string
	text   string
	series map[string][]sample
}

func scrapeNode(t *testing.T, node string) scrape {
	t.Helper()
	text, err := cluster.Node(node).ScrapeMetrics()
	require.NoError(t, err)
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(strings.NewReader(text))
	require.NoError(t, err)
	s := scrape{node: node, text: text, series: map[string][]sample{}}
	for name, f := range families {
		for _, m := range f.GetMetric() {
			l := map[string]string{}
			for _, p := range m.GetLabel() {
				l[p.GetName()] = p.GetValue()
			}
			v := m.GetGauge().GetValue()
			if m.GetCounter() != nil {
				v = m.GetCounter().GetValue()
			}
			s.series[name] = append(s.series[name], sample{labels: l, value: v})
		}
	}
	return s
}

// keepScrapes writes the scrapes to $GPUDRA_SCRAPES_DIR, when set, as
// <test>-<when>-<node>.prom, for the tests of the alerting and recording
// rules to evaluate (hack/promrules, TestXIDAlertOverDevclusterScrapes);
// nothing otherwise.
func keepScrapes(t *testing.T, when string, scrapes ...scrape) {
	t.Helper()
	dir := os.Getenv("GPUDRA_SCRAPES_DIR")
	if dir == "" {
		return
	}
	require.NoError(t, os.MkdirAll(dir, 0o755))
	for _, s := range scrapes {
		name := fmt.Sprintf("%s-%s-%s.prom", strings.ReplaceAll(t.Name(), "/", "-"), when, s.node)
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(s.text), 0o644))
	}
}

// Per-container attribution series (docs/metrics.md).
const (
	podInfo       = "gpudra_device_pod_info"
	containerMem  = "gpudra_container_gpu_memory_used_bytes"
	containerSM   = "gpudra_container_gpu_sm_utilization_ratio"
	containerProc = "gpudra_container_gpu_processes"
)

// wantContainer is what one container's series must be: on exactly
// devices (slice device names), each with these figures, SM utilization
// only where the device is not a MIG device.
type wantContainer struct {
	namespace, pod, container string
	// claims by device: the ResourceClaim's name on pod_info.
	claims map[string]string
	// sm and memory by device (sm scaled where the device is over-asked).
	sm     map[string]float64
	memory map[string]float64
	mig    map[string]bool
	// idle: a container that holds its devices and runs no process on
	// them (all figures 0); else one process on each.
	idle bool
}

func (w wantContainer) String() string {
	return fmt.Sprintf("%s/%s container %s", w.namespace, w.pod, w.container)
}

// containerSeries are a container's series of one metric, by device.
func (s scrape) containerSeries(metric, namespace, pod, container string) map[string]sample {
	out := map[string]sample{}
	for _, m := range s.series[metric] {
		if m.labels["namespace"] == namespace && m.labels["pod"] == pod && m.labels["container"] == container {
			out[m.labels["dra_device_name"]] = m
		}
	}
	return out
}

// mismatches lists how the scrapes differ from what the containers of
// namespace should have: every container of want with its series on
// exactly its devices and its figures, and no series of the namespace
// for any other container. Empty when they match.
func mismatches(scrapes map[string]scrape, namespace string, want []wantContainer) []string {
	var out []string
	for _, node := range sortedKeys(scrapes) {
		s := scrapes[node]
		for _, m := range s.series["gpudra_telemetry_attribution_up"] {
			if m.value != 1 {
				out = append(out, fmt.Sprintf("%s: gpudra_telemetry_attribution_up %v", node, m.value))
			}
		}
		if len(s.series["gpudra_telemetry_attribution_up"]) == 0 {
			out = append(out, node+": no gpudra_telemetry_attribution_up")
		}
		for _, m := range s.series["gpudra_telemetry_unresolved_processes"] {
			if m.value != 0 {
				out = append(out, fmt.Sprintf("%s: %v processes unresolved", node, m.value))
			}
		}
	}
	wanted := map[string]bool{}
	for _, w := range want {
		wanted[w.pod+"/"+w.container] = true
	}
	for _, node := range sortedKeys(scrapes) {
		s := scrapes[node]
		for _, metric := range []string{podInfo, containerMem, containerSM, containerProc} {
			for _, m := range s.series[metric] {
				if m.labels["namespace"] == namespace && !wanted[m.labels["pod"]+"/"+m.labels["container"]] {
					out = append(out, fmt.Sprintf("%s: %s series for %s/%s, which holds no device: %v", node, metric, m.labels["pod"], m.labels["container"], m.labels))
				}
			}
		}
	}
	for _, w := range want {
		all := map[string]map[string]sample{}
		for _, metric := range []string{podInfo, containerMem, containerSM, containerProc} {
			all[metric] = map[string]sample{}
			for _, s := range scrapes {
				for d, m := range s.containerSeries(metric, w.namespace, w.pod, w.container) {
					all[metric][d] = m
				}
			}
		}
		wantDevices := sortedKeys(w.memory)
		check := func(metric string, devs []string) {
			if got := sortedKeys(all[metric]); !slices.Equal(got, devs) {
				out = append(out, fmt.Sprintf("%s: %s on devices %v, want exactly %v", w, metric, got, devs))
			}
		}
		check(podInfo, wantDevices)
		check(containerMem, wantDevices)
		check(containerProc, wantDevices)
		var smDevices []string
		for _, d := range wantDevices {
			if !w.mig[d] {
				smDevices = append(smDevices, d)
			}
		}
		check(containerSM, smDevices)
		for _, d := range wantDevices {
			if m, ok := all[podInfo][d]; ok && (m.value != 1 || m.labels["dra_claim_name"] != w.claims[d]) {
				out = append(out, fmt.Sprintf("%s: %s on %s = %v, claim %q, want 1 and claim %q", w, podInfo, d, m.value, m.labels["dra_claim_name"], w.claims[d]))
			}
			if m, ok := all[containerMem][d]; ok && m.value != w.memory[d] {
				out = append(out, fmt.Sprintf("%s: %s on %s = %v, want %v", w, containerMem, d, m.value, w.memory[d]))
			}
			procs := 1.0
			if w.idle {
				procs = 0
			}
			if m, ok := all[containerProc][d]; ok && m.value != procs {
				out = append(out, fmt.Sprintf("%s: %s on %s = %v, want %v", w, containerProc, d, m.value, procs))
			}
			if m, ok := all[containerSM][d]; ok && math.Abs(m.value-w.sm[d]) > 1e-6 {
				out = append(out, fmt.Sprintf("%s: %s on %s = %v, want %v", w, containerSM, d, m.value, w.sm[d]))
			}
		}
	}
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// waitForSeries scrapes the nodes until the namespace's container series
// are what want says (mismatches), or fails with what differs; it returns
// the last scrapes.
func waitForSeries(t *testing.T, nodes []string, namespace string, want []wantContainer) map[string]scrape {
	t.Helper()
	var scrapes map[string]scrape
	var diff []string
	deadline := time.Now().Add(30 * time.Second)
	for {
		scrapes = map[string]scrape{}
		for _, n := range nodes {
			scrapes[n] = scrapeNode(t, n)
		}
		if diff = mismatches(scrapes, namespace, want); len(diff) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	require.Empty(t, diff, "the containers' series after 30 s")
	return scrapes
}

// withLoad sets the container's declared load (nodeagent.SimLoadEnv).
func withLoad(load string) func(*v1.Pod) {
	return func(p *v1.Pod) {
		p.Spec.Containers[0].Env = append(p.Spec.Containers[0].Env, v1.EnvVar{Name: nodeagent.SimLoadEnv, Value: load})
	}
}

func mutate(p *v1.Pod, fns ...func(*v1.Pod)) *v1.Pod {
	for _, f := range fns {
		f(p)
	}
	return p
}

// TestTelemetryPerPod (issue 36): containers that declare a load
// (GPUDRA_SIM_LOAD) have it on the simulated GPUs their claims give them,
// as processes of their runc container's real PID, and the node's
// telemetry attributes each to its pod and container through the kubelet's
// pod-resources API, the process's cgroup and the container's log link:
// a pod on a whole GPU, one on a MIG device (no SM series: NVML has no
// per-process SM figure there), two pods on one shared claim each with
// its own figures on the one GPU, and a pod without a claim, whose load
// goes nowhere, in no series. A pod whose load is malformed waits with
// CreateContainerConfigError naming it, and holds its GPU using none of it.
// An XID injected on a GPU in use is counted on that GPU; once the pods
// are gone, so are their series and their processes.
func TestTelemetryPerPod(t *testing.T) {
	if !realContainers() {
		t.Skip("needs real containers (make test-e2e as root: RUNC and PROBE)")
	}
	const (
		wholeNode = "dgx-h100-1" // MIG off
		migNode   = "dgx-h100-0" // MIG mode
	)
	ns := namespace(t)
	ctx := context.Background()
	const gi = 1 << 30
	mig := template("mig-1g", resourceapi.DeviceRequest{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "mig.gpudra.dev",
		Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
			Expression: `device.attributes["gpu.gpudra.dev"].migProfile == "1g.10gb"`}}}}}, nil, nil)
	_, err := cluster.Client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, mig, metav1.CreateOptions{})
	require.NoError(t, err)
	shared := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "shared-gpu"}, Spec: resourceapi.ResourceClaimSpec{
		Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{
			DeviceClassName: "gpu.gpudra.dev"}}}}}}
	_, err = cluster.Client.ResourceV1().ResourceClaims(ns).Create(ctx, shared, metav1.CreateOptions{})
	require.NoError(t, err)
	onShared := func(name, load string) *v1.Pod {
		p := gpuPod(name, "")
		p.Spec.ResourceClaims[0] = v1.PodResourceClaim{Name: "gpu", ResourceClaimName: ptr("shared-gpu")}
		return mutate(p, pinned(wholeNode), withLoad(load))
	}
	plain := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "plain"}, Spec: v1.PodSpec{RestartPolicy: v1.RestartPolicyNever,
		Containers: []v1.Container{{Name: "c", Image: "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04"}}}}
	create(t, ns, gpus("one", 1),
		mutate(gpuPod("exclusive", "one"), pinned(wholeNode), withLoad("sm=0.4,memory=20Gi")),
		mutate(gpuPod("mig", "mig-1g"), pinned(migNode), withLoad("sm=0.3,memory=4Gi")),
		onShared("primary", "sm=0.25,memory=8Gi"), onShared("shadow", "sm=0.5,memory=16Gi"),
		// A load and no device: it goes nowhere.
		mutate(plain, pinned(wholeNode), withLoad("sm=0.9,memory=1Gi")),
		// A malformed load: the container does not start.
		mutate(gpuPod("malformed", "one"), pinned(wholeNode), withLoad("sm=40%")))

	type declared struct {
		pod string
		sm  float64
		mem float64
	}
	var want []wantContainer
	var exclusiveGPU string
	for _, d := range []declared{{"exclusive", 0.4, 20 * gi}, {"mig", 0.3, 4 * gi}, {"primary", 0.25, 8 * gi}, {"shadow", 0.5, 16 * gi}} {
		pod := waitRunning(t, ns, d.pod)
		claim := podClaim(t, pod, "gpu")
		result, dev := onlyDevice(t, claim)
		require.Equal(t, pod.Spec.NodeName, result.Pool)
		isMIG := attr(dev, "type") == "mig"
		assert.Equal(t, d.pod == "mig", isMIG, "%s: a MIG device for the MIG pod only", d.pod)
		if d.pod == "exclusive" {
			exclusiveGPU = attr(dev, "uuid")
		}
		want = append(want, wantContainer{namespace: ns, pod: d.pod, container: "cuda",
			claims: map[string]string{result.Device: claim.Name}, sm: map[string]float64{result.Device: d.sm},
			memory: map[string]float64{result.Device: d.mem}, mig: map[string]bool{result.Device: isMIG}})
		assertContainerPlumbing(t, pod, "cuda")
	}
	waitRunning(t, ns, "plain")
	// As the kubelet reports a container it cannot configure: waiting,
	// the reason and what is wrong on its status.
	var bad *v1.ContainerStateWaiting
	require.Eventually(t, func() bool {
		p, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, "malformed", metav1.GetOptions{})
		require.NoError(t, err)
		for _, cs := range p.Status.ContainerStatuses {
			if cs.State.Waiting != nil && cs.State.Waiting.Reason == "CreateContainerConfigError" {
				bad = cs.State.Waiting
			}
		}
		return bad != nil && p.Status.Phase == v1.PodPending
	}, 30*time.Second, 200*time.Millisecond, "the pod with a malformed load is not waiting with CreateContainerConfigError")
	assert.Equal(t, fmt.Sprintf(`pod %s/malformed container cuda: GPUDRA_SIM_LOAD="sm=40%%": sm=40%%: want a share of the device's SMs from 0 to 1`, ns), bad.Message)
	// The pod whose container did not start holds its GPU all the same
	// (its claim is prepared; the pod-resources API lists it): its series
	// say it uses none of it.
	malformed, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, "malformed", metav1.GetOptions{})
	require.NoError(t, err)
	mClaim := podClaim(t, malformed, "gpu")
	mResult, _ := onlyDevice(t, mClaim)
	want = append(want, wantContainer{namespace: ns, pod: "malformed", container: "cuda", idle: true,
		claims: map[string]string{mResult.Device: mClaim.Name}, sm: map[string]float64{mResult.Device: 0},
		memory: map[string]float64{mResult.Device: 0}, mig: map[string]bool{mResult.Device: false}})
	require.Equal(t, want[2].memory, map[string]float64{sortedKeys(want[2].memory)[0]: 8 * gi})
	assert.Equal(t, sortedKeys(want[2].memory), sortedKeys(want[3].memory), "the two pods of the shared claim are on one GPU")

	scrapes := waitForSeries(t, []string{wholeNode, migNode}, ns, want)
	// The shared GPU's memory used is both pods' (and nothing else is on
	// it): each pod's series is its own part of it.
	sharedDev := sortedKeys(want[2].memory)[0]
	for _, m := range scrapes[wholeNode].series["gpudra_gpu_framebuffer_used_bytes"] {
		if m.labels["dra_device_name"] == sharedDev {
			assert.GreaterOrEqual(t, m.value, float64(24*gi), "the shared GPU's framebuffer used holds both pods' 8 + 16 GiB")
		}
	}
	for _, s := range scrapes {
		for metric, series := range s.series {
			for _, m := range series {
				assert.False(t, m.labels["namespace"] == ns && m.labels["pod"] == "plain", "%s: the pod without a claim is in %s: %v", s.node, metric, m.labels)
			}
		}
	}

	// An XID on the exclusive pod's GPU (43: the application's fault, so
	// the GPU stays healthy for the other tests) is counted on that GPU.
	xids := func() float64 {
		for _, m := range scrapeNode(t, wholeNode).series["gpudra_gpu_xid_errors_total"] {
			if m.labels["gpu"] == exclusiveGPU && m.labels["xid"] == "43" {
				return m.value
			}
		}
		return 0
	}
	before := xids()
	keepScrapes(t, "before-xid", scrapeNode(t, wholeNode))
	require.NoError(t, cluster.Node(wholeNode).Machine.InjectXID(exclusiveGPU, "", 43))
	require.Eventually(t, func() bool { return xids() == before+1 }, 10*time.Second, 100*time.Millisecond,
		"gpudra_gpu_xid_errors_total{xid=\"43\"} on %s: %v, want %v", exclusiveGPU, xids(), before+1)
	final := scrapeNode(t, wholeNode)
	// The XID's GPU is one a pod holds: what the alert on XIDs of GPUs in
	// use joins on.
	inUse := false
	for _, m := range final.series[podInfo] {
		inUse = inUse || (m.labels["gpu"] == exclusiveGPU && m.labels["pod"] == "exclusive")
	}
	assert.True(t, inUse, "the XID's GPU %s has the exclusive pod's pod_info series", exclusiveGPU)
	keepScrapes(t, "after-xid", final)

	// Once the pods are gone, so are their processes and their series.
	deleteAllPods(t, ns)
	waitForSeries(t, []string{wholeNode, migNode}, ns, nil)
}

// TestTelemetryDevicePluginNode: a device-plugin node exports the same
// per-container series, from the same facts (the kubelet's pod-resources
// API lists device plugin devices too), with no claim: a pod asking for
// nvidia.com/gpu: 1 has its declared load on the device plugin's device it
// was given, and nowhere else.
func TestTelemetryDevicePluginNode(t *testing.T) {
	if !realContainers() {
		t.Skip("needs real containers (make test-e2e as root: RUNC and PROBE)")
	}
	node := cluster.Node(dpNode)
	require.NotNil(t, node)
	ns := namespace(t)
	create(t, ns, nil, mutate(dpPod("dp-loaded", dpNode, map[string]int64{"nvidia.com/gpu": 1}), withLoad("sm=0.35,memory=10Gi")))
	pod := waitRunning(t, ns, "dp-loaded")
	gpus, _ := inventory(t, node)
	seen := views(t, pod)["cuda"].VisibleGPUs()
	require.Len(t, seen, 1)
	g, ok := gpus[seen[0]]
	require.True(t, ok, "a whole GPU of the node: %s", seen[0])
	dev := slicebuilder.GPUDeviceName(&g)
	assertContainerPlumbing(t, pod, "cuda")
	scrapes := waitForSeries(t, []string{dpNode}, ns, []wantContainer{{namespace: ns, pod: "dp-loaded", container: "cuda",
		claims: map[string]string{dev: ""}, sm: map[string]float64{dev: 0.35}, memory: map[string]float64{dev: 10 << 30},
		mig: map[string]bool{dev: false}}})
	for _, m := range scrapes[dpNode].series[podInfo] {
		if m.labels["pod"] == "dp-loaded" {
			assert.Equal(t, g.UUID, m.labels["gpu"])
		}
	}
}

// assertContainerPlumbing checks what attribution reads of a running
// container on its node: the container's log link, named after its pod,
// namespace, container and ID, and its first process's cgroup, the
// kubelet's below the pod's.
func assertContainerPlumbing(t *testing.T, pod *v1.Pod, container string) {
	t.Helper()
	var id string
	for _, cs := range pod.Status.ContainerStatuses {
		if cs.Name == container {
			id = strings.TrimPrefix(cs.ContainerID, "runc://")
		}
	}
	require.Regexp(t, `^[0-9a-f]{64}$`, id, "container %s of %s: a 64-hex ID", container, pod.Name)
	link := filepath.Join(cluster.Node(pod.Spec.NodeName).ContainerLogDir(), fmt.Sprintf("%s_%s_%s-%s.log", pod.Name, pod.Namespace, container, id))
	target, err := os.Readlink(link)
	require.NoError(t, err, "the log link of %s/%s", pod.Name, container)
	assert.True(t, strings.HasSuffix(target, fmt.Sprintf("/var/log/pods/%s_%s_%s/%s/0.log", pod.Namespace, pod.Name, pod.UID, container)), target)
	assert.FileExists(t, target)
	cgroups, err := filepath.Glob("/sys/fs/cgroup/*/kubepods/*/pod" + string(pod.UID) + "/" + id + "/cgroup.procs")
	require.NoError(t, err)
	if len(cgroups) == 0 {
		// cgroup v2 alone, or a guaranteed pod's cgroup.
		cgroups, _ = filepath.Glob("/sys/fs/cgroup/kubepods*/pod" + string(pod.UID) + "/" + id + "/cgroup.procs")
	}
	require.NotEmpty(t, cgroups, "pod %s container %s: its cgroup below /kubepods/<qos>/pod<uid>/", pod.Name, container)
	procs, err := os.ReadFile(cgroups[0])
	require.NoError(t, err)
	assert.NotEmpty(t, strings.TrimSpace(string(procs)), "the container's process is in its cgroup %s", cgroups[0])
}

// declaredLoad is the load the container declares, nil if none.
func declaredLoad(t *testing.T, c v1.Container) *nodeagent.SimLoad {
	t.Helper()
	for _, e := range c.Env {
		if e.Name == nodeagent.SimLoadEnv {
			l, err := nodeagent.ParseSimLoad(e.Value)
			require.NoError(t, err)
			return &l
		}
	}
	return nil
}

// demoExamples are the demo's examples (cmd/devcluster's defaultExamples)
// but Grove's, whose pods Grove's operator makes.
var demoExamples = []string{"single-gpu", "nvlink-pair", "mig", "prioritized-list", "shared-claim", "cel-selector",
	"time-slicing", "mps", "fractional"}

// TestTelemetryOfTheDemo (issue 36, "Must show"): the demo's examples,
// whose containers declare loads (GPUDRA_SIM_LOAD), applied together;
// every running container with a claim has its series (pod_info with its
// claim, memory, processes, SM utilization but on MIG devices and GPUs in
// MIG mode) on exactly the devices its claims were allocated, with the
// figures it declared; where a device is over-asked (the time-sliced GPU:
// 0.8 + 0.6) each process gets share/sum of its SMs, as the simulator
// (and a real GPU) gives them.
func TestTelemetryOfTheDemo(t *testing.T) {
	if !realContainers() {
		t.Skip("needs real containers (make test-e2e as root: RUNC and PROBE)")
	}
	ns := namespace(t)
	ctx := context.Background()
	for _, f := range demoExamples {
		apply(t, ns, filepath.Join(examples, f))
	}
	notRunning, err := cluster.WaitForPods(ctx, ns, 2*time.Minute)
	require.NoError(t, err, "not running: %v", notRunning)
	pods, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	require.NoError(t, err)

	// What each container holds and declares, and what each device is
	// asked for in all.
	var want []wantContainer
	var loads []nodeagent.SimLoad // want's
	asked := map[string]float64{} // by node/device
	nodes := map[string]bool{}
	for _, pod := range pods.Items {
		for _, c := range pod.Spec.Containers {
			if len(c.Resources.Claims) == 0 {
				continue
			}
			load := declaredLoad(t, c)
			require.NotNil(t, load, "example pod %s container %s holds a claim and declares no %s", pod.Name, c.Name, nodeagent.SimLoadEnv)
			w := wantContainer{namespace: ns, pod: pod.Name, container: c.Name, claims: map[string]string{},
				sm: map[string]float64{}, memory: map[string]float64{}, mig: map[string]bool{}}
			for _, rc := range c.Resources.Claims {
				claim := podClaim(t, &pod, rc.Name)
				for _, r := range claim.Status.Allocation.Devices.Results {
					if rc.Request != "" && r.Request != rc.Request && !strings.HasPrefix(r.Request, rc.Request+"/") {
						continue
					}
					require.Equal(t, pod.Spec.NodeName, r.Pool, "%s: the claim's devices are on the pod's node", pod.Name)
					dev := device(t, r.Pool, r.Device)
					w.claims[r.Device] = claim.Name
					w.memory[r.Device] = float64(load.MemoryBytes)
					// NVML samples no SMs per process on a MIG device, nor
					// on a GPU in MIG mode (its instance spanning it runs
					// the process).
					w.mig[r.Device] = attr(dev, "type") == "mig" || attr(dev, "migEnabled") == "true"
					asked[r.Pool+"/"+r.Device] += load.SMShare
				}
			}
			require.NotEmpty(t, w.memory, "%s/%s: no device allocated", pod.Name, c.Name)
			nodes[pod.Spec.NodeName] = true
			want = append(want, w)
			loads = append(loads, *load)
		}
	}
	for i := range want {
		node := podNode(pods.Items, want[i].pod)
		for d := range want[i].memory {
			share := loads[i].SMShare
			if sum := asked[node+"/"+d]; sum > 1 {
				share /= sum
			}
			want[i].sm[d] = share
		}
	}
	overAsked := 0
	for _, sum := range asked {
		if sum > 1 {
			overAsked++
		}
	}
	assert.Positive(t, overAsked, "the examples over-ask one device (time-slicing): the scaling is checked")
	require.Len(t, want, 15, "the demo's containers with claims")
	scrapes := waitForSeries(t, sortedKeys(nodes), ns, want)
	var kept []scrape
	for _, n := range sortedKeys(scrapes) {
		kept = append(kept, scrapes[n])
	}
	keepScrapes(t, "demo", kept...)
}

// podNode is the node of the named pod.
func podNode(pods []v1.Pod, name string) string {
	for _, p := range pods {
		if p.Name == name {
			return p.Spec.NodeName
		}
	}
	return ""
}
