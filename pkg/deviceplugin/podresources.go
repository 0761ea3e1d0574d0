package deviceplugin

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/klog/v2"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
)

// Which containers of the node hold devices through a device plugin (gpudra's
// or NVIDIA's) is the kubelet's to say, and it says so on the node itself: its
// pod-resources API (k8s.io/kubelet/pkg/apis/podresources/v1, GA since
// Kubernetes 1.28; NVIDIA's dcgm-exporter and GPU operator read it too) lists
// the devices of the node's active pods. No API server and no RBAC are
// involved, and a deleted pod is not listed, whatever the kubelet's
// checkpoint still records of it.

// DefaultPodResourcesSocket is where the kubelet serves its pod-resources
// API.
const DefaultPodResourcesSocket = "/var/lib/kubelet/pod-resources/kubelet.sock"

const (
	// podResourcesTimeout bounds one List: the kubelet answers from memory.
	podResourcesTimeout = 10 * time.Second
	// podResourcesMaxMessage is the largest answer read, as NVIDIA's
	// tools allow (the gRPC default of 4 MiB is near a full node's).
	podResourcesMaxMessage = 16 << 20
)

// ListPodResources asks the kubelet's pod-resources API at socket which
// containers of the node's pods hold device plugin devices of
// resourceNames (patterns: a name ending in "*" is a prefix, "*" alone
// any resource). One allocation per container and resource, device IDs
// sorted; Pod is namespace/name.
func ListPodResources(ctx context.Context, socket string, resourceNames []string) ([]DevicePluginAllocation, error) {
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(podResourcesMaxMessage)))
	if err != nil {
		return nil, fmt.Errorf("the kubelet's pod-resources API at %s: %w", socket, err)
	}
	defer func() { _ = conn.Close() }()
	ctx, cancel := context.WithTimeout(ctx, podResourcesTimeout)
	defer cancel()
	resp, err := podresourcesv1.NewPodResourcesListerClient(conn).List(ctx, &podresourcesv1.ListPodResourcesRequest{})
	if err != nil {
		return nil, fmt.Errorf("ask the kubelet's pod-resources API at %s which pods hold devices: %w", socket, err)
	}
	var out []DevicePluginAllocation
	for _, p := range resp.GetPodResources() {
		for _, c := range p.GetContainers() {
			// The kubelet answers one entry per device (and NUMA node).
			byResource := map[string][]string{}
			for _, d := range c.GetDevices() {
				if matchesResource(d.GetResourceName(), resourceNames) {
					byResource[d.GetResourceName()] = append(byResource[d.GetResourceName()], d.GetDeviceIds()...)
				}
			}
			for _, name := range slices.Sorted(maps.Keys(byResource)) {
				ids := byResource[name]
				slices.Sort(ids)
				out = append(out, DevicePluginAllocation{Pod: p.GetNamespace() + "/" + p.GetName(), ContainerName: c.GetName(),
					ResourceName: name, DeviceIDs: slices.Compact(ids)})
			}
		}
	}
	return out, nil
}

// DeviceHolders says which containers of this node hold devices through a
// device plugin: the kubelet's pod-resources API, or, only where its socket
// does not exist, the kubelet's device manager checkpoint. The checkpoint
// is the fallback for a node where the socket's directory is not mounted
// (or a kubelet that serves no pod-resources API): it names pods by UID
// only and keeps a deleted pod's entry until the kubelet's next device
// plugin allocation, so it can only err towards "still held".
type DeviceHolders struct {
	// PodResourcesSocket is the kubelet's pod-resources socket
	// (DefaultPodResourcesSocket).
	PodResourcesSocket string
	// KubeletCheckpoint is the kubelet's device manager checkpoint
	// (DefaultKubeletCheckpoint), read only when the socket does not
	// exist; a missing checkpoint lists none.
	KubeletCheckpoint string
}

// Known is whether h can tell anything: a socket or a checkpoint is set.
func (h DeviceHolders) Known() bool { return h.PodResourcesSocket != "" || h.KubeletCheckpoint != "" }

// List is the containers holding devices of resourceNames (see
// ListPodResources), from the pod-resources API, or from the checkpoint
// when the socket does not exist (logged).
func (h DeviceHolders) List(ctx context.Context, resourceNames []string) ([]DevicePluginAllocation, error) {
	allocs, _, err := h.list(ctx, resourceNames)
	return allocs, err
}

// list is List, and whether it read the checkpoint instead of the API.
func (h DeviceHolders) list(ctx context.Context, resourceNames []string) (allocs []DevicePluginAllocation, fromCheckpoint bool, err error) {
	if h.PodResourcesSocket != "" {
		_, err := os.Stat(h.PodResourcesSocket)
		if err == nil {
			allocs, err := ListPodResources(ctx, h.PodResourcesSocket, resourceNames)
			return allocs, false, err
		}
		if !errors.Is(err, os.ErrNotExist) {
			return nil, false, fmt.Errorf("the kubelet's pod-resources socket: %w", err)
		}
	}
	if h.KubeletCheckpoint == "" {
		return nil, false, fmt.Errorf("the kubelet's pod-resources socket %q does not exist and no device manager checkpoint is set: cannot tell which pods hold devices", h.PodResourcesSocket)
	}
	klog.FromContext(ctx).Info("The kubelet's pod-resources socket does not exist: reading its device manager checkpoint instead, where a deleted pod's devices count until the kubelet's next device plugin allocation",
		"podResourcesSocket", h.PodResourcesSocket, "checkpoint", h.KubeletCheckpoint)
	allocs, err = DevicePluginAllocations(h.KubeletCheckpoint, resourceNames)
	return allocs, true, err
}
