// Package e2e is gpudra's end-to-end suite: the example manifests applied to
// a devcluster (real kube-apiserver, scheduler and claim controller,
// simulated DGX H100 nodes running the real kubelet plugin). All control
// plane tests live in this one package so that it links once.
package e2e

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/devcluster/noderuntime"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

const examples = "../../examples"

// fractionalNode has one H100 shared through consumable capacity.
const fractionalNode = "h100-fractional-0"

// cluster is shared by every test: two simulated DGX H100 nodes, as in
// `make demo`. Each test works in its own namespace.
var cluster *devcluster.Cluster

func TestMain(m *testing.M) {
	flag.Parse()
	os.Exit(run(m))
}

func run(m *testing.M) int {
	logDir, err := os.MkdirTemp("", "gpudra-e2e-logs")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	logFile := filepath.Join(logDir, "devcluster.log")
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	for k, v := range map[string]string{"logtostderr": "false", "alsologtostderr": "false",
		"stderrthreshold": "FATAL", "log_file": logFile, "one_output": "true", "v": "2"} {
		_ = klogFlags.Set(k, v)
	}
	defer klog.Flush()

	ctx := context.Background()
	start := time.Now()
	mpsControl, err := filepath.Abs("../../hack/fake-nvidia-cuda-mps-control")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	// Under Node,RBAC, every gpudra component as the chart's
	// ServiceAccount: the chart's RBAC and admission policies are tested
	// for real, and a call they forbid fails the test (forbiddenCalls).
	opts := devcluster.Options{MPSControlBinary: mpsControl, Grove: true, Chart: chart.Default("../.."),
		// resource.k8s.io/v1beta1 served, as clusters that still carry
		// old clients serve it: admission must hold for its shape too
		// (TestFenceTolerationRefused).
		APIServerFlags: []string{"--runtime-config=resource.k8s.io/v1beta1=true"}}
	if err := controlPlaneLimitsFromEnv(&opts); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	// Real containers (runc and the probe) on every node, where make
	// test-e2e provides them (issue 27).
	if runc, probe := os.Getenv("RUNC"), os.Getenv("PROBE"); runc != "" && probe != "" {
		timings := &noderuntime.Timings{}
		opts.Runtime = &noderuntime.OCIRuntime{Runc: runc, Probe: probe, MPSServer: os.Getenv("MPS_SERVER"), Timings: timings}
		// The start-up real containers add (docs/benchmarks.md).
		defer func() {
			p50, n := timings.Percentile(0.5)
			p99, _ := timings.Percentile(0.99)
			fmt.Printf("real containers: %d started, start-up p50 %v p99 %v\n", n, p50.Round(time.Millisecond), p99.Round(time.Millisecond))
		}()
	}
	cluster, err = devcluster.Start(ctx, opts)
	if err != nil {
		fmt.Fprintln(os.Stderr, "start devcluster:", err, "(log:", logFile+")")
		return 1
	}
	defer cluster.Stop()
	// As in the demo: one DGX H100 in MIG mode, one with MIG off.
	nodes := []nodeagent.NodeOptions{{Name: "dgx-h100-0", Machine: "dgx-h100"}, {Name: "dgx-h100-1", Machine: "dgx-h100-nomig",
		// A PodGroup's 300 pods share one claim here (gangworkload_test.go).
		MaxPods: 400},
		nodeagent.FractionalNode(fractionalNode, filepath.Join(examples, "machines", "one-h100.yaml")),
		// Device-plugin mode (deviceplugin_test.go): labelled and tainted,
		// with no ResourceSlices, so DRA tests never land there.
		nodeagent.DevicePluginNode(dpNode, dpMachine, dpNodeConfig)}
	for _, opts := range nodes {
		n, err := cluster.AddNode(ctx, opts)
		if err == nil {
			err = n.WaitForSlices(ctx)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "add node:", err, "(log:", logFile+")")
			return 1
		}
	}
	if _, err := cluster.ApplyFiles(ctx, "", filepath.Join(examples, "deviceclasses")); err != nil {
		fmt.Fprintln(os.Stderr, "device classes:", err)
		return 1
	}
	fmt.Printf("devcluster with 2 simulated DGX H100 nodes, a fractional H100 and a device-plugin node ready in %s; log: %s\n", time.Since(start).Round(time.Millisecond), logFile)
	code := m.Run()
	if calls := cluster.TakeForbidden(); len(calls) > 0 {
		fmt.Fprintln(os.Stderr, "FAIL: gpudra components made calls the chart's RBAC or admission policies forbid:")
		for _, call := range calls {
			fmt.Fprintln(os.Stderr, "  ", call)
		}
		code = 1
	}
	if code == 0 && os.Getenv("GPUDRA_E2E_KEEP_LOG") == "" {
		_ = os.RemoveAll(logDir)
	} else {
		fmt.Println("devcluster log kept at", logFile)
	}
	return code
}

// controlPlaneLimitsFromEnv tunes the scheduler's and the controllers'
// client limits from DEVCLUSTER_CONTROL_PLANE_QPS and
// DEVCLUSTER_CONTROL_PLANE_BURST, so that the suite and the benchmark run
// at the shipped limits or at tuned ones without a code change.
func controlPlaneLimitsFromEnv(opts *devcluster.Options) error {
	if v := os.Getenv("DEVCLUSTER_CONTROL_PLANE_QPS"); v != "" {
		qps, err := strconv.ParseFloat(v, 32)
		if err != nil || qps < 0 {
			return fmt.Errorf("DEVCLUSTER_CONTROL_PLANE_QPS=%q: not a QPS", v)
		}
		opts.ControlPlaneQPS = float32(qps)
	}
	if v := os.Getenv("DEVCLUSTER_CONTROL_PLANE_BURST"); v != "" {
		burst, err := strconv.Atoi(v)
		if err != nil || burst < 0 {
			return fmt.Errorf("DEVCLUSTER_CONTROL_PLANE_BURST=%q: not a burst", v)
		}
		opts.ControlPlaneBurst = burst
	}
	return nil
}

// namespace creates a namespace for one test and deletes its pods at the
// end (no namespace controller runs, so the namespace itself stays).
func namespace(t *testing.T) string {
	t.Helper()
	name := strings.ToLower(strings.NewReplacer("/", "-", "_", "-").Replace(t.Name()))
	if len(name) > 50 {
		name = name[:50]
	}
	name = strings.TrimRight(name, "-") + fmt.Sprintf("-%d", time.Now().UnixNano()%100000)
	ctx := context.Background()
	noForbiddenCalls(t, "before this test (an earlier test without a namespace, or the cluster's start)")
	_, err := cluster.Client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	require.NoError(t, err)
	t.Cleanup(func() {
		deleteAllPods(t, name)
		noForbiddenCalls(t, "during this test")
	})
	return name
}

// noForbiddenCalls fails the test if a gpudra component made a call that
// the chart's RBAC or admission policies refused: the chart lacks what the
// code does (or the code does what it should not).
func noForbiddenCalls(t testing.TB, when string) {
	t.Helper()
	for _, call := range cluster.TakeForbidden() {
		t.Errorf("forbidden %s: %s", when, call)
	}
}

func deleteAllPods(t testing.TB, ns string) {
	ctx := context.Background()
	pods, err := cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return
	}
	for _, p := range pods.Items {
		_ = cluster.Client.CoreV1().Pods(ns).Delete(ctx, p.Name, metav1.DeleteOptions{})
	}
	for _, p := range pods.Items {
		waitPodGone(t, ns, p.Name)
	}
}

func apply(t *testing.T, ns string, paths ...string) {
	t.Helper()
	_, err := cluster.ApplyFiles(context.Background(), ns, paths...)
	require.NoError(t, err)
}

func waitRunning(t *testing.T, ns, name string) *v1.Pod {
	t.Helper()
	var pod *v1.Pod
	err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		p, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		pod = p
		return p.Status.Phase == v1.PodRunning, nil
	})
	require.NoError(t, err, "pod %s/%s not running: %s", ns, name, describe(pod))
	return pod
}

func waitPodGone(t testing.TB, ns, name string) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	})
	require.NoError(t, err, "pod %s/%s was not deleted", ns, name)
}

func describe(pod *v1.Pod) string {
	if pod == nil {
		return "<none>"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "phase %s node %q", pod.Status.Phase, pod.Spec.NodeName)
	for _, c := range pod.Status.Conditions {
		fmt.Fprintf(&b, "; %s=%s %s %s", c.Type, c.Status, c.Reason, c.Message)
	}
	events, _ := cluster.Client.CoreV1().Events(pod.Namespace).List(context.Background(), metav1.ListOptions{})
	if events != nil {
		for _, e := range events.Items {
			if e.InvolvedObject.Name == pod.Name {
				fmt.Fprintf(&b, "; event %s: %s", e.Reason, e.Message)
			}
		}
	}
	return b.String()
}

// views is what the devcluster kubelet recorded for the pod's containers.
func views(t *testing.T, pod *v1.Pod) map[string]noderuntime.ContainerView {
	t.Helper()
	var v map[string]noderuntime.ContainerView
	require.NoError(t, json.Unmarshal([]byte(pod.Annotations[nodeagent.ContainersAnnotation]), &v))
	return v
}

// podClaim returns the allocated claim behind one of the pod's claims.
func podClaim(t *testing.T, pod *v1.Pod, podClaimName string) *resourceapi.ResourceClaim {
	t.Helper()
	var claimName string
	for _, s := range pod.Status.ResourceClaimStatuses {
		if s.Name == podClaimName && s.ResourceClaimName != nil {
			claimName = *s.ResourceClaimName
		}
	}
	for _, c := range pod.Spec.ResourceClaims {
		if c.Name == podClaimName && c.ResourceClaimName != nil {
			claimName = *c.ResourceClaimName
		}
	}
	require.NotEmpty(t, claimName, "pod claim %s has no ResourceClaim", podClaimName)
	claim, err := cluster.Client.ResourceV1().ResourceClaims(pod.Namespace).Get(context.Background(), claimName, metav1.GetOptions{})
	require.NoError(t, err)
	require.NotNil(t, claim.Status.Allocation, "claim %s is not allocated", claimName)
	return claim
}

// onlyDevice is the one allocation result of a claim and the published
// device it names.
func onlyDevice(t *testing.T, claim *resourceapi.ResourceClaim) (resourceapi.DeviceRequestAllocationResult, resourceapi.Device) {
	t.Helper()
	results := claim.Status.Allocation.Devices.Results
	require.Len(t, results, 1, "claim %s", claim.Name)
	return results[0], device(t, results[0].Pool, results[0].Device)
}

// device finds a published device by pool and name.
func device(t *testing.T, pool, name string) resourceapi.Device {
	t.Helper()
	slices, err := cluster.Client.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	for _, s := range slices.Items {
		if s.Spec.Pool.Name != pool || s.Spec.Driver != slicebuilder.DriverName {
			continue
		}
		for _, d := range s.Spec.Devices {
			if d.Name == name {
				return d
			}
		}
	}
	t.Fatalf("device %s/%s is not published", pool, name)
	return resourceapi.Device{}
}

func attr(d resourceapi.Device, name string) string {
	a, ok := d.Attributes[resourceapi.QualifiedName(slicebuilder.DriverName+"/"+name)]
	if !ok {
		a = d.Attributes[resourceapi.QualifiedName(name)]
	}
	switch {
	case a.StringValue != nil:
		return *a.StringValue
	case a.VersionValue != nil:
		return *a.VersionValue
	case a.IntValue != nil:
		return fmt.Sprint(*a.IntValue)
	case a.BoolValue != nil:
		return fmt.Sprint(*a.BoolValue)
	}
	return ""
}

// cdiSpecs lists the claim UIDs with a CDI spec on the node.
func cdiSpecFiles(t *testing.T, node string) []string {
	t.Helper()
	n := cluster.Node(node)
	require.NotNil(t, n, "node %s", node)
	files, err := filepath.Glob(filepath.Join(n.CDIDir(), "*"))
	require.NoError(t, err)
	return files
}

func hasSpecFor(t *testing.T, node string, claimUID string) bool {
	for _, f := range cdiSpecFiles(t, node) {
		if strings.Contains(filepath.Base(f), claimUID) {
			return true
		}
	}
	return false
}
