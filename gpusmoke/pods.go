package gpusmoke

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/devcluster/noderuntime"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/probe/cudacheck"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// wholeGPU: a pod with a one-GPU claim sees exactly that GPU through
// nvidia-smi and CUDA, and allocates 1 GiB on it; a pod without a claim
// sees none.
func (s *session) wholeGPU(ctx context.Context) error {
	client := s.cluster.Client
	claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "one-gpu", Namespace: namespace},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
			Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.gpudra.dev"}}}}}}
	if _, err := client.ResourceV1().ResourceClaims(namespace).Create(ctx, claim, metav1.CreateOptions{}); err != nil {
		return err
	}
	const gib = int64(1) << 30
	pods := []*v1.Pod{smokePod("with-gpu", "one-gpu", gib), smokePod("no-gpu", "", gib)}
	running, err := s.runPods(ctx, pods)
	if err != nil {
		return err
	}
	want, err := s.claimedUUIDs(ctx, "one-gpu")
	if err != nil {
		return err
	}
	var failures []string
	for _, c := range []struct {
		pod  string
		want []string
	}{{"with-gpu", want}, {"no-gpu", nil}} {
		out, err := s.podOutput(running[c.pod])
		if err != nil {
			return err
		}
		failures = append(failures, s.checkSees(c.pod, out, c.want)...)
		if len(c.want) > 0 {
			if r := out.cuda; r != nil && (r.Alloc == nil || r.Alloc.Result != cudacheck.OK) {
				failures = append(failures, fmt.Sprintf("pod %s: CUDA could not allocate 1 GiB on its own GPU: %s", c.pod, allocResult(r)))
			}
		}
	}
	if len(failures) > 0 {
		return errors.New(strings.Join(failures, "; "))
	}
	// The GPU goes back before the MPS claim asks for it (a node may have
	// one GPU).
	return s.deleteAndWait(ctx, []string{"with-gpu", "no-gpu"}, []string{"one-gpu"})
}

// mps: two pods share one claim of the GPU under MPS with a pinned-memory
// limit. The MPS server pod runs the driver's nvidia-cuda-mps-control in
// a container of its own; both clients reach it, an allocation under the
// limit succeeds and one over it fails.
func (s *session) mps(ctx context.Context) error {
	limit, err := resource.ParseQuantity(s.cfg.MPSPinnedMemory)
	if err != nil {
		return fmt.Errorf("MPS pinned-memory limit %q: %w", s.cfg.MPSPinnedMemory, err)
	}
	config, err := json.Marshal(map[string]any{"apiVersion": "gpu.gpudra.dev/v1alpha1", "kind": "GpuConfig",
		"sharing": map[string]any{"strategy": "MPS", "mps": map[string]any{"pinnedMemoryLimit": limit.String()}}})
	if err != nil {
		return err
	}
	claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "mps-gpu", Namespace: namespace},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.gpudra.dev"}}},
			Config: []resourceapi.DeviceClaimConfiguration{{Requests: []string{"gpu"}, DeviceConfiguration: resourceapi.DeviceConfiguration{
				Opaque: &resourceapi.OpaqueDeviceConfiguration{Driver: "gpu.gpudra.dev", Parameters: runtime.RawExtension{Raw: config}}}}},
		}}}
	if _, err := s.cluster.Client.ResourceV1().ResourceClaims(namespace).Create(ctx, claim, metav1.CreateOptions{}); err != nil {
		return err
	}
	under, over := limit.Value()/2, limit.Value()*3/2
	running, err := s.runPods(ctx, []*v1.Pod{smokePod("mps-under", "mps-gpu", under), smokePod("mps-over", "mps-gpu", over)})
	if err != nil {
		return err
	}
	want, err := s.claimedUUIDs(ctx, "mps-gpu")
	if err != nil {
		return err
	}
	var failures []string
	for _, c := range []struct {
		pod   string
		bytes int64
		ok    bool
	}{{"mps-under", under, true}, {"mps-over", over, false}} {
		out, err := s.podOutput(running[c.pod])
		if err != nil {
			return err
		}
		failures = append(failures, s.checkSees(c.pod, out, want)...)
		r := out.cuda
		switch {
		case r == nil || r.Alloc == nil:
			failures = append(failures, fmt.Sprintf("pod %s: the CUDA check made no allocation", c.pod))
		case c.ok && r.Alloc.Result != cudacheck.OK:
			failures = append(failures, fmt.Sprintf("pod %s: %d bytes under the MPS limit %s were refused: %s", c.pod, c.bytes, limit.String(), r.Alloc.Result))
		case !c.ok && r.Alloc.Result == cudacheck.OK:
			failures = append(failures, fmt.Sprintf("pod %s: %d bytes over the MPS limit %s were allocated: MPS did not enforce the limit", c.pod, c.bytes, limit.String()))
		}
		fmt.Fprintf(s.w, "   %s: allocation of %s (limit %s): %s\n", c.pod, resource.NewQuantity(c.bytes, resource.BinarySI), limit.String(), allocResult(r))
	}
	clients, err := s.mpsServerLogs(ctx)
	if err != nil {
		failures = append(failures, err.Error())
	} else if s.gpu.backend != nil && clients < 2 {
		// The stand-in control daemon keeps no client log; the real one
		// logs each client it serves.
		failures = append(failures, fmt.Sprintf("the MPS server's log shows %d client(s), want both pods'", clients))
	}
	if len(failures) > 0 {
		return errors.New(strings.Join(failures, "; "))
	}
	return s.deleteAndWait(ctx, []string{"mps-under", "mps-over"}, []string{"mps-gpu"})
}

func allocResult(r *cudacheck.Result) string {
	if r == nil || r.Alloc == nil {
		return "none"
	}
	return r.Alloc.Result
}

// podView is what ran in a smoke pod: nvidia-smi -L's UUIDs and the CUDA
// check's report.
type podView struct {
	smi  []string
	cuda *cudacheck.Result
}

// checkSees compares what nvidia-smi and CUDA listed inside the pod with
// the claimed UUIDs.
func (s *session) checkSees(pod string, out podView, want []string) []string {
	var failures []string
	if !slices.Equal(sorted(out.smi), sorted(want)) {
		failures = append(failures, fmt.Sprintf("pod %s: nvidia-smi -L lists %s, want %s", pod, orNone(out.smi), orNone(want)))
	}
	if out.cuda == nil {
		return append(failures, fmt.Sprintf("pod %s: no report from the CUDA check", pod))
	}
	var got []string
	for _, d := range out.cuda.Devices {
		got = append(got, d.UUID)
	}
	if !slices.Equal(sorted(got), sorted(want)) {
		failures = append(failures, fmt.Sprintf("pod %s: CUDA sees %s, want %s (%s)", pod, orNone(got), orNone(want), out.cuda.Error))
	}
	return failures
}

// smokePod runs nvidia-smi -L and then the CUDA check (allocating bytes)
// on the GPU node, with the claim when it is named.
func smokePod(name, claim string, bytes int64) *v1.Pod {
	script := fmt.Sprintf("nvidia-smi -L; echo %s; %s --alloc %d", cudaMarker, noderuntime.CUDACheckPath, bytes)
	cmd, _ := json.Marshal([]string{"sh", "-c", script})
	p := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace,
			Annotations: map[string]string{nodeagent.ProbeCommandAnnotation: string(cmd)}},
		Spec: v1.PodSpec{
			NodeSelector: map[string]string{"kubernetes.io/hostname": GPUNode},
			Containers:   []v1.Container{{Name: "smi", Image: "gpudra-probe"}},
		},
	}
	if claim != "" {
		p.Spec.ResourceClaims = []v1.PodResourceClaim{{Name: "gpu", ResourceClaimName: &claim}}
		p.Spec.Containers[0].Resources.Claims = []v1.ResourceClaim{{Name: "gpu"}}
	}
	return p
}

// cudaMarker separates nvidia-smi's output from the CUDA check's.
const cudaMarker = "--- gpudra-cuda-check"

// runPods creates the pods and waits until each runs; it records each
// pod's report in the results.
func (s *session) runPods(ctx context.Context, pods []*v1.Pod) (map[string]*v1.Pod, error) {
	client := s.cluster.Client
	for _, p := range pods {
		if _, err := client.CoreV1().Pods(namespace).Create(ctx, p, metav1.CreateOptions{}); err != nil {
			return nil, err
		}
	}
	running := map[string]*v1.Pod{}
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, s.cfg.PodTimeout, true, func(ctx context.Context) (bool, error) {
		for _, want := range pods {
			p, err := client.CoreV1().Pods(namespace).Get(ctx, want.Name, metav1.GetOptions{})
			if err == nil && p.Status.Phase == v1.PodRunning {
				running[p.Name] = p
			}
		}
		return len(running) == len(pods), nil
	})
	if err != nil {
		var names []string
		for _, p := range pods {
			if running[p.Name] == nil {
				names = append(names, p.Name)
			}
		}
		return nil, fmt.Errorf("pods %s are not Running after %s (see the diagnostics above): %w", strings.Join(names, ", "), s.cfg.PodTimeout, err)
	}
	for _, p := range pods {
		if err := s.res.write("pods/"+p.Name+".json", running[p.Name].Annotations[nodeagent.ContainersAnnotation]+"\n"); err != nil {
			return nil, err
		}
	}
	return running, nil
}

// podOutput is what nvidia-smi and the CUDA check printed in the pod's
// container.
func (s *session) podOutput(pod *v1.Pod) (podView, error) {
	var views map[string]noderuntime.ContainerView
	if err := json.Unmarshal([]byte(pod.Annotations[nodeagent.ContainersAnnotation]), &views); err != nil {
		return podView{}, fmt.Errorf("pod %s: annotation %s: %w", pod.Name, nodeagent.ContainersAnnotation, err)
	}
	v := views["smi"]
	if v.Report == nil || v.Report.Command == nil {
		return podView{}, fmt.Errorf("pod %s: no report from inside its container", pod.Name)
	}
	out := v.Report.Command.Output
	smi, cudaOut, _ := strings.Cut(out, cudaMarker)
	fmt.Fprintf(s.w, "\n-- pod %s, inside its container:\n%s\n", pod.Name, indent(out))
	view := podView{smi: ListedUUIDs(smi)}
	if r, err := cudacheck.ParseOutput(cudaOut); err == nil {
		view.cuda = r
	}
	return view, nil
}

// claimedUUIDs are the UUIDs of the devices allocated to the claim on the
// GPU node (whole GPUs are gpu-<minor>).
func (s *session) claimedUUIDs(ctx context.Context, name string) ([]string, error) {
	claim, err := s.cluster.Client.ResourceV1().ResourceClaims(namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	return claimedWholeGPUs(claim, s.inv)
}

// claimedWholeGPUs are the UUIDs of the whole GPUs of the inventory allocated
// to the claim.
func claimedWholeGPUs(claim *resourceapi.ResourceClaim, inv *nvdevice.Inventory) ([]string, error) {
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
			return nil, fmt.Errorf("claim %s: device %s is no whole GPU of the node's inventory", claim.Name, r.Device)
		}
	}
	return out, nil
}

// deleteAndWait deletes the pods, then the claims, and waits until all
// are gone (the claims unprepared and deallocated).
func (s *session) deleteAndWait(ctx context.Context, pods, claims []string) error {
	client := s.cluster.Client
	for _, p := range pods {
		if err := client.CoreV1().Pods(namespace).Delete(ctx, p, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return err
		}
	}
	gone := func(get func(ctx context.Context, name string) error, names []string) error {
		return wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, s.cfg.PodTimeout, true, func(ctx context.Context) (bool, error) {
			for _, n := range names {
				if err := get(ctx, n); !apierrors.IsNotFound(err) {
					return false, nil
				}
			}
			return true, nil
		})
	}
	getPod := func(ctx context.Context, n string) error {
		_, err := client.CoreV1().Pods(namespace).Get(ctx, n, metav1.GetOptions{})
		return err
	}
	if err := gone(getPod, pods); err != nil {
		return fmt.Errorf("pods %v are not gone after %s: %w", pods, s.cfg.PodTimeout, err)
	}
	for _, c := range claims {
		if err := client.ResourceV1().ResourceClaims(namespace).Delete(ctx, c, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return err
		}
	}
	getClaim := func(ctx context.Context, n string) error {
		_, err := client.ResourceV1().ResourceClaims(namespace).Get(ctx, n, metav1.GetOptions{})
		return err
	}
	if err := gone(getClaim, claims); err != nil {
		return fmt.Errorf("claims %v are not gone after %s: %w", claims, s.cfg.PodTimeout, err)
	}
	return nil
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
