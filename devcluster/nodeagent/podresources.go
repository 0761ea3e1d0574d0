package nodeagent

// The kubelet's pod-resources API (k8s.io/kubelet/pkg/apis/podresources/v1)
// on each node: the kubelet's own server (NewV1PodResourcesServer, with its
// rate limit) on a real unix socket, fed as the kubelet feeds it: the pods
// of the node, the devices the node's real device manager allocated, the
// claims its real DRA manager prepared. No CPU or memory manager runs here:
// those report nothing, as the kubelet's do under the none policies. The
// node agent asks it which pods hold GPUs through a device plugin (the mode
// switch, MPS servers still in use), as on a real node.

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"

	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/klog/v2"
	podresourcesapi "k8s.io/kubelet/pkg/apis/podresources/v1"
	kubeletgrpc "k8s.io/kubernetes/pkg/kubelet/apis/grpc"
	"k8s.io/kubernetes/pkg/kubelet/apis/podresources"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
)

// PodResourcesSocket is where the node's kubelet serves the pod-resources
// API: the node's /var/lib/kubelet/pod-resources/kubelet.sock, with the
// node's directory as the kubelet's (where the chart mounts it from).
func (n *Node) PodResourcesSocket() string {
	return filepath.Join(n.Dir, "pod-resources", podresources.Socket+".sock")
}

// servePodResources serves the pod-resources API at socket until ctx ends;
// the returned function waits for the server to stop.
func (k *kubelet) servePodResources(ctx context.Context, socket string, activePods func() []*v1.Pod) (wait func(), err error) {
	if err := os.MkdirAll(filepath.Dir(socket), 0o750); err != nil {
		return nil, err
	}
	if err := os.Remove(socket); err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	lis, err := net.Listen("unix", socket)
	if err != nil {
		return nil, fmt.Errorf("pod-resources socket: %w", err)
	}
	providers := podresources.PodResourcesProviders{
		Pods:             kubeletPods{k: k, active: activePods},
		Devices:          kubeletDevices{k: k},
		Cpus:             noCPUs{},
		Memory:           noMemory{},
		DynamicResources: kubeletClaims{k: k},
	}
	// As the kubelet's ListenAndServePodResources (pkg/kubelet/server),
	// which exits the process on a listen error and cannot be stopped.
	srv := grpc.NewServer(kubeletgrpc.WithRateLimiter(ctx, "podresources", podresources.DefaultQPS, podresources.DefaultBurstTokens))
	podresourcesapi.RegisterPodResourcesListerServer(srv, podresources.NewV1PodResourcesServer(ctx, providers))
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(lis); err != nil && ctx.Err() == nil {
			klog.FromContext(ctx).Error(err, "Serve the pod-resources API")
		}
	}()
	go func() { <-ctx.Done(); srv.Stop() }()
	return func() { <-done }, nil
}

// kubeletPods are the node's pods, as the kubelet's pod manager has them.
type kubeletPods struct {
	k      *kubelet
	active func() []*v1.Pod
}

func (p kubeletPods) GetActivePods() []*v1.Pod { return p.active() }

func (p kubeletPods) GetPods() []*v1.Pod {
	pods, _ := p.k.pods.List(labels.Everything())
	return pods
}

func (p kubeletPods) GetPodByName(namespace, name string) (*v1.Pod, bool) {
	pod, err := p.k.pods.Pods(namespace).Get(name)
	return pod, err == nil
}

// kubeletDevices are the device manager's devices, converted as the
// kubelet's container manager converts them; none without a device
// manager.
type kubeletDevices struct{ k *kubelet }

func (d kubeletDevices) UpdateAllocatedDevices(logger klog.Logger) {
	if d.k.dm != nil {
		d.k.dm.m.UpdateAllocatedDevices(logger)
	}
}

func (d kubeletDevices) GetDevices(podUID, containerName string) []*podresourcesapi.ContainerDevices {
	if d.k.dm == nil {
		return nil
	}
	return containerDevices(d.k.dm.m.GetDevices(podUID, containerName))
}

func (d kubeletDevices) GetAllocatableDevices(logger klog.Logger) []*podresourcesapi.ContainerDevices {
	if d.k.dm == nil {
		return nil
	}
	return containerDevices(d.k.dm.m.GetAllocatableDevices(logger))
}

// containerDevices is the kubelet's containerDevicesFromResourceDeviceInstances
// (pkg/kubelet/cm/container_manager.go): one entry per device and NUMA
// node.
func containerDevices(devs devicemanager.ResourceDeviceInstances) []*podresourcesapi.ContainerDevices {
	var out []*podresourcesapi.ContainerDevices
	for resourceName, resourceDevs := range devs {
		for id, dev := range resourceDevs {
			topo := dev.GetTopology()
			if topo == nil {
				out = append(out, &podresourcesapi.ContainerDevices{ResourceName: resourceName, DeviceIds: []string{id}})
				continue
			}
			for _, node := range topo.GetNodes() {
				out = append(out, &podresourcesapi.ContainerDevices{ResourceName: resourceName, DeviceIds: []string{id},
					Topology: &podresourcesapi.TopologyInfo{Nodes: []*podresourcesapi.NUMANode{{ID: node.GetID()}}}})
			}
		}
	}
	return out
}

// kubeletClaims are the DRA manager's prepared claims of a container, as
// the kubelet's container manager reports them (GetDynamicResources).
type kubeletClaims struct{ k *kubelet }

func (c kubeletClaims) GetDynamicResources(logger klog.Logger, pod *v1.Pod, container *v1.Container) []*podresourcesapi.DynamicResource {
	infos, err := c.k.dra.GetContainerClaimInfos(pod, container)
	if err != nil {
		logger.Error(err, "Unable to get container claim info state")
		return []*podresourcesapi.DynamicResource{}
	}
	var out []*podresourcesapi.DynamicResource
	for _, info := range infos {
		var resources []*podresourcesapi.ClaimResource
		for driverName, driverState := range info.DriverState {
			var cdiDevices []*podresourcesapi.CDIDevice
			for _, device := range driverState.Devices {
				for _, id := range device.CDIDeviceIDs {
					cdiDevices = append(cdiDevices, &podresourcesapi.CDIDevice{Name: id})
				}
				resources = append(resources, &podresourcesapi.ClaimResource{CdiDevices: cdiDevices, DriverName: driverName,
					PoolName: device.PoolName, DeviceName: device.DeviceName, ShareId: (*string)(device.ShareID)})
			}
		}
		out = append(out, &podresourcesapi.DynamicResource{ClaimName: info.ClaimName, ClaimNamespace: info.Namespace, ClaimResources: resources})
	}
	return out
}

// noCPUs and noMemory: no CPU or memory manager runs.
type noCPUs struct{}

func (noCPUs) GetCPUs(*v1.Pod, *v1.Container) []int64 { return []int64{} }
func (noCPUs) GetPodCPUs(string) []int64              { return []int64{} }
func (noCPUs) GetAllocatableCPUs() []int64            { return []int64{} }

type noMemory struct{}

func (noMemory) GetMemory(klog.Logger, *v1.Pod, *v1.Container) []*podresourcesapi.ContainerMemory {
	return []*podresourcesapi.ContainerMemory{}
}
func (noMemory) GetPodMemory(klog.Logger, string) []*podresourcesapi.ContainerMemory {
	return []*podresourcesapi.ContainerMemory{}
}
func (noMemory) GetAllocatableMemory(klog.Logger) []*podresourcesapi.ContainerMemory {
	return []*podresourcesapi.ContainerMemory{}
}
