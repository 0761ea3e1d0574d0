package promrules

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/gpudra/gpudra/pkg/telemetry"
)

// kubelet is one node's kubelet as the attribution collector
// (telemetry.Collector.SetAttribution) reads it: the pod-resources API, a
// real gRPC server on a unix socket; the host's /proc, one cgroup file per
// GPU process; and the container log links
// (<pod>_<namespace>_<container>-<id>.log).
type kubelet struct {
	podresourcesv1.UnimplementedPodResourcesListerServer
	cfg telemetry.AttributionConfig

	mu   sync.Mutex
	down bool // List fails, as a kubelet whose socket is not mounted
	pods []*podresourcesv1.PodResources
}

func newKubelet(t *testing.T) *kubelet {
	t.Helper()
	// Not t.TempDir(): the subtests' long names would take a unix socket's
	// path past its 108 bytes.
	dir, err := os.MkdirTemp("", "podres")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	k := &kubelet{cfg: telemetry.AttributionConfig{
		PodResourcesSocket: filepath.Join(dir, "kubelet.sock"),
		ProcRoot:           filepath.Join(dir, "proc"),
		ContainerLogDir:    filepath.Join(dir, "containers"),
	}}
	require.NoError(t, os.Mkdir(k.cfg.ProcRoot, 0o755))
	require.NoError(t, os.Mkdir(k.cfg.ContainerLogDir, 0o755))
	l, err := net.Listen("unix", k.cfg.PodResourcesSocket)
	require.NoError(t, err)
	srv := grpc.NewServer()
	podresourcesv1.RegisterPodResourcesListerServer(srv, k)
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(srv.Stop)
	return k
}

func (k *kubelet) List(context.Context, *podresourcesv1.ListPodResourcesRequest) (*podresourcesv1.ListPodResourcesResponse, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.down {
		return nil, errors.New("pod-resources API unavailable (test)")
	}
	return &podresourcesv1.ListPodResourcesResponse{PodResources: k.pods}, nil
}

func (k *kubelet) setDown(down bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.down = down
}

// container is a container the kubelet runs.
type container struct {
	namespace, pod, name string
	podUID, id           string
}

// run starts a container of pod namespace/pod holding devices (device
// plugin mode) or its claims' devices (DRA mode): the pod-resources API
// lists it and its log link is written. Its pod UID and container ID are
// derived from its names, as stable as a real runtime's are random.
func (k *kubelet) run(t *testing.T, namespace, pod, name string, devices []*podresourcesv1.ContainerDevices, claims []*podresourcesv1.DynamicResource) container {
	t.Helper()
	sum := sha256.Sum256([]byte(namespace + "/" + pod + "/" + name))
	u := hex.EncodeToString(sum[:16])
	c := container{namespace: namespace, pod: pod, name: name,
		podUID: u[0:8] + "-" + u[8:12] + "-" + u[12:16] + "-" + u[16:20] + "-" + u[20:32], id: hex.EncodeToString(sum[:])}
	link := filepath.Join(k.cfg.ContainerLogDir, fmt.Sprintf("%s_%s_%s-%s.log", pod, namespace, name, c.id))
	require.NoError(t, os.Symlink(filepath.Join("/var/log/pods", namespace+"_"+pod+"_"+c.podUID, name, "0.log"), link))
	k.mu.Lock()
	defer k.mu.Unlock()
	k.pods = append(k.pods, &podresourcesv1.PodResources{Name: pod, Namespace: namespace, Containers: []*podresourcesv1.ContainerResources{{
		Name: name, Devices: devices, DynamicResources: claims,
	}}})
	return c
}

// process writes /proc/<pid>/cgroup of a process in c, as the kubelet's
// cgroupfs driver names it (as devcluster's kubelet does).
func (k *kubelet) process(t *testing.T, pid int, c container) {
	t.Helper()
	d := filepath.Join(k.cfg.ProcRoot, strconv.Itoa(pid))
	require.NoError(t, os.MkdirAll(d, 0o755))
	cg := fmt.Sprintf("0::/kubepods/besteffort/pod%s/%s\n", c.podUID, c.id)
	require.NoError(t, os.WriteFile(filepath.Join(d, "cgroup"), []byte(cg), 0o644))
}
