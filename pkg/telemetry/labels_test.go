package telemetry

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/prepared"
)

// dcgm-exporter's labels of a device a DRA claim gives a container
// (NVIDIA/dcgm-exporter, internal/pkg/transformation: const.go,
// kubernetes.go; the MIG ones from dra.go).
var (
	dcgmDRALabels       = []string{"dra_claim_name", "dra_claim_namespace", "dra_device_name", "dra_driver_name", "dra_pool_name"}
	dcgmMIGLabels       = []string{"dra_mig_profile", "dra_mig_device_uuid"}
	dcgmContainerLabels = []string{"pod", "namespace", "container"}
)

// TestDCGMExporterLabelNames scrapes a pass of a node in DRA mode whose
// container holds a MIG device through a claim, and checks that every
// series of a device, its claim and its container carries the device's
// DRA names under dcgm-exporter's label names, with the values
// dcgm-exporter would give them.
func TestDCGMExporterLabelNames(t *testing.T) {
	const migDevice = "gpu-5-mig-3g-40gb-4"
	samples := []nvdevice.TelemetrySample{
		gpu("GPU-m", 5),
		mig("MIG-x", "GPU-m", 5, 4, nvdevice.ProcessSample{PID: 101, UsedMemoryBytes: nvdevice.Read(1 << 30)}),
	}
	for i := range samples {
		samples[i].ProductName = "NVIDIA H100 80GB HBM3"
	}
	samples[1].FramebufferUsedBytes = nvdevice.Read(1 << 30)
	samples[0].GPUUtilization = nvdevice.Read(0.5)
	procRoot, logDir := fakeNode(t,
		map[int]string{101: "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + podSD + ".slice/cri-containerd-" + idA + ".scope\n"},
		[]string{"train-0_ml_worker-" + idA + ".log"})
	kubelet := &fakeKubelet{resp: &podresourcesv1.ListPodResourcesResponse{PodResources: []*podresourcesv1.PodResources{{
		Name: "train-0", Namespace: "ml", Containers: []*podresourcesv1.ContainerResources{{Name: "worker",
			DynamicResources: []*podresourcesv1.DynamicResource{{ClaimName: "a", ClaimNamespace: "ml",
				ClaimResources: []*podresourcesv1.ClaimResource{{DriverName: "gpu.gpudra.dev", PoolName: "n1", DeviceName: migDevice}}}}}},
	}}}}
	c := NewCollector(&fakeReader{samples: samples}, "n1", 0)
	c.SetAttribution(AttributionConfig{PodResourcesSocket: serveKubelet(t, kubelet), ProcRoot: procRoot, ContainerLogDir: logDir})
	c.SetClaims(func() []prepared.Claim {
		return []prepared.Claim{{UID: "u1", Namespace: "ml", Name: "a", State: prepared.PrepareCompleted,
			Devices: []prepared.Device{{Pool: "n1", Device: migDevice, UUID: "MIG-x", GPUUUID: "GPU-m", Mig: true}}}}
	})
	c.Sample(context.Background())
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	// The labels of each metric's series of the MIG device (of the GPU for
	// a GPU metric), empty values left out as Prometheus stores them.
	got := map[string]map[string]string{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			l := map[string]string{}
			for _, p := range m.GetLabel() {
				if p.GetValue() != "" {
					l[p.GetName()] = p.GetValue()
				}
			}
			if l["dra_device_name"] == migDevice || (l["dra_device_name"] == "gpu-5" && mf.GetName() == "gpudra_gpu_utilization_ratio") {
				got[mf.GetName()] = l
			}
		}
	}
	device := map[string]string{"gpu": "GPU-m", "node": "n1", "dra_device_name": migDevice, "dra_driver_name": "gpu.gpudra.dev",
		"dra_pool_name": "n1", "dra_mig_profile": "3g.40gb", "dra_mig_device_uuid": "MIG-x"}
	with := func(base map[string]string, kv ...string) map[string]string {
		out := map[string]string{}
		for k, v := range base {
			out[k] = v
		}
		for i := 0; i+1 < len(kv); i += 2 {
			out[kv[i]] = kv[i+1]
		}
		return out
	}
	container := with(device, "namespace", "ml", "pod", "train-0", "container", "worker")
	claim := []string{"dra_claim_name", "a", "dra_claim_namespace", "ml"}
	for metric, want := range map[string]map[string]string{
		"gpudra_gpu_utilization_ratio": {"gpu": "GPU-m", "node": "n1", "dra_device_name": "gpu-5", "dra_driver_name": "gpu.gpudra.dev",
			"dra_pool_name": "n1", "model": "NVIDIA H100 80GB HBM3"},
		"gpudra_mig_framebuffer_used_bytes":      with(device, "model", "NVIDIA H100 80GB HBM3"),
		"gpudra_device_claim_info":               with(device, append(claim, "claim_uid", "u1")...),
		"gpudra_device_free":                     device,
		"gpudra_device_pod_info":                 with(container, claim...),
		"gpudra_container_gpu_memory_used_bytes": container,
		"gpudra_container_gpu_processes":         container,
		"gpudra_unattributed_gpu_processes":      device,
	} {
		assert.Equal(t, want, got[metric], metric)
	}
	has := func(metric string, names ...[]string) {
		t.Helper()
		for _, ns := range names {
			for _, n := range ns {
				assert.Contains(t, got[metric], n, "%s has dcgm-exporter's %s", metric, n)
			}
		}
	}
	has("gpudra_device_pod_info", dcgmDRALabels, dcgmMIGLabels, dcgmContainerLabels)
	has("gpudra_device_claim_info", dcgmDRALabels, dcgmMIGLabels)
	has("gpudra_container_gpu_memory_used_bytes", dcgmDRALabels[2:], dcgmMIGLabels, dcgmContainerLabels)
	has("gpudra_mig_framebuffer_used_bytes", dcgmDRALabels[2:], dcgmMIGLabels)
}
