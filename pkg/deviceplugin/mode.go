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

	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/plugin/checkpoint"
	"github.com/gpudra/gpudra/pkg/prepared"
)

// A node runs gpudra in one mode, DRA or device plugin: the two must never
// hand out the same GPU. The checks below run before a mode starts and
// refuse it while the other mode still has devices handed out on the node.

// DefaultKubeletCheckpoint is the kubelet device manager's checkpoint: the
// devices it allocated to containers through device plugins. Read only
// where the kubelet's pod-resources socket does not exist (DeviceHolders).
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

// DevicePluginAllocation is one container's devices of one resource, as
// the kubelet's pod-resources API or its device manager checkpoint has
// them.
type DevicePluginAllocation struct {
	// Pod is the pod's namespace/name (the pod-resources API), or "UID
	// <uid>" (the checkpoint, which has no names).
	Pod                         string
	ContainerName, ResourceName string
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
			out = append(out, DevicePluginAllocation{Pod: "UID " + e.PodUID, ContainerName: e.ContainerName, ResourceName: e.ResourceName,
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

// CheckDevicePluginDrained refuses the DRA mode while containers of this
// node hold one of resourceNames (see OurResourceNames) through a device
// plugin, gpudra's or NVIDIA's. The kubelet's pod-resources API says which
// (deleted pods are not listed); only where its socket does not exist, the
// kubelet's device manager checkpoint, where a deleted pod's entry counts
// until the kubelet's next device plugin allocation (the error says so). A
// socket that exists but does not answer is an error: nothing is known.
func CheckDevicePluginDrained(ctx context.Context, h DeviceHolders, resourceNames []string) error {
	allocs, fromCheckpoint, err := h.list(ctx, resourceNames)
	if err != nil {
		return fmt.Errorf("DRA mode: %w", err)
	}
	pods := map[string][]string{}
	for _, a := range allocs {
		if !slices.Contains(pods[a.Pod], a.ResourceName) {
			pods[a.Pod] = append(pods[a.Pod], a.ResourceName)
		}
	}
	if len(pods) == 0 {
		return nil
	}
	names := make([]string, 0, len(pods))
	for pod, res := range pods {
		slices.Sort(res)
		names = append(names, "pod "+pod+" ("+strings.Join(res, ", ")+")")
	}
	slices.Sort(names)
	advice := fmt.Sprintf("drain them (kubectl drain / delete the pods that request %s) before switching the node to DRA mode", strings.Join(resourceNames, ", "))
	if !fromCheckpoint {
		return fmt.Errorf("DRA mode refused: the kubelet's pod-resources API (%s) lists %d pod(s) holding GPUs through a device plugin: %s; %s",
			h.PodResourcesSocket, len(names), enumerate(names), advice)
	}
	return fmt.Errorf("DRA mode refused: the kubelet's device manager checkpoint %s records %d pod(s) holding GPUs through a device plugin: %s; %s "+
		"(the kubelet's pod-resources socket %q does not exist, so its checkpoint was read instead: it keeps a deleted pod's entry until the kubelet's next device plugin allocation)",
		h.KubeletCheckpoint, len(names), enumerate(names), advice, h.PodResourcesSocket)
}

// RemoveCDISpecs removes the device plugin mode's CDI specs from cdiDir:
// the node-wide one and every MPS GPU's. DRA mode calls it once
// CheckDevicePluginDrained has passed (no container holds a device plugin
// device, and running containers need no spec): left there, DRA mode's
// rebuild of a missing checkpoint would take them for claims prepared for
// unknown pods, which the kubelet never unprepares, and the device plugin
// mode would be refused on that node for ever.
func RemoveCDISpecs(ctx context.Context, cdiDir string) error {
	w, err := cdi.NewWriter(cdiDir)
	if err != nil {
		return err
	}
	uids, err := w.ClaimUIDs()
	if err != nil {
		return err
	}
	var removed []string
	var errs []error
	for _, uid := range uids {
		if uid == SpecUID || strings.HasPrefix(uid, mpsSpecPrefix) {
			if err := w.Remove(uid); err != nil {
				errs = append(errs, err)
				continue
			}
			removed = append(removed, uid)
		}
	}
	if len(removed) > 0 {
		klog.FromContext(ctx).Info("Removed the device plugin mode's CDI specs", "dir", cdiDir, "specs", removed)
	}
	return errors.Join(errs...)
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
