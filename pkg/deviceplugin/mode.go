package deviceplugin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/plugin/checkpoint"
	"github.com/gpudra/gpudra/pkg/prepared"
)

// A node runs gpudra in one mode, DRA or device plugin: the two must never
// hand out the same GPU. The checks below run before a mode starts and
// refuse it while the other mode still has devices handed out on the node.

// DefaultKubeletCheckpoint is the kubelet device manager's checkpoint: the
// devices it allocated to containers through device plugins.
const DefaultKubeletCheckpoint = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"

// DRACheckpointFile is the DRA plugin's checkpoint under its plugin data
// directory (pkg/plugin writes it there).
const DRACheckpointFile = "checkpoint.json"

// DrainAdvice is what to do before the device plugin mode may start.
const DrainAdvice = "drain the node's pods that use gpu.gpudra.dev claims (kubectl drain / delete them) so that the kubelet unprepares them, then start the device plugin mode"

// listed is how many claims or pods an error names before "and N more".
const listed = 10

// CheckDRADrained refuses the device plugin mode while the DRA plugin's
// checkpoint under pluginDataDir holds prepared claims (completed or half
// done: either may have a GPU in use). The checkpoint is only read, with
// the DRA side's own decoder: a missing one means drained, a corrupt one
// is an error naming the file (the DRA plugin would move it aside and
// rebuild its state from the node and the API; this check cannot).
// Claims recorded before a reboot count too: their pods are still bound to
// the node and the kubelet prepares them again.
func CheckDRADrained(pluginDataDir string) error {
	path := filepath.Join(pluginDataDir, DRACheckpointFile)
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("device plugin mode: read the DRA checkpoint %s: %w", path, err)
	}
	cp, err := checkpoint.Unmarshal(b)
	if err != nil {
		return fmt.Errorf("device plugin mode: the DRA checkpoint %s cannot be read (%w): start the node agent in DRA mode once so that it rebuilds its state, then %s", path, err, DrainAdvice)
	}
	if len(cp.Claims) == 0 {
		return nil
	}
	names := make([]string, 0, len(cp.Claims))
	for uid := range cp.Claims {
		c, _ := cp.Claim(uid)
		name := c.Ref() + " (" + uid + ")"
		if c.Namespace == "" && c.Name == "" {
			name = uid
		}
		if c.State != prepared.PrepareCompleted {
			name += " " + string(c.State)
		}
		names = append(names, name)
	}
	slices.Sort(names)
	return fmt.Errorf("device plugin mode refused: the DRA checkpoint %s holds %d prepared claim(s): %s; %s",
		path, len(names), enumerate(names), DrainAdvice)
}

// DevicePluginAllocation is one container's devices in the kubelet's
// device manager checkpoint.
type DevicePluginAllocation struct {
	PodUID, ContainerName, ResourceName string
	// DeviceIDs are the device IDs the container holds ("<uuid>",
	// "<uuid>::<n>").
	DeviceIDs []string
}

// kubeletCheckpoint is what is read of the kubelet's device manager
// checkpoint (k8s.io/kubernetes pkg/kubelet/cm/devicemanager/checkpoint):
// {"Data":{"PodDeviceEntries":[{"PodUID","ContainerName","ResourceName",
// "DeviceIDs","AllocResp"}],"RegisteredDevices":{...}},"Checksum":N}.
// DeviceIDs comes in either of its shapes (a list before 1.20, a map by
// NUMA node since); other fields are ignored, and the checksum is not
// verified (it hashes Go's in-memory form, which only the kubelet can
// reproduce).
type kubeletCheckpoint struct {
	Data struct {
		PodDeviceEntries []struct {
			PodUID        string
			ContainerName string
			ResourceName  string
			DeviceIDs     json.RawMessage
		}
	}
}

// checkpointDeviceIDs reads an entry's DeviceIDs in either shape, sorted;
// anything else reads as none.
func checkpointDeviceIDs(raw json.RawMessage) []string {
	var ids []string
	if err := json.Unmarshal(raw, &ids); err != nil {
		var byNUMA map[string][]string
		if json.Unmarshal(raw, &byNUMA) != nil {
			return nil
		}
		for _, l := range byNUMA {
			ids = append(ids, l...)
		}
	}
	slices.Sort(ids)
	return slices.Compact(ids)
}

// DevicePluginAllocations lists the containers of the kubelet's device
// manager checkpoint that hold one of resourceNames. A name ending in "*"
// is a prefix ("nvidia.com/mig-*"). A missing checkpoint lists none; one
// that is not JSON is an error naming the file.
func DevicePluginAllocations(kubeletCheckpointPath string, resourceNames []string) ([]DevicePluginAllocation, error) {
	b, err := os.ReadFile(kubeletCheckpointPath)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read the kubelet's device manager checkpoint %s: %w", kubeletCheckpointPath, err)
	}
	var cp kubeletCheckpoint
	if err := json.Unmarshal(b, &cp); err != nil {
		return nil, fmt.Errorf("the kubelet's device manager checkpoint %s cannot be read: %w", kubeletCheckpointPath, err)
	}
	var out []DevicePluginAllocation
	for _, e := range cp.Data.PodDeviceEntries {
		if matchesResource(e.ResourceName, resourceNames) {
			out = append(out, DevicePluginAllocation{PodUID: e.PodUID, ContainerName: e.ContainerName, ResourceName: e.ResourceName,
				DeviceIDs: checkpointDeviceIDs(e.DeviceIDs)})
		}
	}
	return out, nil
}

func matchesResource(name string, patterns []string) bool {
	for _, p := range patterns {
		if prefix, ok := strings.CutSuffix(p, "*"); ok {
			if strings.HasPrefix(name, prefix) {
				return true
			}
		} else if name == p {
			return true
		}
	}
	return false
}

// CheckDevicePluginDrained refuses the DRA mode while the kubelet's device
// manager checkpoint records containers holding one of resourceNames (see
// DevicePluginAllocations for the names). A missing checkpoint means
// drained.
func CheckDevicePluginDrained(kubeletCheckpointPath string, resourceNames []string) error {
	return CheckDevicePluginDrainedExcept(kubeletCheckpointPath, resourceNames, nil)
}

// CheckDevicePluginDrainedExcept is CheckDevicePluginDrained that leaves
// out the pods gone is true for: the kubelet keeps the entries of deleted
// pods in its checkpoint until its next device plugin allocation, which
// never comes once the device plugin is gone. nil: every pod counts.
func CheckDevicePluginDrainedExcept(kubeletCheckpointPath string, resourceNames []string, gone func(podUID string) bool) error {
	allocs, err := DevicePluginAllocations(kubeletCheckpointPath, resourceNames)
	if err != nil {
		return fmt.Errorf("DRA mode: %w", err)
	}
	pods := map[string][]string{}
	for _, a := range allocs {
		if gone != nil && gone(a.PodUID) {
			continue
		}
		if !slices.Contains(pods[a.PodUID], a.ResourceName) {
			pods[a.PodUID] = append(pods[a.PodUID], a.ResourceName)
		}
	}
	if len(pods) == 0 {
		return nil
	}
	names := make([]string, 0, len(pods))
	for uid, res := range pods {
		slices.Sort(res)
		names = append(names, "pod "+uid+" ("+strings.Join(res, ", ")+")")
	}
	slices.Sort(names)
	return fmt.Errorf("DRA mode refused: the kubelet's device manager checkpoint %s records %d pod(s) holding GPUs through a device plugin: %s; "+
		"drain them (kubectl drain / delete the pods that request %s) before switching the node to DRA mode",
		kubeletCheckpointPath, len(names), enumerate(names), strings.Join(resourceNames, ", "))
}

// enumerate joins up to listed names, then "and N more".
func enumerate(names []string) string {
	if len(names) <= listed {
		return strings.Join(names, ", ")
	}
	return strings.Join(names[:listed], ", ") + fmt.Sprintf(" and %d more", len(names)-listed)
}

// OurResourceNames are the resource names the device plugin mode
// advertises or that hold this node's GPUs through any device plugin
// (NVIDIA's included), as patterns for CheckDevicePluginDrained: the GPU
// resource name (default nvidia.com/gpu), every MIG resource
// (nvidia.com/mig-*), and the names a config's sharing renames replicas to.
func OurResourceNames(gpuResourceName string, cfg *Config) []string {
	if gpuResourceName == "" {
		gpuResourceName = DefaultGPUResourceName
	}
	names := []string{gpuResourceName, DefaultResourceDomain + "/mig-*"}
	if cfg != nil {
		for _, r := range []*ReplicatedResources{cfg.Sharing.TimeSlicing, cfg.Sharing.MPS} {
			if r == nil {
				continue
			}
			for _, res := range r.Resources {
				names = append(names, cfg.advertisedName(QualifyResourceName(res.Name), res.Rename, r.RenameByDefault))
			}
		}
	}
	slices.Sort(names)
	return slices.Compact(names)
}

// CheckNodeDevicePluginDrained is CheckDevicePluginDrained for the node
// nodeName that leaves out the pods the API no longer has running there:
// the kubelet keeps the entries of deleted pods in its checkpoint until its
// next device plugin allocation, which never comes once the device plugin
// is gone. When the pods cannot be listed (no client, or no RBAC to list
// pods), every entry counts.
func CheckNodeDevicePluginDrained(ctx context.Context, client kubernetes.Interface, nodeName, kubeletCheckpointPath string, resourceNames []string) error {
	err := CheckDevicePluginDrained(kubeletCheckpointPath, resourceNames)
	if err == nil || client == nil {
		return err
	}
	pods, listErr := client.CoreV1().Pods(metav1.NamespaceAll).List(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("spec.nodeName", nodeName).String()})
	if listErr != nil {
		klog.FromContext(ctx).Info("Cannot list this node's pods: every pod in the kubelet's device checkpoint counts", "err", listErr.Error())
		return err
	}
	running := map[string]bool{}
	for _, p := range pods.Items {
		if p.Status.Phase != corev1.PodSucceeded && p.Status.Phase != corev1.PodFailed {
			running[string(p.UID)] = true
		}
	}
	return CheckDevicePluginDrainedExcept(kubeletCheckpointPath, resourceNames, func(uid string) bool { return !running[uid] })
}
