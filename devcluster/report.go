package devcluster

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/resourceclaim"

	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/devcluster/noderuntime"
	"github.com/gpudra/gpudra/pkg/probe"
)

// PodReport is what the demo prints for a pod.
type PodReport struct {
	Namespace, Name, Node string
	Phase                 v1.PodPhase
	// Reason says why a pod is not running (the scheduler's or the
	// kubelet's words).
	Reason string
	Claims []ClaimReport
	// Runtime says what started the pod's containers: the kubelet binary
	// and containerd (a real node), or devcluster's kubelet and runc.
	Runtime string
	// Containers is what each container would see, from the kubelet; the
	// GPUs it sees are named from its device nodes (noderuntime.ContainerView.GPUs).
	Containers map[string]noderuntime.ContainerView
}

// ClaimReport is one of a pod's claims and what was allocated.
type ClaimReport struct {
	Name    string
	Devices []string // request: device
	// Sharing is what the plugin reported in the claim's device status
	// (strategy and limits); empty for exclusive claims.
	Sharing string
}

// ReportPods describes the pods of a namespace (all namespaces when empty).
func ReportPods(ctx context.Context, client kubernetes.Interface, namespace string) ([]PodReport, error) {
	pods, err := client.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	nodes, err := client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	infos := map[string]v1.NodeSystemInfo{}
	for _, n := range nodes.Items {
		infos[n.Name] = n.Status.NodeInfo
	}
	var out []PodReport
	for i := range pods.Items {
		pod := &pods.Items[i]
		r := PodReport{Namespace: pod.Namespace, Name: pod.Name, Node: pod.Spec.NodeName, Phase: pod.Status.Phase,
			Runtime: runtimeOf(pod, infos[pod.Spec.NodeName])}
		for _, cond := range pod.Status.Conditions {
			if cond.Type == v1.PodScheduled && cond.Status == v1.ConditionFalse {
				r.Reason = cond.Message
			}
		}
		if data := pod.Annotations[nodeagent.ContainersAnnotation]; data != "" {
			if err := json.Unmarshal([]byte(data), &r.Containers); err != nil {
				return nil, fmt.Errorf("pod %s/%s: annotation %s: %w", pod.Namespace, pod.Name, nodeagent.ContainersAnnotation, err)
			}
		}
		for j := range pod.Spec.ResourceClaims {
			name, _, err := resourceclaim.Name(pod, &pod.Spec.ResourceClaims[j])
			if err != nil || name == nil {
				continue
			}
			cr := ClaimReport{Name: *name}
			claim, err := client.ResourceV1().ResourceClaims(pod.Namespace).Get(ctx, *name, metav1.GetOptions{})
			if err == nil && claim.Status.Allocation != nil {
				cr.Devices = allocatedDevices(claim)
				cr.Sharing = sharingSummary(claim)
			}
			r.Claims = append(r.Claims, cr)
		}
		out = append(out, r)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Namespace != out[j].Namespace {
			return out[i].Namespace < out[j].Namespace
		}
		return out[i].Name < out[j].Name
	})
	return out, nil
}

// runtimeOf names what started the pod's containers, from their IDs'
// scheme and the node's versions: "kubelet v1.37.1 + containerd 2.4.2" on
// a real node, "devcluster + runc" where devcluster's kubelet ran them in
// runc, "devcluster (spec only)" where it only resolved their specs.
func runtimeOf(pod *v1.Pod, node v1.NodeSystemInfo) string {
	for _, cs := range pod.Status.ContainerStatuses {
		scheme, _, ok := strings.Cut(cs.ContainerID, "://")
		if !ok {
			continue
		}
		switch scheme {
		case "containerd":
			return "kubelet " + node.KubeletVersion + " + containerd " + strings.TrimPrefix(node.ContainerRuntimeVersion, "containerd://")
		case "runc":
			return "devcluster + runc"
		case "devcluster":
			return "devcluster (spec only)"
		default:
			return scheme
		}
	}
	return "-"
}

// sharingSummary condenses the plugin's device status: "MPS mem=40Gi sm=50%".
func sharingSummary(claim *resourceapi.ResourceClaim) string {
	for _, d := range claim.Status.Devices {
		if d.Data == nil {
			continue
		}
		var st struct {
			Strategy               string            `json:"strategy"`
			PinnedMemoryLimit      string            `json:"pinnedMemoryLimit"`
			ActiveThreadPercentage int               `json:"activeThreadPercentage"`
			Enforced               map[string]string `json:"enforced"`
		}
		if json.Unmarshal(d.Data.Raw, &st) != nil || st.Strategy == "" {
			continue
		}
		out := st.Strategy
		if st.PinnedMemoryLimit != "" {
			out += " mem<=" + st.PinnedMemoryLimit
		}
		if st.ActiveThreadPercentage > 0 {
			out += fmt.Sprintf(" sm<=%d%%", st.ActiveThreadPercentage)
		}
		if _, ok := st.Enforced["ipc"]; ok {
			out += " +ipc"
		}
		return out
	}
	return ""
}

func allocatedDevices(claim *resourceapi.ResourceClaim) []string {
	var devs []string
	for _, r := range claim.Status.Allocation.Devices.Results {
		devs = append(devs, r.Request+"="+r.Device)
	}
	return devs
}

// PrintReport writes the demo's table: for each pod its node, claims,
// allocated devices and the GPU and MIG UUIDs its containers would see, as
// their device nodes give them (not an environment variable).
func PrintReport(w io.Writer, reports []PodReport) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAMESPACE\tPOD\tPHASE\tNODE\tRUNTIME\tCLAIM\tALLOCATED (request=device)\tSHARING\tCONTAINER: GPUs it sees\tFROM INSIDE: GPU device nodes")
	for _, r := range reports {
		claims, devices, sharing := []string{}, []string{}, []string{}
		for _, c := range r.Claims {
			claims = append(claims, c.Name)
			devices = append(devices, strings.Join(c.Devices, ","))
			if c.Sharing != "" {
				sharing = append(sharing, c.Sharing)
			}
		}
		var seen, inside []string
		names := make([]string, 0, len(r.Containers))
		for n := range r.Containers {
			names = append(names, n)
		}
		sort.Strings(names)
		for _, n := range names {
			seen = append(seen, n+": "+orNone(strings.Join(r.Containers[n].VisibleGPUs(), ",")))
			if rep := r.Containers[n].Report; rep != nil {
				inside = append(inside, n+": "+insideGPUNodes(rep))
			}
		}
		node := r.Node
		if node == "" {
			node = "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.Namespace, r.Name, r.Phase, node, r.Runtime,
			orNone(strings.Join(claims, " ")), orNone(strings.Join(devices, " ")), orNone(strings.Join(sharing, " ")), orNone(strings.Join(seen, "; ")),
			orNone(strings.Join(inside, "; ")))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, r := range reports {
		if r.Reason != "" && r.Phase != v1.PodRunning {
			fmt.Fprintf(w, "%s/%s is %s: %s\n", r.Namespace, r.Name, r.Phase, r.Reason)
		}
	}
	return nil
}

func orNone(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// insideGPUNodes is what a container's probe found of GPUs from inside: the
// GPU and MIG capability nodes (the control nodes are left out), each with
// its major:minor, and whether the device cgroup let it open them.
func insideGPUNodes(r *probe.Report) string {
	var nodes []string
	denied := 0
	for _, d := range r.Devices {
		name := strings.TrimPrefix(d.Path, "/dev/")
		if d.OpenError == "EPERM" {
			denied++
		}
		if strings.HasPrefix(name, "nvidia-caps/") || strings.TrimLeft(strings.TrimPrefix(name, "nvidia"), "0123456789") == "" {
			nodes = append(nodes, fmt.Sprintf("%s(%d:%d)", name, d.Major, d.Minor))
		}
	}
	out := orNone(strings.Join(nodes, ","))
	if denied > 0 {
		out += fmt.Sprintf(" [%d denied]", denied)
	}
	return fmt.Sprintf("%s pid=%d", out, r.PID)
}
