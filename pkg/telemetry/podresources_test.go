package telemetry

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/prepared"
)

// podResourcesWith lists one container holding one DRA device.
func podResourcesWith(c containerKey, driver, pool, device string) *podresourcesv1.ListPodResourcesResponse {
	return &podresourcesv1.ListPodResourcesResponse{PodResources: []*podresourcesv1.PodResources{{
		Name: c.Pod, Namespace: c.Namespace, Containers: []*podresourcesv1.ContainerResources{{
			Name: c.Container, DynamicResources: []*podresourcesv1.DynamicResource{{ClaimName: "c1", ClaimNamespace: c.Namespace,
				ClaimResources: []*podresourcesv1.ClaimResource{{DriverName: driver, PoolName: pool, DeviceName: device}}}},
		}},
	}}}
}

// fakeKubelet serves the pod-resources API's List, as the kubelet does.
type fakeKubelet struct {
	podresourcesv1.UnimplementedPodResourcesListerServer
	mu    sync.Mutex
	resp  *podresourcesv1.ListPodResourcesResponse
	err   error
	lists int
}

func (k *fakeKubelet) List(context.Context, *podresourcesv1.ListPodResourcesRequest) (*podresourcesv1.ListPodResourcesResponse, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.lists++
	return k.resp, k.err
}

// serveKubelet serves k on a unix socket until the test ends and returns
// the socket's path.
func serveKubelet(t *testing.T, k *fakeKubelet) string {
	// Not t.TempDir(): a unix socket's path is limited to 108 bytes.
	dir, err := os.MkdirTemp("", "podres")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	socket := filepath.Join(dir, "kubelet.sock")
	l, err := net.Listen("unix", socket)
	require.NoError(t, err)
	srv := grpc.NewServer()
	podresourcesv1.RegisterPodResourcesListerServer(srv, k)
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(srv.Stop)
	return socket
}

// fakeNode is a host's /proc and the kubelet's log directory: each PID's
// cgroup file, and the log links (dangling, as they are in the plugin's
// container: only their names are read).
func fakeNode(t *testing.T, cgroups map[int]string, links []string) (procRoot, logDir string) {
	procRoot, logDir = t.TempDir(), t.TempDir()
	for pid, cg := range cgroups {
		d := filepath.Join(procRoot, strconv.Itoa(pid))
		require.NoError(t, os.MkdirAll(d, 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(d, "cgroup"), []byte(cg), 0o644))
	}
	for _, l := range links {
		require.NoError(t, os.Symlink("/var/log/pods/not-mounted/0.log", filepath.Join(logDir, l)))
	}
	return procRoot, logDir
}

// gatherSeries is every series of the named metrics in reg, one line each
// ("name{label=value,...} value"), sorted.
func gatherSeries(t require.TestingT, reg *prometheus.Registry, names ...string) []string {
	mfs, err := reg.Gather()
	require.NoError(t, err)
	var out []string
	for _, mf := range mfs {
		if !slices.Contains(names, mf.GetName()) {
			continue
		}
		for _, m := range mf.GetMetric() {
			var ls []string
			for _, l := range m.GetLabel() {
				ls = append(ls, l.GetName()+"="+l.GetValue())
			}
			out = append(out, fmt.Sprintf("%s{%s} %g", mf.GetName(), strings.Join(ls, ","), m.GetGauge().GetValue()))
		}
	}
	slices.Sort(out)
	return out
}

var attributionSeries = []string{"gpudra_device_pod_info", "gpudra_container_gpu_memory_used_bytes", "gpudra_container_gpu_sm_utilization_ratio",
	"gpudra_container_gpu_processes", "gpudra_unattributed_gpu_memory_used_bytes", "gpudra_unattributed_gpu_processes",
	"gpudra_telemetry_attribution_up", "gpudra_telemetry_unresolved_processes"}

// TestAttributionThroughTheKubelet runs attribution as the plugin does: a
// real gRPC pod-resources server on a unix socket, a /proc and a log
// directory on disk, the collector's sampling pass and a registry's Gather.
func TestAttributionThroughTheKubelet(t *testing.T) {
	const mib = 1 << 20
	// gpu-3: A's and B's processes and a host process (shared); gpu-4:
	// nobody's; gpu-5 in MIG mode: A's process on a MIG device.
	samples := []nvdevice.TelemetrySample{
		gpu("GPU-a", 3, nvdevice.ProcessSample{PID: 100, UsedMemoryBytes: nvdevice.Read(512 * mib), SMUtilization: nvdevice.Read(0.25)},
			nvdevice.ProcessSample{PID: 200, UsedMemoryBytes: nvdevice.Read(256 * mib), SMUtilization: nvdevice.Read(0.5)},
			nvdevice.ProcessSample{PID: 300, UsedMemoryBytes: nvdevice.Read(64 * mib), SMUtilization: nvdevice.Read(0)}),
		gpu("GPU-c", 4),
		gpu("GPU-m", 5),
		mig("MIG-x", "GPU-m", 5, 4, nvdevice.ProcessSample{PID: 101, UsedMemoryBytes: nvdevice.Read(1024 * mib)}),
	}
	cgroups := map[int]string{
		100: "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + podSD + ".slice/cri-containerd-" + idA + ".scope\n",
		101: "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + podSD + ".slice/cri-containerd-" + idA + ".scope\n",
		200: "12:memory:/kubepods/besteffort/pod" + podUID + "/" + idB + "\n0::/\n",
		300: "0::/system.slice/some-daemon.service\n",
	}
	logLinks := []string{"train-0_ml_worker-" + idA + ".log", "train-1_ml_worker-" + idB + ".log", "web_default_nginx-" + idC + ".log"}
	container := func(ns, pod, name string, devs []*podresourcesv1.ContainerDevices, dyn ...*podresourcesv1.DynamicResource) *podresourcesv1.PodResources {
		return &podresourcesv1.PodResources{Name: pod, Namespace: ns, Containers: []*podresourcesv1.ContainerResources{{Name: name, Devices: devs, DynamicResources: dyn}}}
	}
	claim := func(name string, devices ...string) *podresourcesv1.DynamicResource {
		d := &podresourcesv1.DynamicResource{ClaimName: name, ClaimNamespace: "ml"}
		for _, dev := range devices {
			d.ClaimResources = append(d.ClaimResources, &podresourcesv1.ClaimResource{DriverName: "gpu.gpudra.dev", PoolName: "n1", DeviceName: dev})
		}
		return d
	}
	draMode := &podresourcesv1.ListPodResourcesResponse{PodResources: []*podresourcesv1.PodResources{
		container("ml", "train-0", "worker", nil, claim("a", "gpu-3", "gpu-5-mig-3g-40gb-4")),
		container("ml", "train-1", "worker", nil, claim("b", "gpu-3"), claim("watch", "gpu-4")),
		container("default", "web", "nginx", nil), // no device: appears nowhere
	}}
	devicePluginMode := &podresourcesv1.ListPodResourcesResponse{PodResources: []*podresourcesv1.PodResources{
		container("ml", "train-0", "worker", []*podresourcesv1.ContainerDevices{
			{ResourceName: "nvidia.com/gpu.shared", DeviceIds: []string{"GPU-a::0", "GPU-a::2"}},
			{ResourceName: "nvidia.com/mig-3g.40gb", DeviceIds: []string{"MIG-x"}}}),
		container("ml", "train-1", "worker", []*podresourcesv1.ContainerDevices{
			{ResourceName: "nvidia.com/gpu.shared", DeviceIds: []string{"GPU-a::1"}},
			{ResourceName: "example.com/nic", DeviceIds: []string{"eth9"}}}),
		container("default", "web", "nginx", nil),
	}}
	// watch holds gpu-4 with admin access: no use of it.
	adminClaim := prepared.Claim{Namespace: "ml", Name: "watch", Devices: []prepared.Device{{Pool: "n1", Device: "gpu-4", AdminAccess: true}}}

	// Gather sorts the labels; a GPU's MIG labels are empty.
	dra := func(device, migUUID, profile string) string {
		return "dra_device_name=" + device + ",dra_driver_name=gpu.gpudra.dev,dra_mig_device_uuid=" + migUUID + ",dra_mig_profile=" + profile + ",dra_pool_name=n1"
	}
	gpu3 := dra("gpu-3", "", "") + ",gpu=GPU-a"
	gpu4 := dra("gpu-4", "", "") + ",gpu=GPU-c"
	mig4 := dra("gpu-5-mig-3g-40gb-4", "MIG-x", "3g.40gb") + ",gpu=GPU-m"
	ctr := func(dev, pod string) string {
		return "container=worker," + dev + ",namespace=ml,node=n1,pod=" + pod
	}
	// The series both modes share, for A on gpu-3 and its MIG device, B on
	// gpu-3; the host process unattributed on gpu-3.
	figures := []string{
		"gpudra_container_gpu_memory_used_bytes{" + ctr(gpu3, "train-0") + "} 5.36870912e+08",
		"gpudra_container_gpu_memory_used_bytes{" + ctr(gpu3, "train-1") + "} 2.68435456e+08",
		"gpudra_container_gpu_memory_used_bytes{" + ctr(mig4, "train-0") + "} 1.073741824e+09",
		"gpudra_container_gpu_processes{" + ctr(gpu3, "train-0") + "} 1",
		"gpudra_container_gpu_processes{" + ctr(gpu3, "train-1") + "} 1",
		"gpudra_container_gpu_processes{" + ctr(mig4, "train-0") + "} 1",
		"gpudra_container_gpu_sm_utilization_ratio{" + ctr(gpu3, "train-0") + "} 0.25",
		"gpudra_container_gpu_sm_utilization_ratio{" + ctr(gpu3, "train-1") + "} 0.5",
		"gpudra_telemetry_attribution_up{node=n1} 1",
		"gpudra_telemetry_unresolved_processes{node=n1} 0",
		"gpudra_unattributed_gpu_memory_used_bytes{" + gpu3 + ",node=n1} 6.7108864e+07",
		"gpudra_unattributed_gpu_memory_used_bytes{" + gpu4 + ",node=n1} 0",
		"gpudra_unattributed_gpu_memory_used_bytes{" + mig4 + ",node=n1} 0",
		"gpudra_unattributed_gpu_processes{" + gpu3 + ",node=n1} 1",
		"gpudra_unattributed_gpu_processes{" + gpu4 + ",node=n1} 0",
		"gpudra_unattributed_gpu_processes{" + mig4 + ",node=n1} 0",
	}
	info := func(dev, pod, claim string) string {
		claimNS := ""
		if claim != "" {
			claimNS = "ml"
		}
		return "gpudra_device_pod_info{container=worker,dra_claim_name=" + claim + ",dra_claim_namespace=" + claimNS + "," + dev + ",namespace=ml,node=n1,pod=" + pod + "} 1"
	}
	for _, tc := range []struct {
		name   string
		resp   *podresourcesv1.ListPodResourcesResponse
		err    error
		claims []prepared.Claim // SetClaims (DRA mode)
		want   []string
	}{
		{name: "DRA mode", resp: draMode, claims: []prepared.Claim{adminClaim},
			want: append([]string{info(gpu3, "train-0", "a"), info(gpu3, "train-1", "b"), info(mig4, "train-0", "a")}, figures...)},
		{name: "device plugin mode", resp: devicePluginMode,
			want: append([]string{info(gpu3, "train-0", ""), info(gpu3, "train-1", ""), info(mig4, "train-0", "")}, figures...)},
		{name: "the kubelet's API fails: nothing but up=0", err: errors.New("kubelet restarting"),
			want: []string{"gpudra_telemetry_attribution_up{node=n1} 0"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			kubelet := &fakeKubelet{resp: tc.resp, err: tc.err}
			procRoot, logDir := fakeNode(t, cgroups, logLinks)
			c := NewCollector(&fakeReader{samples: samples}, "n1", 0)
			c.SetAttribution(AttributionConfig{PodResourcesSocket: serveKubelet(t, kubelet), ProcRoot: procRoot, ContainerLogDir: logDir})
			if tc.claims != nil {
				c.SetClaims(func() []prepared.Claim { return tc.claims })
			}
			c.Sample(context.Background())
			reg := prometheus.NewPedanticRegistry()
			require.NoError(t, reg.Register(c))
			assert.Equal(t, sorted(tc.want), gatherSeries(t, reg, attributionSeries...))
			assert.Equal(t, 1, kubelet.lists, "one List per sampling pass")
			// The device series are there either way.
			assert.NotEmpty(t, gatherSeries(t, reg, "gpudra_telemetry_up"))
		})
	}

	t.Run("a process that ended before its cgroup was read", func(t *testing.T) {
		procRoot, logDir := fakeNode(t, map[int]string{100: cgroups[100], 101: cgroups[101], 300: cgroups[300]}, logLinks) // 200 gone
		c := NewCollector(&fakeReader{samples: samples}, "n1", 0)
		c.SetAttribution(AttributionConfig{PodResourcesSocket: serveKubelet(t, &fakeKubelet{resp: draMode}), ProcRoot: procRoot, ContainerLogDir: logDir})
		c.Sample(context.Background())
		reg := prometheus.NewPedanticRegistry()
		require.NoError(t, reg.Register(c))
		got := gatherSeries(t, reg, attributionSeries...)
		assert.Contains(t, got, "gpudra_telemetry_unresolved_processes{node=n1} 1")
		assert.Contains(t, got, info(gpu3, "train-1", "b"), "who holds gpu-3 is still known")
		for _, s := range got {
			if strings.Contains(s, gpu3+",") && !strings.HasPrefix(s, "gpudra_device_pod_info") {
				t.Errorf("gpu-3's figures are sent though one of its processes is unresolved: %s", s)
			}
		}
		assert.Contains(t, got, "gpudra_container_gpu_processes{"+ctr(mig4, "train-0")+"} 1", "the MIG device's figures are known")
	})

	t.Run("without SetAttribution there is no attribution series", func(t *testing.T) {
		reg := prometheus.NewPedanticRegistry()
		require.NoError(t, reg.Register(sampled(&fakeReader{samples: samples}, "n1")))
		assert.Empty(t, gatherSeries(t, reg, attributionSeries...))
	})
}

func sorted(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}

// BenchmarkAttributionPass is one sampling pass with attribution on a busy
// DGX in device plugin mode: 8 GPUs shared 4 ways (time-slicing), 32
// containers with 2 processes on their GPU each, the pod-resources API over
// a unix socket, /proc and the log links on disk.
func BenchmarkAttributionPass(b *testing.B) {
	var samples []nvdevice.TelemetrySample
	cgroups := map[int]string{}
	var links []string
	resp := &podresourcesv1.ListPodResourcesResponse{}
	for g := range 8 {
		uuid := fmt.Sprintf("GPU-%d", g)
		s := gpu(uuid, g)
		for r := range 4 {
			pod := fmt.Sprintf("job-%d-%d", g, r)
			id := fmt.Sprintf("%064x", g*4+r+1)
			resp.PodResources = append(resp.PodResources, &podresourcesv1.PodResources{Name: pod, Namespace: "ml", Containers: []*podresourcesv1.ContainerResources{{
				Name: "worker", Devices: []*podresourcesv1.ContainerDevices{{ResourceName: "nvidia.com/gpu", DeviceIds: []string{fmt.Sprintf("%s::%d", uuid, r)}}}}}})
			links = append(links, pod+"_ml_worker-"+id+".log")
			for p := range 2 {
				pid := 1000 + (g*4+r)*2 + p
				cgroups[pid] = "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + podSD + ".slice/cri-containerd-" + id + ".scope\n"
				s.Processes = append(s.Processes, nvdevice.ProcessSample{PID: pid, UsedMemoryBytes: nvdevice.Read(1 << 30), SMUtilization: nvdevice.Read(0.1)})
			}
		}
		samples = append(samples, s)
	}
	dir := b.TempDir()
	procRoot, logDir := filepath.Join(dir, "proc"), filepath.Join(dir, "logs")
	require.NoError(b, os.MkdirAll(logDir, 0o755))
	for pid, cg := range cgroups {
		d := filepath.Join(procRoot, strconv.Itoa(pid))
		require.NoError(b, os.MkdirAll(d, 0o755))
		require.NoError(b, os.WriteFile(filepath.Join(d, "cgroup"), []byte(cg), 0o644))
	}
	for _, l := range links {
		require.NoError(b, os.Symlink("/var/log/pods/x/0.log", filepath.Join(logDir, l)))
	}
	sockDir, err := os.MkdirTemp("", "podres")
	require.NoError(b, err)
	defer func() { _ = os.RemoveAll(sockDir) }()
	socket := filepath.Join(sockDir, "kubelet.sock")
	l, err := net.Listen("unix", socket)
	require.NoError(b, err)
	srv := grpc.NewServer()
	podresourcesv1.RegisterPodResourcesListerServer(srv, &fakeKubelet{resp: resp})
	go func() { _ = srv.Serve(l) }()
	defer srv.Stop()
	c := NewCollector(&fakeReader{samples: samples}, "n1", 0)
	c.SetAttribution(AttributionConfig{PodResourcesSocket: socket, ProcRoot: procRoot, ContainerLogDir: logDir})
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		c.Sample(ctx)
	}
	b.StopTimer()
	reg := prometheus.NewPedanticRegistry()
	require.NoError(b, reg.Register(c))
	require.Len(b, gatherSeries(b, reg, "gpudra_container_gpu_processes"), 32, "every container attributed")
}
