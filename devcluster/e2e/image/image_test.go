// Package image is the end-to-end suite of devcluster's image mode (issue
// 38): the chart's own kubelet plugin DaemonSet pod and controller
// Deployment pods, rendered by helm and run in runc from make image's OCI
// layout, serve the cluster the examples run on. make test-e2e-image runs
// it (GPUDRA_IMAGE_LAYOUT, RUNC; root); without them it is skipped, or
// fails where GPUDRA_REQUIRE_IMAGE_E2E is set (make test).
package image

import (
	"context"
	"debug/buildinfo"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/devcluster/imagemode"
	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/pkg/webhook"
)

const examples = "../../../examples"

func TestMain(m *testing.M) {
	flag.Parse()
	if os.Getenv("GPUDRA_IMAGE_LAYOUT") == "" || os.Getenv("RUNC") == "" || os.Geteuid() != 0 {
		if os.Getenv("GPUDRA_REQUIRE_IMAGE_E2E") != "" {
			fmt.Fprintln(os.Stderr, "FAIL: the image e2e suite needs GPUDRA_IMAGE_LAYOUT, RUNC and root (make test-e2e-image)")
			os.Exit(1)
		}
		fmt.Println("skipped: the image e2e suite needs GPUDRA_IMAGE_LAYOUT, RUNC and root (make test-e2e-image)")
		os.Exit(0)
	}
	logDir, err := os.MkdirTemp("", "gpudra-e2e-image-logs")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	for k, v := range map[string]string{"logtostderr": "false", "alsologtostderr": "false",
		"stderrthreshold": "FATAL", "log_file": filepath.Join(logDir, "devcluster.log"), "one_output": "true", "v": "2"} {
		_ = klogFlags.Set(k, v)
	}
	code := m.Run()
	klog.Flush()
	fmt.Println("devcluster logs:", logDir)
	os.Exit(code)
}

// startFromImage starts a devcluster whose plugin and controller are the
// chart's pods run from the image, the chart rendered with values added.
func startFromImage(t *testing.T, values ...string) *devcluster.Cluster {
	t.Helper()
	chartOpts := chart.Default("../../..")
	chartOpts.Values = values
	dir, err := os.MkdirTemp("", "dvi")
	require.NoError(t, err)
	c, err := devcluster.Start(context.Background(), devcluster.Options{Dir: dir, Chart: chartOpts,
		Image: &imagemode.Options{Layout: os.Getenv("GPUDRA_IMAGE_LAYOUT"), Runc: os.Getenv("RUNC")}})
	require.NoError(t, err, "start devcluster from the image %s", os.Getenv("GPUDRA_IMAGE_LAYOUT"))
	t.Cleanup(func() {
		if t.Failed() {
			for pod, path := range c.ImageLogs() {
				b, _ := os.ReadFile(path)
				lines := strings.Split(strings.TrimSpace(string(b)), "\n")
				t.Logf("log of %s (last lines):\n%s", pod, strings.Join(lines[max(0, len(lines)-15):], "\n"))
			}
		}
		c.Stop()
		_ = os.RemoveAll(dir)
	})
	return c
}

// imageDigest is the manifest digest of the layout's image for this
// machine's architecture, read here from the layout.
func imageDigest(t *testing.T) string {
	t.Helper()
	p, err := layout.FromPath(os.Getenv("GPUDRA_IMAGE_LAYOUT"))
	require.NoError(t, err)
	idx, err := p.ImageIndex()
	require.NoError(t, err)
	top, err := idx.IndexManifest()
	require.NoError(t, err)
	require.Len(t, top.Manifests, 1)
	inner, err := idx.ImageIndex(top.Manifests[0].Digest)
	require.NoError(t, err)
	m, err := inner.IndexManifest()
	require.NoError(t, err)
	for _, d := range m.Manifests {
		if d.Platform != nil && d.Platform.Architecture == runtime.GOARCH {
			return "sha256:" + d.Digest.Hex
		}
	}
	t.Fatalf("the layout has no %s image", runtime.GOARCH)
	return ""
}

// rootReadOnly says whether the process's / is mounted read-only, from
// its own mountinfo.
func rootReadOnly(t *testing.T, pid int) bool {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	require.NoError(t, err)
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) > 5 && f[4] == "/" {
			return slices.Contains(strings.Split(f[5], ","), "ro")
		}
	}
	t.Fatalf("/proc/%d/mountinfo has no /", pid)
	return false
}

// procStatus reads a field of /proc/<pid>/status.
func procStatus(t *testing.T, pid int, field string) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	require.NoError(t, err)
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, field+":"); ok {
			return strings.Fields(v)[0]
		}
	}
	t.Fatalf("/proc/%d/status has no %s", pid, field)
	return ""
}

// TestChartPodsRunFromImage: two nodes whose plugin is the chart's
// DaemonSet pod and a controller that is the chart's Deployment, run from
// the image as the chart says (user, command, args); the examples' pods
// reach Running with the GPUs their claims were allocated; the webhook
// the API server calls is the controller pod's, through the chart's
// Service; gangs are planned; no component was refused an API call.
func TestChartPodsRunFromImage(t *testing.T) {
	ctx := context.Background()
	// GPUDRA_IMAGE_E2E_VALUES: helm flags added to the chart, to show what
	// a broken value does to this test (docs/devcluster.md).
	c := startFromImage(t, strings.Fields(os.Getenv("GPUDRA_IMAGE_E2E_VALUES"))...)
	for _, name := range []string{"dgx-h100-0", "dgx-h100-1"} {
		n, err := c.AddNode(ctx, nodeagent.NodeOptions{Name: name, Machine: "dgx-h100-nomig"})
		require.NoError(t, err)
		require.NoError(t, n.WaitForSlices(ctx), "node %s: the plugin pod publishes the node's pool", name)
	}
	digest := imageDigest(t)
	// Ready as their readiness probes say: the controller's once its
	// webhook serves a valid certificate (a replica that does not lead
	// loads the leader's at its next reload).
	err := wait.PollUntilContextTimeout(ctx, time.Second, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		pods, err := c.Client.CoreV1().Pods(chart.PluginNamespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		for _, p := range pods.Items {
			if p.Annotations[imagemode.PodAnnotation] != "" && (len(p.Status.ContainerStatuses) == 0 || !p.Status.ContainerStatuses[0].Ready) {
				return false, nil
			}
		}
		return true, nil
	})
	require.NoError(t, err, "the chart's pods become ready")

	t.Run("the chart's pods, from the image", func(t *testing.T) {
		pods, err := c.Client.CoreV1().Pods(chart.PluginNamespace).List(ctx, metav1.ListOptions{})
		require.NoError(t, err)
		seen := map[string]int{}
		netns := map[string]int{}
		for _, p := range pods.Items {
			if p.Annotations[imagemode.PodAnnotation] == "" {
				continue
			}
			component := p.Labels["app.kubernetes.io/component"]
			seen[component]++
			require.Len(t, p.Status.ContainerStatuses, 1, p.Name)
			cs := p.Status.ContainerStatuses[0]
			assert.Equal(t, v1.PodRunning, p.Status.Phase, p.Name)
			assert.True(t, cs.Ready, "%s is ready: its readiness probe passes", p.Name)
			assert.Equal(t, digest, cs.ImageID, "%s runs the layout's %s image", p.Name, runtime.GOARCH)
			assert.True(t, strings.HasPrefix(cs.ContainerID, "runc://"), cs.ContainerID)
			assert.Zero(t, cs.RestartCount, "%s never restarted", p.Name)
			pid, _, err := c.ImagePodProcess(p.Namespace, p.Name)
			require.NoError(t, err)
			cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
			require.NoError(t, err)
			args := strings.Split(strings.TrimRight(string(cmdline), "\x00"), "\x00")
			c0 := p.Spec.Containers[0]
			assert.Equal(t, append(slices.Clone(c0.Command), c0.Args...), args, "%s runs the chart's command and args", p.Name)
			// The image's binary: at its path in the image, gpudra's own
			// build (this machine has no /usr/bin/gpudra-*).
			exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
			require.NoError(t, err)
			assert.Equal(t, "/usr/bin/"+c0.Command[0], exe, "%s's binary, in its own root", p.Name)
			bi, err := buildinfo.ReadFile(fmt.Sprintf("/proc/%d/exe", pid))
			require.NoError(t, err)
			assert.True(t, strings.HasPrefix(bi.Path, "github.com/gpudra/gpudra/cmd/"), "%s runs %s", p.Name, bi.Path)
			_, err = os.Stat(exe)
			assert.True(t, os.IsNotExist(err), "this machine has no %s: the binary comes from the image", exe)
			switch component {
			case "controller":
				assert.Equal(t, "65532", procStatus(t, pid, "Uid"), "the controller runs as the chart's non-root user")
				// The bounding set: what drop ALL controls (a non-root
				// process has no effective capability anyway).
				assert.Equal(t, "0000000000000000", procStatus(t, pid, "CapBnd"), "the controller drops every capability")
				assert.True(t, rootReadOnly(t, pid), "the controller's root is read-only (readOnlyRootFilesystem)")
				assert.Equal(t, "1", procStatus(t, pid, "NoNewPrivs"))
				// Compared with the parent (go test): this process's own
				// threads may have entered pods' network namespaces.
				for _, ns := range []string{"pid", "net", "mnt"} {
					theirs, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/%s", pid, ns))
					require.NoError(t, err)
					host, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/%s", os.Getppid(), ns))
					require.NoError(t, err)
					assert.NotEqual(t, host, theirs, "the controller has a %s namespace of its own", ns)
					netns[theirs]++
				}
			case "kubelet-plugin":
				assert.Equal(t, "0", procStatus(t, pid, "Uid"), "the plugin runs as root, privileged")
				assert.False(t, rootReadOnly(t, pid), "the plugin's root is writable, as the chart leaves it")
				assert.Equal(t, p.Name, "gpudra-kubelet-plugin-"+p.Spec.NodeName)
			}
		}
		assert.Equal(t, map[string]int{"controller": 2, "kubelet-plugin": 2}, seen)
		assert.Len(t, netns, 6, "each controller pod has namespaces of its own: %v", netns)
		lease, err := c.Client.CoordinationV1().Leases(chart.PluginNamespace).Get(ctx, devcluster.ControllerLease, metav1.GetOptions{})
		require.NoError(t, err)
		assert.Contains(t, []string{"gpudra-controller-0", "gpudra-controller-1"}, *lease.Spec.HolderIdentity, "a controller pod leads")
	})

	t.Run("the webhook is the controller pods', through the chart's Service", func(t *testing.T) {
		spec := resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.gpudra.dev"}}},
			Config: []resourceapi.DeviceClaimConfiguration{{DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{
				Driver: webhook.DriverName, Parameters: runtimeRaw(`{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"Fast"}}`)}}}},
		}}
		_, err := c.Client.ResourceV1().ResourceClaims("default").Create(ctx, &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "bad"}, Spec: spec}, metav1.CreateOptions{})
		require.Error(t, err)
		assert.Contains(t, err.Error(), `admission webhook "resourceclaims.gpu.gpudra.dev" denied the request`)
		assert.Contains(t, err.Error(), `sharing.strategy: Unsupported value: "Fast"`)
	})

	t.Run("the examples' pods run with their GPUs", func(t *testing.T) {
		_, err := c.ApplyFiles(ctx, "", filepath.Join(examples, "deviceclasses"))
		require.NoError(t, err)
		for _, f := range []string{"single-gpu", "nvlink-pair", "shared-claim", "time-slicing", "gang/plain-pods.yaml"} {
			_, err := c.ApplyFiles(ctx, "default", filepath.Join(examples, f))
			require.NoError(t, err, f)
		}
		notRunning, err := c.WaitForPods(ctx, "default", 3*time.Minute)
		require.NoError(t, err, "not running: %v", notRunning)
		reports, err := devcluster.ReportPods(ctx, c.Client, "default")
		require.NoError(t, err)
		require.GreaterOrEqual(t, len(reports), 10, "the examples' pods")
		for _, r := range reports {
			var allocated []string
			for _, cl := range r.Claims {
				claim, err := c.Client.ResourceV1().ResourceClaims("default").Get(ctx, cl.Name, metav1.GetOptions{})
				require.NoError(t, err)
				require.NotNil(t, claim.Status.Allocation, "%s: claim %s", r.Name, cl.Name)
				for _, res := range claim.Status.Allocation.Devices.Results {
					allocated = append(allocated, r.Node+"/"+res.Device)
				}
			}
			require.NotEmpty(t, allocated, "%s has GPUs allocated", r.Name)
			var seen []string
			for _, v := range r.Containers {
				for _, uuid := range v.GPUs {
					seen = append(seen, r.Node+"/"+deviceOf(t, c, r.Node, uuid))
				}
			}
			assert.ElementsMatch(t, slices.Compact(sorted(allocated)), slices.Compact(sorted(seen)), "%s sees exactly the GPUs its claims were allocated", r.Name)
		}
	})

	t.Run("no component was refused an API call", func(t *testing.T) {
		for pod, path := range c.ImageLogs() {
			b, err := os.ReadFile(path)
			require.NoError(t, err)
			for _, l := range strings.Split(string(b), "\n") {
				assert.NotContains(t, l, "is forbidden", "%s was refused a call: RBAC or an admission policy lacks what it does", pod)
			}
		}
	})
}

func runtimeRaw(s string) k8sruntime.RawExtension { return k8sruntime.RawExtension{Raw: []byte(s)} }

func sorted(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}

// deviceOf is the name, in the node's ResourceSlices, of the GPU with
// this UUID.
func deviceOf(t *testing.T, c *devcluster.Cluster, node, uuid string) string {
	t.Helper()
	slices, err := c.Client.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	for _, s := range slices.Items {
		if s.Spec.Pool.Name != node {
			continue
		}
		for _, d := range s.Spec.Devices {
			if a, ok := d.Attributes["uuid"]; ok && a.StringValue != nil && *a.StringValue == uuid {
				return d.Name
			}
		}
	}
	t.Fatalf("node %s publishes no device with UUID %s", node, uuid)
	return ""
}

// TestBrokenChartValueFailsFromImage: a chart value that breaks the
// plugin's flag or mount shows where a user would see it, in the plugin
// pod's status, and the node's pool is never published; the suite above
// would fail on it. A flag: the binary exits, the container crash-loops.
// A mount: the container is never created (ContainerCreating, Pending).
func TestBrokenChartValueFailsFromImage(t *testing.T) {
	for _, tc := range []struct {
		name, value, reason, want string
		restarts                  int32
	}{
		{"a flag: the simulated machine's file", "kubeletPlugin.simMachine=/driver-root/no-such-machine.yaml", "CrashLoopBackOff", "no-such-machine.yaml", 2},
		{"a mount: the driver root", "kubeletPlugin.driverRoot=/no/such/driver", "ContainerCreating", "volume driver-root: hostPath", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			c := startFromImage(t, "--set-string", tc.value)
			_, err := c.AddNode(ctx, nodeagent.NodeOptions{Name: "dgx-h100-0", Machine: "dgx-h100-nomig"})
			require.NoError(t, err)
			var last v1.ContainerStatus
			var phase v1.PodPhase
			err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
				p, err := c.Client.CoreV1().Pods(chart.PluginNamespace).Get(ctx, "gpudra-kubelet-plugin-dgx-h100-0", metav1.GetOptions{})
				if err != nil || len(p.Status.ContainerStatuses) == 0 {
					return false, nil
				}
				last, phase = p.Status.ContainerStatuses[0], p.Status.Phase
				return last.State.Waiting != nil && last.RestartCount >= tc.restarts, nil
			})
			require.NoError(t, err, "the plugin pod's container waits (last status %+v)", last)
			assert.Equal(t, tc.reason, last.State.Waiting.Reason)
			assert.Contains(t, last.State.Waiting.Message, tc.want)
			assert.False(t, last.Ready)
			if tc.restarts == 0 {
				assert.Equal(t, v1.PodPending, phase, "a container never created leaves its pod Pending")
				assert.Zero(t, last.RestartCount)
			}
			rs, err := c.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
			require.NoError(t, err)
			assert.Empty(t, rs.Items, "no pool is published")
		})
	}
}
