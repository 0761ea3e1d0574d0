// Package gpusmoke runs devcluster's path on a real NVIDIA GPU: the same
// plugin, kubelet, CDI specs and runc as the simulated nodes, with NVML
// behind one node (make gpu-smoke, docs/gpu-smoke.md).
package gpusmoke

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/pkg/drivertools"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/nvml"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// Config is where the binaries and the driver are.
type Config struct {
	Runc, Probe string
	// DriverRoot is where the NVIDIA driver is installed ("/").
	DriverRoot string
	// Chart is the gpudra chart, for its ServiceAccounts and RBAC.
	Chart devcluster.ChartOptions
}

const (
	// NVMLNode is the node backed by the real GPUs.
	NVMLNode = "nvml-gpu"
	// simNode is the simulated node beside it.
	simNode   = "sim-h100"
	namespace = "gpu-smoke"
)

// Run runs the smoke test and writes what it saw to w; an error says what
// failed, in one line.
func Run(ctx context.Context, w io.Writer, cfg Config) error {
	if os.Geteuid() != 0 {
		return errors.New("run as root: real containers need root")
	}
	backend, err := nvml.New(ctx, nvml.Options{DriverRoot: cfg.DriverRoot})
	if err != nil {
		return fmt.Errorf("no NVIDIA GPU to test here: %w", err)
	}
	defer backend.Close()
	inv, err := backend.Inventory(ctx)
	if err != nil {
		return fmt.Errorf("NVML inventory: %w", err)
	}
	if len(inv.GPUs) == 0 {
		return errors.New("NVML lists no GPU")
	}
	if err := checkIdle(ctx, cfg.DriverRoot); err != nil {
		return err
	}
	if err := Compare(ctx, w, inv); err != nil {
		return err
	}

	for _, p := range []*string{&cfg.Runc, &cfg.Probe} {
		if *p, err = filepath.Abs(*p); err != nil {
			return err
		}
	}
	// The containers' image is the host's /usr (nvidia-smi needs a libc);
	// what GPUs it sees is still only what the CDI spec gives it.
	rt := &devcluster.OCIRuntime{Runc: cfg.Runc, Probe: cfg.Probe, HostImage: true}
	if err := rt.Usable(); err != nil {
		return err
	}
	cluster, err := devcluster.Start(ctx, devcluster.Options{Chart: cfg.Chart, Runtime: rt})
	if err != nil {
		return fmt.Errorf("start devcluster: %w", err)
	}
	defer cluster.Stop()
	if _, err := cluster.AddNode(ctx, devcluster.NodeOptions{Name: simNode, Machine: "dgx-h100-nomig"}); err != nil {
		return err
	}
	existing := slicebuilder.MigPolicy{Existing: true}
	node, err := cluster.AddNode(ctx, devcluster.NodeOptions{Name: NVMLNode, Backend: backend, DriverRoot: cfg.DriverRoot, MigDevices: &existing})
	if err != nil {
		return err
	}
	if err := node.WaitForSlices(ctx); err != nil {
		return fmt.Errorf("node %s publishes no ResourceSlice: %w", NVMLNode, err)
	}
	fmt.Fprintf(w, "\n== devcluster: node %s (NVML) beside %s (simulated)\n", NVMLNode, simNode)

	client := cluster.Client
	if _, err := client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}, metav1.CreateOptions{}); err != nil {
		return err
	}
	claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "one-gpu", Namespace: namespace},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
			Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.gpudra.dev"}}}}}}
	if _, err := client.ResourceV1().ResourceClaims(namespace).Create(ctx, claim, metav1.CreateOptions{}); err != nil {
		return err
	}
	for _, p := range []*v1.Pod{smokePod("with-gpu", "one-gpu"), smokePod("no-gpu", "")} {
		if _, err := client.CoreV1().Pods(namespace).Create(ctx, p, metav1.CreateOptions{}); err != nil {
			return err
		}
	}
	pods := map[string]*v1.Pod{}
	err = wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 3*time.Minute, true, func(ctx context.Context) (bool, error) {
		for _, name := range []string{"with-gpu", "no-gpu"} {
			p, err := client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
			if err != nil || p.Status.Phase != v1.PodRunning {
				return false, nil
			}
			pods[name] = p
		}
		return true, nil
	})
	if err != nil {
		return fmt.Errorf("the smoke pods are not Running after 3 minutes (kubectl describe pod -n %s): %w", namespace, err)
	}
	allocated, err := client.ResourceV1().ResourceClaims(namespace).Get(ctx, "one-gpu", metav1.GetOptions{})
	if err != nil {
		return err
	}
	want, err := claimedUUIDs(allocated, inv)
	if err != nil {
		return err
	}

	var failures []string
	for _, c := range []struct {
		pod  string
		want []string
	}{{"with-gpu", want}, {"no-gpu", nil}} {
		out, err := smiOutput(pods[c.pod])
		if err != nil {
			return err
		}
		got := ListedUUIDs(out)
		fmt.Fprintf(w, "\n-- pod %s: claimed %s; nvidia-smi -L inside:\n%s\n", c.pod, orNone(c.want), indent(out))
		if !slices.Equal(sorted(got), sorted(c.want)) {
			failures = append(failures, fmt.Sprintf("pod %s: nvidia-smi -L lists %s, want %s", c.pod, orNone(got), orNone(c.want)))
		}
	}
	if len(failures) > 0 {
		return errors.New(strings.Join(failures, "; "))
	}
	return nil
}

// smokePod runs the probe with nvidia-smi -L on the NVML node, with the
// claim when it is named.
func smokePod(name, claim string) *v1.Pod {
	cmd, _ := json.Marshal([]string{"nvidia-smi", "-L"})
	p := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace,
			Annotations: map[string]string{devcluster.ProbeCommandAnnotation: string(cmd)}},
		Spec: v1.PodSpec{
			NodeSelector: map[string]string{"kubernetes.io/hostname": NVMLNode},
			Containers:   []v1.Container{{Name: "smi", Image: "gpudra-probe"}},
		},
	}
	if claim != "" {
		p.Spec.ResourceClaims = []v1.PodResourceClaim{{Name: "gpu", ResourceClaimName: &claim}}
		p.Spec.Containers[0].Resources.Claims = []v1.ResourceClaim{{Name: "gpu"}}
	}
	return p
}

// smiOutput is what nvidia-smi printed in the pod's container.
func smiOutput(pod *v1.Pod) (string, error) {
	var views map[string]devcluster.ContainerView
	if err := json.Unmarshal([]byte(pod.Annotations[devcluster.ContainersAnnotation]), &views); err != nil {
		return "", fmt.Errorf("pod %s: annotation %s: %w", pod.Name, devcluster.ContainersAnnotation, err)
	}
	v := views["smi"]
	if v.Report == nil || v.Report.Command == nil {
		return "", fmt.Errorf("pod %s: no report from inside its container", pod.Name)
	}
	return v.Report.Command.Output, nil
}

// claimedUUIDs are the UUIDs of the devices allocated to the claim on the
// NVML node (whole GPUs are gpu-<minor>).
func claimedUUIDs(claim *resourceapi.ResourceClaim, inv *nvdevice.Inventory) ([]string, error) {
	if claim.Status.Allocation == nil {
		return nil, fmt.Errorf("claim %s is not allocated", claim.Name)
	}
	var out []string
	for _, r := range claim.Status.Allocation.Devices.Results {
		found := false
		for i := range inv.GPUs {
			if slicebuilder.GPUDeviceName(&inv.GPUs[i]) == r.Device {
				out = append(out, inv.GPUs[i].UUID)
				found = true
			}
		}
		if !found {
			return nil, fmt.Errorf("claim %s: device %s is no whole GPU of the NVML inventory", claim.Name, r.Device)
		}
	}
	return out, nil
}

var uuidInList = regexp.MustCompile(`\(UUID: ((?:GPU|MIG)-[0-9a-fA-F-]+)\)`)

// ListedUUIDs are the UUIDs in nvidia-smi -L output.
func ListedUUIDs(out string) []string {
	var ids []string
	for _, m := range uuidInList.FindAllStringSubmatch(out, -1) {
		ids = append(ids, m[1])
	}
	return ids
}

// checkIdle refuses GPUs that other processes use: the smoke test must
// disturb nothing.
func checkIdle(ctx context.Context, driverRoot string) error {
	cmd, err := drivertools.Runner{Root: driverRoot}.Command(ctx, "nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader")
	if err != nil {
		return fmt.Errorf("nvidia-smi: %w", err)
	}
	out, err := cmd.Output()
	if err != nil {
		return fmt.Errorf("nvidia-smi --query-compute-apps: %w", err)
	}
	if s := strings.TrimSpace(string(out)); s != "" {
		return fmt.Errorf("the GPUs are in use (pid, GPU: %s): gpu-smoke runs only where no other process uses them", strings.ReplaceAll(s, "\n", "; "))
	}
	return nil
}

func sorted(s []string) []string { s = slices.Clone(s); slices.Sort(s); return s }

func orNone(s []string) string {
	if len(s) == 0 {
		return "none"
	}
	return strings.Join(s, ",")
}

func indent(s string) string {
	s = strings.TrimRight(s, "\n")
	if s == "" {
		return "   (no output)"
	}
	return "   " + strings.ReplaceAll(s, "\n", "\n   ")
}
