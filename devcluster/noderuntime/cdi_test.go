package noderuntime

import (
	"context"
	"testing"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/prepared"
)

func node(n prepared.DeviceNode) oci.LinuxDevice {
	return oci.LinuxDevice{Path: n.Path, Type: "c", Major: n.Major, Minor: n.Minor}
}

// The GPUs a container sees are named from its device nodes: a GPU's node
// alone is the GPU; a MIG device needs its parent's node and both its
// capability nodes; nothing else (env) is read.
func TestMachineDevicesNamesGPUsFromDeviceNodes(t *testing.T) {
	ctx := context.Background()
	m, err := sim.NewBuiltin("dgx-h100", "node")
	require.NoError(t, err)
	host, err := m.Host(ctx)
	require.NoError(t, err)
	inv, err := m.Inventory(ctx)
	require.NoError(t, err)
	gpu0, gpu1, gpu2 := inv.GPUs[0], inv.GPUs[1], inv.GPUs[2]
	small, err := m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu1.UUID, Profile: "1g.10gb", Start: 6})
	require.NoError(t, err)
	medium, err := m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu1.UUID, Profile: "3g.40gb", Start: 0})
	require.NoError(t, err)
	caps := func(d *nvdevice.MigDevice) []oci.LinuxDevice {
		gi, ci, err := host.CapMinors(gpu1.Minor, d.GPUInstanceID, d.ComputeInstanceID)
		require.NoError(t, err)
		return []oci.LinuxDevice{node(cdi.CapNode(host.Majors, gi)), node(cdi.CapNode(host.Majors, ci))}
	}
	control := []oci.LinuxDevice{}
	for _, n := range cdi.ControlNodes(host.Majors) {
		control = append(control, node(n))
	}
	gpuNode := func(g nvdevice.GPU) oci.LinuxDevice { return node(cdi.GPUNode(host.Majors, g.Minor)) }
	identify := MachineDevices(m)
	for _, tc := range []struct {
		name  string
		nodes []oci.LinuxDevice
		want  []string
	}{
		{"control nodes only", control, nil},
		{"two whole GPUs, in index order", append([]oci.LinuxDevice{gpuNode(gpu2), gpuNode(gpu0)}, control...), []string{gpu0.UUID, gpu2.UUID}},
		{"a MIG device", append(append([]oci.LinuxDevice{gpuNode(gpu1)}, caps(small)...), control...), []string{small.UUID}},
		{"two MIG devices of one GPU and a whole GPU", append(append(append([]oci.LinuxDevice{gpuNode(gpu1), gpuNode(gpu0)}, caps(small)...), caps(medium)...), control...),
			[]string{gpu0.UUID, medium.UUID, small.UUID}},
		{"capability nodes without the parent's node", caps(small), nil},
		{"one capability node of two: the GPU's monitoring view", []oci.LinuxDevice{gpuNode(gpu1), caps(medium)[1]}, []string{gpu1.UUID}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := identify(tc.nodes)
			require.NoError(t, err)
			assert.Equal(t, tc.want, got)
		})
	}
}

// ResolveCDI reports what two CDI devices of one container set
// differently, which a runtime would settle by order.
func TestResolveCDIReportsConflicts(t *testing.T) {
	dir := t.TempDir()
	w, err := cdi.NewWriter(dir)
	require.NoError(t, err)
	majors := sim.Majors
	mps := func(uid string, minor int, pct string) cdi.Claim {
		return cdi.Claim{UID: uid, Devices: []prepared.Device{{Device: "gpu-" + pct, UUID: "GPU-" + uid, Nodes: []prepared.DeviceNode{cdi.GPUNode(majors, minor)}}},
			Env:    map[string]string{"CUDA_MPS_PIPE_DIRECTORY": "/mps", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": pct},
			Mounts: []cdi.Mount{{HostPath: "/host/mps/" + uid, ContainerPath: "/mps"}}}
	}
	plain := cdi.Claim{UID: "plain", Devices: []prepared.Device{{Device: "gpu-3", UUID: "GPU-3", Nodes: []prepared.DeviceNode{cdi.GPUNode(majors, 3)}}}}
	for _, c := range []cdi.Claim{mps("a", 1, "50"), mps("b", 2, "25"), plain} {
		spec, err := cdi.BuildSpec(c, majors)
		require.NoError(t, err)
		require.NoError(t, w.Write(c.UID, spec))
	}
	v, err := ResolveCDI(dir, []string{cdi.QualifiedName("a", "gpu-50"), cdi.QualifiedName("plain", "gpu-3")}, nil)
	require.NoError(t, err)
	assert.Empty(t, v.Conflicts, "an MPS claim beside a plain one sets nothing twice")
	v, err = ResolveCDI(dir, []string{cdi.QualifiedName("a", "gpu-50"), cdi.QualifiedName("b", "gpu-25"), cdi.QualifiedName("plain", "gpu-3")}, nil)
	require.NoError(t, err)
	assert.Equal(t, []string{"env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "mount /mps"}, v.Conflicts)
}
