package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	"sigs.k8s.io/yaml"

	"github.com/gpudra/gpudra/internal/version"
	"github.com/gpudra/gpudra/pkg/nvdevice"
)

func run(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := newRootCommand()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs(args)
	err := cmd.ExecuteContext(context.Background())
	return out.String(), err
}

func TestInventoryJSON(t *testing.T) {
	out, err := run(t, "inventory", "--backend", "sim", "--machine", "dgx-h100", "--node-name", "n", "-o", "json")
	require.NoError(t, err)
	var inv nvdevice.Inventory
	dec := json.NewDecoder(strings.NewReader(out))
	dec.DisallowUnknownFields()
	require.NoError(t, dec.Decode(&inv))
	require.Len(t, inv.GPUs, 8)
	for _, g := range inv.GPUs {
		assert.Equal(t, "NVIDIA H100 80GB HBM3", g.ProductName)
		assert.Equal(t, uint64(81559), g.MemoryMiB)
		assert.Equal(t, "9.0", g.CUDAComputeCapability)
		assert.Equal(t, inv.GPUs[0].NVLink.Domain, g.NVLink.Domain)
		assert.Len(t, g.MIG.Profiles, 7)
	}
}

func TestInventoryTable(t *testing.T) {
	out, err := run(t, "inventory", "--backend", "sim", "--machine", "h100-pcie")
	require.NoError(t, err)
	assert.Contains(t, out, "2 GPU(s)")
	assert.Contains(t, out, "NVIDIA H100 PCIe")
	assert.Contains(t, out, "1g.10gb+me")
}

func TestSlicesYAMLDecodesStrictly(t *testing.T) {
	out, err := run(t, "slices", "--backend", "sim", "--machine", "dgx-h100", "--node-name", "node-a", "--mig-devices", "all")
	require.NoError(t, err)
	docs := strings.Split(out, "\n---\n")
	require.Len(t, docs, 5)
	devices := 0
	for _, doc := range docs {
		var s resourceapi.ResourceSlice
		require.NoError(t, yaml.UnmarshalStrict([]byte(doc), &s))
		assert.Equal(t, "ResourceSlice", s.Kind)
		assert.Equal(t, "resource.k8s.io/v1", s.APIVersion)
		assert.Equal(t, "node-a", s.Spec.Pool.Name)
		devices += len(s.Spec.Devices)
	}
	assert.Equal(t, 208, devices)

	// The default, as the plugin's: a DGX H100 in MIG mode with no MIG
	// device made publishes one empty slice.
	out, err = run(t, "slices", "--backend", "sim", "--machine", "dgx-h100", "--node-name", "node-a")
	require.NoError(t, err)
	var s resourceapi.ResourceSlice
	require.NoError(t, yaml.UnmarshalStrict([]byte(out), &s))
	assert.Empty(t, s.Spec.Devices)
	assert.Empty(t, s.Spec.SharedCounters)
}

func TestErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"inventory", "--backend", "nvml", "--driver-root", t.TempDir()}, "NVIDIA driver library not found: looked for libnvidia-ml.so.1 in"},
		{[]string{"inventory", "--backend", "cuda"}, `--backend: unknown backend "cuda"`},
		{[]string{"inventory", "--backend", "sim", "-o", "xml"}, `--output: unknown format "xml"`},
		{[]string{"slices", "--backend", "sim", "--machine", "nope"}, `machine "nope" is neither a built-in machine`},
	} {
		_, err := run(t, tc.args...)
		require.Error(t, err, tc.args)
		assert.Contains(t, err.Error(), tc.want)
		assert.NotContains(t, err.Error(), "\n")
	}
}

func TestVersion(t *testing.T) {
	oldVersion, oldCommit := version.Version, version.Commit
	version.Version, version.Commit = "v9.9.9", "0123abc"
	t.Cleanup(func() { version.Version, version.Commit = oldVersion, oldCommit })
	for _, args := range [][]string{{"version"}, {"--version"}} {
		out, err := run(t, args...)
		require.NoError(t, err, args)
		assert.Regexp(t, `^gpudra v9\.9\.9 \(commit 0123abc, go\S+ \w+/\w+\)\n$`, out, args)
	}
}
