package cdi

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/gpudra/gpudra/pkg/prepared"
)

var majors = Majors{NVIDIA: 195, UVM: 508, Caps: 511}

func claimA() Claim {
	return Claim{UID: "uid-a", Devices: []prepared.Device{
		{Device: "gpu-3", UUID: "GPU-aaa", Nodes: []prepared.DeviceNode{GPUNode(majors, 3)}},
		{Device: "gpu-0-mig-3g-40gb-4", UUID: "MIG-bbb", Nodes: []prepared.DeviceNode{GPUNode(majors, 0), CapNode(majors, 30), CapNode(majors, 31)}},
	}, Env: map[string]string{"CUDA_MPS_PIPE_DIRECTORY": "/mps"}}
}

// inject resolves CDI ids the way a container runtime does.
func inject(t *testing.T, dir string, ids ...string) *oci.Spec {
	t.Helper()
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(dir), cdiapi.WithAutoRefresh(false))
	require.NoError(t, err)
	require.NoError(t, cache.Refresh())
	spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
	unresolved, err := cache.InjectDevices(spec, ids...)
	require.NoError(t, err, "unresolved: %v", unresolved)
	return spec
}

func nodePaths(s *oci.Spec) map[string]oci.LinuxDevice {
	out := map[string]oci.LinuxDevice{}
	for _, d := range s.Linux.Devices {
		out[d.Path] = d
	}
	return out
}

func TestSpecResolvesIntoOCI(t *testing.T) {
	dir := t.TempDir()
	w, err := NewWriter(dir)
	require.NoError(t, err)
	for _, c := range []Claim{claimA(), {UID: "uid-other", Devices: []prepared.Device{{Device: "gpu-5", UUID: "GPU-other", Nodes: []prepared.DeviceNode{GPUNode(majors, 5)}}}}} {
		spec, err := BuildSpec(c, majors)
		require.NoError(t, err)
		require.NoError(t, w.Write(c.UID, spec))
	}

	oci := inject(t, dir, QualifiedName("uid-a", "gpu-3"), QualifiedName("uid-a", "gpu-0-mig-3g-40gb-4"))
	assert.ElementsMatch(t, []string{
		"NVIDIA_VISIBLE_DEVICES=void",
		"GPUDRA_DEVICE_UID_A_GPU_3_UUID=GPU-aaa",
		"GPUDRA_DEVICE_UID_A_GPU_0_MIG_3G_40GB_4_UUID=MIG-bbb",
		"CUDA_MPS_PIPE_DIRECTORY=/mps",
	}, oci.Process.Env)
	nodes := nodePaths(oci)
	for path, want := range map[string][2]int64{
		"/dev/nvidiactl": {195, 255}, "/dev/nvidia-uvm": {508, 0}, "/dev/nvidia-uvm-tools": {508, 1},
		"/dev/nvidia3": {195, 3}, "/dev/nvidia0": {195, 0},
		"/dev/nvidia-caps/nvidia-cap30": {511, 30}, "/dev/nvidia-caps/nvidia-cap31": {511, 31},
	} {
		d, ok := nodes[path]
		require.True(t, ok, "missing %s", path)
		assert.Equal(t, "c", d.Type)
		assert.Equal(t, want[0], d.Major, path)
		assert.Equal(t, want[1], d.Minor, path)
	}
	assert.NotContains(t, nodes, "/dev/nvidia5", "another claim's GPU never appears")
	assert.Len(t, nodes, 7)
	for _, e := range oci.Process.Env {
		assert.NotContains(t, e, "GPU-other")
	}
}

func TestRemove(t *testing.T) {
	dir := t.TempDir()
	w, err := NewWriter(dir)
	require.NoError(t, err)
	spec, err := BuildSpec(claimA(), majors)
	require.NoError(t, err)
	require.NoError(t, w.Write("uid-a", spec))
	assert.True(t, w.Exists("uid-a"))
	require.NoError(t, w.Remove("uid-a"))
	assert.False(t, w.Exists("uid-a"))
	require.NoError(t, w.Remove("uid-a"), "removing twice is fine")
}

// writeLegacySpec writes a claim's spec as gpudra wrote it before claim
// specs were JSON: YAML, the CDI library's default encoding.
func writeLegacySpec(t *testing.T, dir string, c Claim) {
	t.Helper()
	spec, err := BuildSpec(c, majors)
	require.NoError(t, err)
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(dir), cdiapi.WithAutoRefresh(false))
	require.NoError(t, err)
	require.NoError(t, cache.WriteSpec(spec, SpecName(c.UID)))
	require.FileExists(t, filepath.Join(dir, SpecName(c.UID)+".yaml"))
}

// TestWriteWritesJSON: a claim's spec is JSON, in a file named for it with
// the .json extension, which the CDI library reads back.
func TestWriteWritesJSON(t *testing.T) {
	dir := t.TempDir()
	w, err := NewWriter(dir)
	require.NoError(t, err)
	spec, err := BuildSpec(claimA(), majors)
	require.NoError(t, err)
	require.NoError(t, w.Write("uid-a", spec))

	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Len(t, entries, 1)
	assert.Equal(t, SpecName("uid-a")+".json", entries[0].Name())
	b, err := os.ReadFile(filepath.Join(dir, entries[0].Name()))
	require.NoError(t, err)
	var back map[string]any
	require.NoError(t, json.Unmarshal(b, &back), "the spec is JSON")
	assert.Equal(t, Vendor+"/"+Class, back["kind"])
	oci := inject(t, dir, QualifiedName("uid-a", "gpu-3"))
	assert.Contains(t, nodePaths(oci), "/dev/nvidia3")
}

// TestWriteReplacesTheClaimsYAMLSpec: a node upgraded from a version that
// wrote YAML specs may hold one for the claim being written; both would
// define the same CDI devices, which the CDI library refuses as a conflict,
// so the old one goes.
func TestWriteReplacesTheClaimsYAMLSpec(t *testing.T) {
	dir := t.TempDir()
	writeLegacySpec(t, dir, claimA())
	w, err := NewWriter(dir)
	require.NoError(t, err)
	spec, err := BuildSpec(claimA(), majors)
	require.NoError(t, err)
	require.NoError(t, w.Write("uid-a", spec))

	assert.NoFileExists(t, filepath.Join(dir, SpecName("uid-a")+".yaml"))
	oci := inject(t, dir, QualifiedName("uid-a", "gpu-3"), QualifiedName("uid-a", "gpu-0-mig-3g-40gb-4"))
	assert.Len(t, nodePaths(oci), 7)
}

// TestYAMLSpecsOfAnEarlierVersionAreFoundAndRemoved: what a node kept from
// a version that wrote YAML is still the claim's spec: found, listed and
// removed (unprepare, the sweep at start).
func TestYAMLSpecsOfAnEarlierVersionAreFoundAndRemoved(t *testing.T) {
	dir := t.TempDir()
	writeLegacySpec(t, dir, claimA())
	writeLegacySpec(t, dir, Claim{UID: "uid-b", Devices: []prepared.Device{{Device: "gpu-1", UUID: "GPU-b"}}})
	w, err := NewWriter(dir)
	require.NoError(t, err)
	spec, err := BuildSpec(Claim{UID: "uid-b", Devices: []prepared.Device{{Device: "gpu-1", UUID: "GPU-b"}}}, majors)
	require.NoError(t, err)
	// Both encodings of uid-b, as a kill between the two steps of Write
	// would leave them.
	require.NoError(t, w.cache.WriteSpec(spec, SpecName("uid-b")+".json"))

	uids, err := w.ClaimUIDs()
	require.NoError(t, err)
	assert.ElementsMatch(t, []string{"uid-a", "uid-b"}, uids, "each claim once")
	assert.True(t, w.Exists("uid-a"))
	require.NoError(t, w.Remove("uid-a"))
	require.NoError(t, w.Remove("uid-b"))
	assert.False(t, w.Exists("uid-a"))
	assert.False(t, w.Exists("uid-b"))
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	assert.Empty(t, entries)
}

func TestBuildSpecErrors(t *testing.T) {
	_, err := BuildSpec(Claim{}, majors)
	require.EqualError(t, err, "claim UID is empty")
	_, err = BuildSpec(Claim{UID: "u", Devices: []prepared.Device{{Device: "gpu-1"}}}, majors)
	require.EqualError(t, err, "claim u: device gpu-1 has no UUID")
	for _, k := range []string{"NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "GPUDRA_DEVICE_U_GPU_1_UUID"} {
		_, err = BuildSpec(Claim{UID: "u", Devices: []prepared.Device{{Device: "gpu-1", UUID: "GPU-1"}}, Env: map[string]string{k: "x"}}, majors)
		require.EqualError(t, err, "claim u: sharing may not set "+k+": the device nodes decide what a container sees")
	}
	_, err = BuildSpec(Claim{UID: "u", Devices: []prepared.Device{{Device: "gpu.1", UUID: "GPU-1"}, {Device: "gpu-1", UUID: "GPU-2"}}}, majors)
	require.EqualError(t, err, "claim u: devices gpu.1 and gpu-1 would share the variable GPUDRA_DEVICE_U_GPU_1_UUID")
}

func TestClaimUIDs(t *testing.T) {
	dir := t.TempDir()
	w, err := NewWriter(dir)
	require.NoError(t, err)
	for _, c := range []Claim{claimA(), {UID: "uid-b", Devices: []prepared.Device{{Device: "gpu-1", UUID: "GPU-b"}}}} {
		spec, err := BuildSpec(c, majors)
		require.NoError(t, err)
		require.NoError(t, w.Write(c.UID, spec))
	}
	require.NoError(t, os.WriteFile(filepath.Join(dir, "other-vendor.json"), []byte("{}"), 0o644))
	uids, err := w.ClaimUIDs()
	require.NoError(t, err)
	assert.ElementsMatch(t, []string{"uid-a", "uid-b"}, uids)
}
