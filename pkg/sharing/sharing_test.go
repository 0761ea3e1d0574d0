package sharing

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/api/resource"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/prepared"
)

const h100Memory = 81559 << 20

func gpu(name, uuid string) prepared.Device {
	return prepared.Device{Device: name, UUID: uuid, GPUUUID: uuid, MemoryBytes: h100Memory, Multiprocessors: 132}
}

func newManager(t *testing.T, policy TimeSlicer) (*Manager, string) {
	t.Helper()
	root := t.TempDir()
	m, err := NewManager(Options{Root: root, Policy: policy, MPSControl: ExecMPSControl{Path: standIn(t)}})
	require.NoError(t, err)
	return m, root
}

func standIn(t *testing.T) string {
	p, err := filepath.Abs("../../hack/fake-nvidia-cuda-mps-control")
	require.NoError(t, err)
	return p
}

func TestTimeSlicingIsRestoredWhenTheLastClaimGoes(t *testing.T) {
	machine, err := sim.NewBuiltin("dgx-h100-nomig", "node")
	require.NoError(t, err)
	inv, err := machine.Inventory(context.Background())
	require.NoError(t, err)
	g0, g1 := inv.GPUs[0].UUID, inv.GPUs[1].UUID
	m, _ := newManager(t, machine)
	ctx := context.Background()
	long := prepared.Claim{UID: "a", Name: "a", Devices: []prepared.Device{gpu("gpu-0", g0), gpu("gpu-1", g1)},
		Sharing: &gpuapi.Sharing{Strategy: gpuapi.TimeSlicing, TimeSlicing: &gpuapi.TimeSlicingConfig{Interval: gpuapi.LongTimeSlice}}}
	short := prepared.Claim{UID: "b", Name: "b", Devices: []prepared.Device{gpu("gpu-0", g0)},
		Sharing: &gpuapi.Sharing{Strategy: gpuapi.TimeSlicing, TimeSlicing: &gpuapi.TimeSlicingConfig{Interval: gpuapi.ShortTimeSlice}}}

	_, err = m.Prepare(ctx, long)
	require.NoError(t, err)
	assert.Equal(t, 3, machine.TimeSlice(g0))
	assert.Equal(t, 3, machine.TimeSlice(g1))
	_, err = m.Prepare(ctx, short)
	require.NoError(t, err)
	assert.Equal(t, 1, machine.TimeSlice(g0), "the last claim to set it wins")

	require.NoError(t, m.Unprepare(ctx, long, []prepared.Claim{short}))
	assert.Equal(t, 1, machine.TimeSlice(g0), "still time-sliced for claim b")
	assert.Equal(t, 0, machine.TimeSlice(g1), "restored: no claim left on GPU 1")
	require.NoError(t, m.Unprepare(ctx, short, nil))
	assert.Equal(t, 0, machine.TimeSlice(g0))
}

func TestTimeSlicingRefusesMIGDevices(t *testing.T) {
	machine, err := sim.NewBuiltin("dgx-h100", "node")
	require.NoError(t, err)
	m, _ := newManager(t, machine)
	_, err = m.Prepare(context.Background(), prepared.Claim{UID: "a", Namespace: "ns", Name: "a",
		Devices: []prepared.Device{{Device: "gpu-0-mig-1g-10gb-6", UUID: "MIG-x", GPUUUID: "GPU-x", Mig: true}},
		Sharing: &gpuapi.Sharing{Strategy: gpuapi.TimeSlicing}})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "claim ns/a: TimeSlicing sharing: device gpu-0-mig-1g-10gb-6 is a MIG device")
}

func TestIPCDirectory(t *testing.T) {
	m, root := newManager(t, nil)
	ctx := context.Background()
	c := prepared.Claim{UID: "uid-1", Name: "shared", Devices: []prepared.Device{gpu("gpu-0", "GPU-0")}, Sharing: &gpuapi.Sharing{Strategy: gpuapi.Exclusive, IPC: true}}
	edits, err := m.Prepare(ctx, c)
	require.NoError(t, err)
	dir := filepath.Join(root, "ipc", "uid-1")
	assert.Equal(t, []Mount{{HostPath: dir, ContainerPath: gpuapi.IPCDirectory}}, edits.Mounts)
	assert.Equal(t, gpuapi.IPCDirectory, edits.Env["GPUDRA_IPC_DIR"])
	st, err := os.Stat(dir)
	require.NoError(t, err)
	assert.Equal(t, os.ModeDir|os.ModeSticky|0o777, st.Mode())

	// A second prepare (after a restart) gives the same directory.
	again, err := m.Prepare(ctx, c)
	require.NoError(t, err)
	assert.Equal(t, edits, again)

	// At start, directories of claims that are not prepared go.
	require.NoError(t, os.MkdirAll(filepath.Join(root, "ipc", "stale"), 0o755))
	require.NoError(t, m.Resume(ctx, []prepared.Claim{c}))
	assert.DirExists(t, dir)
	assert.NoDirExists(t, filepath.Join(root, "ipc", "stale"))

	require.NoError(t, m.Unprepare(ctx, c, nil))
	assert.NoDirExists(t, dir)
}

func TestLimitsFor(t *testing.T) {
	q := resource.MustParse
	tests := []struct {
		name    string
		claim   prepared.Claim
		env     map[string]string
		wantErr string
	}{
		{
			name: "limits from the config, per device",
			claim: prepared.Claim{Devices: []prepared.Device{gpu("gpu-0", "GPU-0"), gpu("gpu-1", "GPU-1")}, Sharing: &gpuapi.Sharing{Strategy: gpuapi.MPS,
				MPS: &gpuapi.MPSConfig{ActiveThreadPercentage: ptr[int32](50), PinnedMemoryLimit: ptr(q("40Gi"))}}},
			env: map[string]string{"CUDA_MPS_PIPE_DIRECTORY": MPSPipeDirectory, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
				"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=40960M,1=40960M"},
		},
		{
			name:  "no limits",
			claim: prepared.Claim{Devices: []prepared.Device{gpu("gpu-0", "GPU-0")}, Sharing: &gpuapi.Sharing{Strategy: gpuapi.MPS}},
			env:   map[string]string{"CUDA_MPS_PIPE_DIRECTORY": MPSPipeDirectory},
		},
		{
			name: "a share is capped at its size",
			claim: prepared.Claim{Devices: []prepared.Device{{Device: "gpu-0", UUID: "GPU-0", GPUUUID: "GPU-0", MemoryBytes: 20 << 30, Multiprocessors: 33,
				Share: &prepared.Share{ID: "s1", MemoryBytes: 20 << 30, Multiprocessors: 33, GPUMultiprocessors: 132}}}, Sharing: &gpuapi.Sharing{Strategy: gpuapi.MPS}},
			env: map[string]string{"CUDA_MPS_PIPE_DIRECTORY": MPSPipeDirectory, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
				"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=20480M"},
		},
		{
			name: "a limit above the share",
			claim: prepared.Claim{Devices: []prepared.Device{{Device: "gpu-0", UUID: "GPU-0", GPUUUID: "GPU-0", MemoryBytes: 20 << 30,
				Share: &prepared.Share{ID: "s1", MemoryBytes: 20 << 30}}}, Sharing: &gpuapi.Sharing{Strategy: gpuapi.MPS, MPS: &gpuapi.MPSConfig{PinnedMemoryLimit: ptr(q("40Gi"))}}},
			wantErr: "sharing.mps.pinnedMemoryLimit: 40Gi exceeds the share of device gpu-0 this claim was allocated (20Gi)",
		},
		{
			name: "a limit above the device",
			claim: prepared.Claim{Devices: []prepared.Device{gpu("gpu-0", "GPU-0")}, Sharing: &gpuapi.Sharing{Strategy: gpuapi.MPS,
				MPS: &gpuapi.MPSConfig{PinnedMemoryLimit: ptr(q("80Gi"))}}},
			wantErr: "sharing.mps.pinnedMemoryLimit: 80Gi exceeds the memory of device gpu-0 (81559Mi)",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			l, err := MPSLimitsFor(tc.claim)
			if tc.wantErr != "" {
				require.EqualError(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.env, l.env())
		})
	}
}
