package deviceplugin

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/gpudra/gpudra/pkg/sharing"
)

// fakePodResources is the kubelet's pod-resources API on a real unix
// socket, answering List with fixed pods.
type fakePodResources struct {
	podresourcesv1.UnimplementedPodResourcesListerServer
	pods []*podresourcesv1.PodResources
}

func (f *fakePodResources) List(context.Context, *podresourcesv1.ListPodResourcesRequest) (*podresourcesv1.ListPodResourcesResponse, error) {
	return &podresourcesv1.ListPodResourcesResponse{PodResources: f.pods}, nil
}

// servePodResources serves pods on a socket in a new directory and returns
// the socket's path.
func servePodResources(t *testing.T, pods ...*podresourcesv1.PodResources) string {
	t.Helper()
	socket := filepath.Join(t.TempDir(), "kubelet.sock")
	lis, err := net.Listen("unix", socket)
	require.NoError(t, err)
	srv := grpc.NewServer()
	podresourcesv1.RegisterPodResourcesListerServer(srv, &fakePodResources{pods: pods})
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return socket
}

// podWith is a pod whose containers hold devices: container name ->
// resource -> device IDs. Each device is its own entry, as the kubelet
// answers.
func podWith(namespace, name string, containers map[string]map[string][]string) *podresourcesv1.PodResources {
	p := &podresourcesv1.PodResources{Namespace: namespace, Name: name}
	for c, resources := range containers {
		cr := &podresourcesv1.ContainerResources{Name: c}
		for r, ids := range resources {
			for _, id := range ids {
				cr.Devices = append(cr.Devices, &podresourcesv1.ContainerDevices{ResourceName: r, DeviceIds: []string{id},
					Topology: &podresourcesv1.TopologyInfo{Nodes: []*podresourcesv1.NUMANode{{ID: 0}}}})
			}
		}
		p.Containers = append(p.Containers, cr)
	}
	return p
}

func TestListPodResources(t *testing.T) {
	socket := servePodResources(t,
		podWith("team-a", "train", map[string]map[string][]string{"main": {"nvidia.com/gpu": {"GPU-b", "GPU-a"}, "example.com/fpga": {"f0"}}}),
		podWith("team-b", "infer", map[string]map[string][]string{"main": {"nvidia.com/mig-1g.10gb": {"MIG-1"}}}),
		podWith("team-c", "cpu-only", map[string]map[string][]string{"main": nil}))
	got, err := ListPodResources(context.Background(), socket, []string{"nvidia.com/gpu", "nvidia.com/mig-*"})
	require.NoError(t, err)
	assert.Equal(t, []DevicePluginAllocation{
		{Pod: "team-a/train", ContainerName: "main", ResourceName: "nvidia.com/gpu", DeviceIDs: []string{"GPU-a", "GPU-b"}},
		{Pod: "team-b/infer", ContainerName: "main", ResourceName: "nvidia.com/mig-1g.10gb", DeviceIDs: []string{"MIG-1"}},
	}, got)

	all, err := ListPodResources(context.Background(), socket, []string{"*"})
	require.NoError(t, err)
	assert.Len(t, all, 3, "every resource")
}

// The pod-resources API is what counts when its socket exists: the
// checkpoint's stale entries of deleted pods are not read.
func TestCheckDevicePluginDrainedFromPodResources(t *testing.T) {
	ctx := context.Background()
	stale := filepath.Join(t.TempDir(), "kubelet_internal_checkpoint")
	require.NoError(t, os.WriteFile(stale, []byte(kubeletCP), 0o600))
	names := []string{"nvidia.com/gpu", "nvidia.com/mig-*"}

	drained := servePodResources(t, podWith("team-c", "cpu-only", map[string]map[string][]string{"main": {"example.com/fpga": {"f0"}}}))
	assert.NoError(t, CheckDevicePluginDrained(ctx, DeviceHolders{PodResourcesSocket: drained, KubeletCheckpoint: stale}, names),
		"nobody holds a GPU: the checkpoint's entries are stale")

	held := servePodResources(t,
		podWith("team-a", "train", map[string]map[string][]string{"main": {"nvidia.com/gpu": {"GPU-a"}}, "side": {"nvidia.com/gpu": {"GPU-b"}}}),
		podWith("team-b", "infer", map[string]map[string][]string{"main": {"nvidia.com/mig-1g.10gb": {"MIG-1"}}}))
	err := CheckDevicePluginDrained(ctx, DeviceHolders{PodResourcesSocket: held, KubeletCheckpoint: stale}, names)
	require.Error(t, err)
	assert.Equal(t, "DRA mode refused: the kubelet's pod-resources API ("+held+") lists 2 pod(s) holding GPUs through a device plugin: "+
		"pod team-a/train (nvidia.com/gpu), pod team-b/infer (nvidia.com/mig-1g.10gb); "+
		"drain them (kubectl drain / delete the pods that request nvidia.com/gpu, nvidia.com/mig-*) before switching the node to DRA mode", err.Error())
}

// A socket that exists but does not answer (the kubelet is down) is an
// error, not a drained node; no socket and no checkpoint is one too.
func TestCheckDevicePluginDrainedUnknown(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	dead := filepath.Join(t.TempDir(), "kubelet.sock")
	lis, err := net.Listen("unix", dead)
	require.NoError(t, err)
	lis.(*net.UnixListener).SetUnlinkOnClose(false)
	require.NoError(t, lis.Close())
	_, err = os.Stat(dead)
	require.NoError(t, err, "the socket file stays")
	err = CheckDevicePluginDrained(ctx, DeviceHolders{PodResourcesSocket: dead, KubeletCheckpoint: filepath.Join(t.TempDir(), "none")}, []string{"nvidia.com/gpu"})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "DRA mode: ask the kubelet's pod-resources API at "+dead+" which pods hold devices")

	err = CheckDevicePluginDrained(ctx, DeviceHolders{PodResourcesSocket: filepath.Join(t.TempDir(), "none.sock")}, []string{"nvidia.com/gpu"})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "cannot tell which pods hold devices")
	assert.False(t, DeviceHolders{}.Known())
}

// At start, an MPS server no longer wanted is stopped unless the kubelet's
// pod-resources API lists a container holding one of its replicas; a stale
// checkpoint entry (a deleted pod) does not keep it.
func TestStopUnwantedMPSServersAsksPodResources(t *testing.T) {
	ctx := context.Background()
	standIn, err := filepath.Abs("../../hack/fake-nvidia-cuda-mps-control")
	require.NoError(t, err)
	mgr, err := sharing.NewManager(sharing.Options{Root: t.TempDir(), MPSControl: sharing.ExecMPSControl{Path: standIn}, MPSReadyTimeout: 5 * time.Second})
	require.NoError(t, err)
	m := mgr.MPS()
	held, stale := "GPU-held-by-a-pod", "GPU-of-a-deleted-pod"
	for _, u := range []string{held, stale} {
		_, err := m.EnsureServer(ctx, m.ServerFor([]string{u}), nil, true)
		require.NoError(t, err)
	}
	t.Cleanup(func() {
		servers, _ := m.Servers(context.Background())
		for _, s := range servers {
			_ = m.StopServer(context.Background(), s)
		}
	})
	checkpoint := filepath.Join(t.TempDir(), "kubelet_internal_checkpoint")
	require.NoError(t, os.WriteFile(checkpoint, []byte(`{"Data":{"PodDeviceEntries":[
{"PodUID":"deleted","ContainerName":"c","ResourceName":"nvidia.com/gpu","DeviceIDs":{"-1":["`+stale+`::1"]}}]},"Checksum":1}`), 0o600))
	socket := servePodResources(t, podWith("team-a", "mps-client", map[string]map[string][]string{"c": {"nvidia.com/gpu": {held + "::0"}}}))

	stopUnwantedMPSServers(ctx, MPSOptions{MPS: m, PodResourcesSocket: socket, KubeletCheckpoint: checkpoint}, map[string]bool{})
	servers, err := m.Servers(ctx)
	require.NoError(t, err)
	var keys []string
	for _, s := range servers {
		keys = append(keys, s.Key)
	}
	assert.Equal(t, []string{m.ServerFor([]string{held}).Key}, keys, "the held GPU's server stays, the stale one goes")
}
