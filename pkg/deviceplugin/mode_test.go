package deviceplugin

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/plugin/checkpoint"
	"github.com/gpudra/gpudra/pkg/prepared"
)

func TestCheckDRADrained(t *testing.T) {
	claims := func(n int) map[string]prepared.Claim {
		out := map[string]prepared.Claim{}
		for i := range n {
			out[fmt.Sprintf("uid-%02d", i)] = prepared.Claim{Namespace: "ns", Name: fmt.Sprintf("claim-%02d", i), State: prepared.PrepareCompleted}
		}
		return out
	}
	tests := []struct {
		name  string
		write func(t *testing.T, path string) // nil: no checkpoint
		want  []string                        // nil: drained
		not   []string
	}{
		{name: "no checkpoint: drained"},
		{name: "no claims: drained", write: store(checkpoint.New("boot"))},
		{name: "one prepared claim", write: store(&checkpoint.Checkpoint{Version: 1, BootID: "boot", Claims: map[string]prepared.Claim{
			"u1": {Namespace: "team-a", Name: "train", State: prepared.PrepareCompleted}}}),
			want: []string{"device plugin mode refused", DRACheckpointFile, "holds 1 prepared claim(s): team-a/train (u1); " + DrainAdvice}},
		{name: "a half-prepared claim counts", write: store(&checkpoint.Checkpoint{Version: 1, BootID: "boot", Claims: map[string]prepared.Claim{
			"u2": {Namespace: "team-a", Name: "half", State: prepared.PrepareStarted}}}),
			want: []string{"team-a/half (u2) PrepareStarted"}},
		{name: "a claim from an earlier boot counts", write: store(&checkpoint.Checkpoint{Version: 1, BootID: "old-boot", Claims: claims(1)}),
			want: []string{"ns/claim-00 (uid-00)"}},
		{name: "ten claims are all named", write: store(&checkpoint.Checkpoint{Version: 1, BootID: "boot", Claims: claims(10)}),
			want: []string{"holds 10 prepared", "ns/claim-00 (uid-00)", "ns/claim-09 (uid-09); drain"}, not: []string{"more"}},
		{name: "twelve claims: ten named and 2 more", write: store(&checkpoint.Checkpoint{Version: 1, BootID: "boot", Claims: claims(12)}),
			want: []string{"holds 12 prepared", "ns/claim-09 (uid-09) and 2 more; drain"}, not: []string{"claim-10", "claim-11"}},
		{name: "corrupt: an error naming the file", write: raw(`{"checksum":1,"data":{}}`),
			want: []string{DRACheckpointFile + " cannot be read", "checkpoint is corrupt", DrainAdvice}},
		{name: "not JSON", write: raw(`garbage`), want: []string{"cannot be read"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, DRACheckpointFile)
			if tc.write != nil {
				tc.write(t, path)
			}
			before, _ := os.ReadFile(path)
			err := CheckDRADrained(dir)
			if tc.want == nil {
				assert.NoError(t, err)
			} else {
				require.Error(t, err)
				for _, w := range tc.want {
					assert.Contains(t, err.Error(), w)
				}
				assert.Contains(t, err.Error(), path, "the error names the file")
				for _, n := range tc.not {
					assert.NotContains(t, err.Error(), n)
				}
			}
			after, _ := os.ReadFile(path)
			assert.Equal(t, before, after, "read only: the checkpoint is left as it was")
			entries, err := os.ReadDir(dir)
			require.NoError(t, err)
			assert.LessOrEqual(t, len(entries), 1, "nothing moved aside or written")
		})
	}
}

func TestCheckDRADrainedUnreadable(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.Mkdir(filepath.Join(dir, DRACheckpointFile), 0o755)) // a directory: read fails
	err := CheckDRADrained(dir)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "read the DRA checkpoint "+filepath.Join(dir, DRACheckpointFile))
}

func store(cp *checkpoint.Checkpoint) func(t *testing.T, path string) {
	return func(t *testing.T, path string) {
		t.Helper()
		b, err := checkpoint.Marshal(cp)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(path, b, 0o600))
	}
}

func raw(s string) func(t *testing.T, path string) {
	return func(t *testing.T, path string) {
		t.Helper()
		require.NoError(t, os.WriteFile(path, []byte(s), 0o600))
	}
}

// A kubelet device manager checkpoint as the kubelet writes it (DeviceIDs
// by NUMA node, AllocResp base64), with an entry of another vendor.
const kubeletCP = `{"Data":{"PodDeviceEntries":[
 {"PodUID":"pod-1","ContainerName":"main","ResourceName":"nvidia.com/gpu","DeviceIDs":{"0":["gpu-0","gpu-1"]},"AllocResp":"CgA="},
 {"PodUID":"pod-1","ContainerName":"side","ResourceName":"nvidia.com/gpu","DeviceIDs":{"0":["gpu-2"]},"AllocResp":"CgA="},
 {"PodUID":"pod-2","ContainerName":"main","ResourceName":"nvidia.com/mig-1g.10gb","DeviceIDs":{"-1":["mig-a"]},"AllocResp":"CgA="},
 {"PodUID":"pod-3","ContainerName":"main","ResourceName":"example.com/fpga","DeviceIDs":{"0":["f0"]},"AllocResp":"CgA="}],
 "RegisteredDevices":{"nvidia.com/gpu":["gpu-0","gpu-1","gpu-2"]},"Future":true},"Checksum":2863311530}`

// Before Kubernetes 1.20 DeviceIDs was a list.
const kubeletCPv1 = `{"Data":{"PodDeviceEntries":[{"PodUID":"old-pod","ContainerName":"c","ResourceName":"nvidia.com/gpu","DeviceIDs":["gpu-0"],"AllocResp":null}],"RegisteredDevices":{}},"Checksum":1}`

// Where the pod-resources socket does not exist, the kubelet's checkpoint
// is read, and the error says so.
func TestCheckDevicePluginDrainedFromCheckpoint(t *testing.T) {
	gpuAndMig := []string{"nvidia.com/gpu", "nvidia.com/mig-*"}
	fallback := "the kubelet's pod-resources socket"
	tests := []struct {
		name      string
		content   string // "": no file
		resources []string
		want      []string // nil: drained
		not       []string
	}{
		{name: "no checkpoint: drained", resources: gpuAndMig},
		{name: "no entries", content: `{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{"nvidia.com/gpu":["a"]}},"Checksum":1}`, resources: gpuAndMig},
		{name: "only other resources", content: kubeletCP, resources: []string{"example.com/gpu"}},
		{name: "GPUs and MIG devices", content: kubeletCP, resources: gpuAndMig,
			want: []string{"DRA mode refused", "records 2 pod(s) holding GPUs through a device plugin: pod UID pod-1 (nvidia.com/gpu), pod UID pod-2 (nvidia.com/mig-1g.10gb);",
				"before switching the node to DRA mode", "nvidia.com/gpu, nvidia.com/mig-*", fallback, "does not exist, so its checkpoint was read instead",
				"keeps a deleted pod's entry"},
			not: []string{"pod-3", "fpga"}},
		{name: "exact names only: MIG not ours", content: kubeletCP, resources: []string{"nvidia.com/gpu"},
			want: []string{"records 1 pod(s) holding GPUs through a device plugin: pod UID pod-1 (nvidia.com/gpu)"}, not: []string{"pod-2"}},
		{name: "a prefix does not match the plain GPU", content: kubeletCP, resources: []string{"nvidia.com/mig-*"},
			want: []string{"records 1 pod(s) holding GPUs through a device plugin: pod UID pod-2 (nvidia.com/mig-1g.10gb)"}, not: []string{"pod-1"}},
		{name: "the old list form of DeviceIDs", content: kubeletCPv1, resources: gpuAndMig, want: []string{"pod UID old-pod (nvidia.com/gpu)"}},
		{name: "not JSON: an error naming the file", content: `{"Data":`, resources: gpuAndMig, want: []string{"kubelet_internal_checkpoint cannot be read"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, "kubelet_internal_checkpoint")
			if tc.content != "" {
				require.NoError(t, os.WriteFile(path, []byte(tc.content), 0o600))
			}
			h := DeviceHolders{PodResourcesSocket: filepath.Join(dir, "pod-resources", "kubelet.sock"), KubeletCheckpoint: path}
			err := CheckDevicePluginDrained(context.Background(), h, tc.resources)
			if tc.want == nil {
				assert.NoError(t, err)
				return
			}
			require.Error(t, err)
			assert.Contains(t, err.Error(), path)
			for _, w := range tc.want {
				assert.Contains(t, err.Error(), w)
			}
			for _, n := range tc.not {
				assert.NotContains(t, err.Error(), n)
			}
		})
	}
}

func TestCheckDevicePluginDrainedManyPods(t *testing.T) {
	entries := ""
	for i := range 13 {
		if i > 0 {
			entries += ","
		}
		entries += fmt.Sprintf(`{"PodUID":"pod-%02d","ContainerName":"c","ResourceName":"nvidia.com/gpu","DeviceIDs":{"0":["g"]}}`, i)
	}
	path := filepath.Join(t.TempDir(), "cp")
	require.NoError(t, os.WriteFile(path, []byte(`{"Data":{"PodDeviceEntries":[`+entries+`]},"Checksum":0}`), 0o600))
	err := CheckDevicePluginDrained(context.Background(), DeviceHolders{KubeletCheckpoint: path}, []string{"nvidia.com/gpu"})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "records 13 pod(s)")
	assert.Contains(t, err.Error(), "pod UID pod-09 (nvidia.com/gpu) and 3 more;")
	assert.NotContains(t, err.Error(), "pod-10")
}

func TestOurResourceNames(t *testing.T) {
	assert.Equal(t, []string{"nvidia.com/gpu", "nvidia.com/mig-*"}, OurResourceNames("", nil))
	assert.Equal(t, []string{"example.com/gpu", "nvidia.com/mig-*"}, OurResourceNames("example.com/gpu", nil))
	cfg, err := ParseConfig([]byte(`
version: v1
sharing:
  timeSlicing:
    renameByDefault: true
    resources:
    - name: gpu
      replicas: 4
    - name: mig-1g.10gb
      rename: mig-small
      replicas: 2
`))
	require.NoError(t, err)
	assert.Equal(t, []string{"nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-*", "nvidia.com/mig-small"},
		OurResourceNames("nvidia.com/gpu", cfg))
}

// DRA mode removes what the device plugin mode left in the CDI directory,
// and nothing else.
func TestRemoveCDISpecs(t *testing.T) {
	dir := t.TempDir()
	w, err := cdi.NewWriter(dir)
	require.NoError(t, err)
	uids := []string{SpecUID, MPSSpecUID("gpu-0"), MPSSpecUID("gpu-7"), "7f3c-claim-uid"}
	for i, uid := range uids {
		spec, err := cdi.BuildSpec(cdi.Claim{UID: uid, Devices: []prepared.Device{specDevice(fmt.Sprintf("gpu-%d", i), fmt.Sprintf("GPU-%d", i))}},
			cdi.Majors{NVIDIA: 195})
		require.NoError(t, err)
		require.NoError(t, w.Write(uid, spec))
	}
	require.NoError(t, RemoveCDISpecs(context.Background(), dir))
	left, err := w.ClaimUIDs()
	require.NoError(t, err)
	assert.Equal(t, []string{"7f3c-claim-uid"}, left)
	require.NoError(t, RemoveCDISpecs(context.Background(), dir), "again: nothing to do")
}
