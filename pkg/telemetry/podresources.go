package telemetry

import (
	"context"
	"fmt"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// Which container holds which device is the kubelet's to say, in both
// modes, on the node itself: its pod-resources API lists, per container of
// every active pod, the device plugin devices it was given (resource name
// and device IDs) and its DRA claims' devices (driver, pool, device). A
// deleted pod is not listed; nothing here asks the API server.

const (
	// podResourcesListTimeout bounds one List: the kubelet answers from
	// memory, and a sampling pass must not wait longer than its interval.
	podResourcesListTimeout = 5 * time.Second
	// podResourcesMaxMessage is the largest answer read (as
	// pkg/deviceplugin and NVIDIA's tools allow).
	podResourcesMaxMessage = 16 << 20
	// replicaSeparator separates a shared device's UUID from its replica
	// number in a device plugin device ID ("<uuid>::<n>";
	// deviceplugin.ReplicaSeparator, which this package cannot import).
	replicaSeparator = "::"
)

// containerKey is one container of one pod.
type containerKey struct{ Namespace, Pod, Container string }

// podHold is one device that the pod-resources API lists for a container:
// a device plugin device (UUID) or a DRA device of gpudra's driver in this
// node's pool (Device, with its Claim).
type podHold struct {
	containerKey
	// UUID is the GPU's or MIG device's UUID of a device plugin device ID,
	// the replica number cut off.
	UUID string
	// Device is the DRA device's name ("gpu-3"); Claim and ClaimNamespace
	// name its ResourceClaim.
	Device, Claim, ClaimNamespace string
}

// listPodResources asks the kubelet's pod-resources API at socket for every
// container's devices.
func listPodResources(ctx context.Context, socket string) (*podresourcesv1.ListPodResourcesResponse, error) {
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(podResourcesMaxMessage)))
	if err != nil {
		return nil, fmt.Errorf("the kubelet's pod-resources API at %s: %w", socket, err)
	}
	defer func() { _ = conn.Close() }()
	ctx, cancel := context.WithTimeout(ctx, podResourcesListTimeout)
	defer cancel()
	resp, err := podresourcesv1.NewPodResourcesListerClient(conn).List(ctx, &podresourcesv1.ListPodResourcesRequest{})
	if err != nil {
		return nil, fmt.Errorf("ask the kubelet's pod-resources API at %s which containers hold devices: %w", socket, err)
	}
	return resp, nil
}

// podHoldsOf is what resp lists: every device plugin device, whatever its
// resource (a device ID that is not one of the node's GPU or MIG UUIDs
// matches no sample and is passed over later), and every DRA device of
// gpudra's driver in pool (the node's: gpudra publishes one pool per node,
// named after it).
func podHoldsOf(resp *podresourcesv1.ListPodResourcesResponse, pool string) []podHold {
	var out []podHold
	for _, p := range resp.GetPodResources() {
		for _, c := range p.GetContainers() {
			k := containerKey{Namespace: p.GetNamespace(), Pod: p.GetName(), Container: c.GetName()}
			for _, d := range c.GetDevices() {
				for _, id := range d.GetDeviceIds() {
					uuid, _, _ := strings.Cut(id, replicaSeparator)
					out = append(out, podHold{containerKey: k, UUID: uuid})
				}
			}
			for _, dr := range c.GetDynamicResources() {
				for _, r := range dr.GetClaimResources() {
					if r.GetDriverName() != slicebuilder.DriverName || r.GetPoolName() != pool {
						continue
					}
					out = append(out, podHold{containerKey: k, Device: r.GetDeviceName(), Claim: dr.GetClaimName(), ClaimNamespace: dr.GetClaimNamespace()})
				}
			}
		}
	}
	return out
}
