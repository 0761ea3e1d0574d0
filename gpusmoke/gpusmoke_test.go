package gpusmoke

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

func TestListedUUIDs(t *testing.T) {
	for _, tc := range []struct {
		name, out string
		want      []string
	}{
		{name: "one GPU", out: "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-3f9a1c2e-5b7d-4e8f-9a0b-1c2d3e4f5a6b)\n",
			want: []string{"GPU-3f9a1c2e-5b7d-4e8f-9a0b-1c2d3e4f5a6b"}},
		{name: "a GPU and its MIG device", out: "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aa)\n  MIG 1g.10gb     Device  0: (UUID: MIG-bb)\n",
			want: []string{"GPU-aa", "MIG-bb"}},
		{name: "none", out: "No devices were found\n"},
		{name: "nvidia-smi failed", out: "Failed to initialize NVML: Unknown Error\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, ListedUUIDs(tc.out))
		})
	}
}

func TestCompareDevicesMarksDifferences(t *testing.T) {
	str := func(s string) resourceapi.DeviceAttribute { return resourceapi.DeviceAttribute{StringValue: &s} }
	ver := func(s string) resourceapi.DeviceAttribute { return resourceapi.DeviceAttribute{VersionValue: &s} }
	a := resourceapi.Device{Name: "gpu-0",
		Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"productName": str("NVIDIA H100 80GB HBM3"), "uuid": str("GPU-a"),
			"driverVersion": ver("580.159.4"), "cudaDriverVersion": ver("13.0.0")},
		Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{"memory": {Value: resource.MustParse("80Gi")}}}
	b := resourceapi.Device{Name: "gpu-0",
		Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"productName": str("NVIDIA H100 80GB HBM3"), "uuid": str("GPU-b"),
			"driverVersion": ver("570.172.8"), "cudaDriverVersion": ver("13.0.0"), "extra": str("x"), "nvlinkDomain": str("nvlink-b")},
		Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{"memory": {Value: resource.MustParse("79Gi")}}}
	rows, defects, expected := CompareDevices(a, b)
	marked := map[string]string{}
	for _, r := range rows {
		marked[r.Name] = r.Mark
	}
	assert.Equal(t, map[string]string{
		"attribute productName":       "",
		"attribute cudaDriverVersion": "",
		"attribute uuid":              "~",
		"attribute driverVersion":     "~",
		"attribute nvlinkDomain":      "~",
		"attribute extra":             "*",
		"capacity memory":             "*",
	}, marked)
	assert.Equal(t, 2, defects)
	assert.Equal(t, 3, expected)
}

// compareLines runs Compare and returns its rows marked as defects and as
// expected differences, and its summary line.
func compareLines(t *testing.T, inv *nvdevice.Inventory) (out string, defects, expected []string, summary string) {
	t.Helper()
	var buf bytes.Buffer
	require.NoError(t, Compare(context.Background(), &buf, inv))
	for _, line := range strings.Split(buf.String(), "\n") {
		switch {
		case strings.HasPrefix(line, "*"):
			defects = append(defects, strings.Fields(line)[2])
		case strings.HasPrefix(line, "~"):
			expected = append(expected, strings.Fields(line)[2])
		case strings.Contains(line, " defect(s) ("):
			summary = line
		}
	}
	return buf.String(), defects, expected, summary
}

// The simulator compared with its own model of the same product differs
// only in what identifies one GPU, all marked as expected: the comparison
// does not invent defects, and names the model.
func TestCompareWithTheSimulatorItself(t *testing.T) {
	for _, tc := range []struct{ machine, model string }{
		{"dgx-h100-nomig", "dgx-h100-nomig"},
		// A PCIe H100 with MIG mode off beside h100-pcie, whose GPUs are in
		// MIG mode: compared with MIG mode off.
		{"h100-pcie-nvlink", "h100-pcie"},
		{"hgx-h200-nomig", "hgx-h200-nomig"},
	} {
		t.Run(tc.machine, func(t *testing.T) {
			m, err := sim.NewBuiltin(tc.machine, "another-node")
			require.NoError(t, err)
			inv, err := m.Inventory(context.Background())
			require.NoError(t, err)
			out, defects, expected, summary := compareLines(t, inv)
			assert.Contains(t, out, "the simulator's "+tc.model+" GPU 0")
			assert.Empty(t, defects, out)
			assert.Subset(t, []string{"uuid", "nvlinkDomain"}, expected, out)
			assert.Regexp(t, `^0 defect\(s\) \(\*\), \d+ expected difference\(s\) \(~`, summary)
		})
	}
}

// The real GPUs gpudra saw through NVML (testdata/real-gpus: copies of
// ../shared/real-gpus/*/inventory.json) beside their models: no defect,
// and the rows that must differ marked so. The captures ran another driver
// than the model's, in a VM (no NUMA node, no NVLink).
func TestCompareWithRealGPUs(t *testing.T) {
	for _, tc := range []struct {
		capture, machine string
	}{
		{"h200", "hgx-h200-nomig"},
		{"h100-80gb-hbm3", "dgx-h100-nomig"},
	} {
		t.Run(tc.capture, func(t *testing.T) {
			b, err := os.ReadFile(filepath.Join("testdata", "real-gpus", tc.capture, "inventory.json"))
			require.NoError(t, err)
			var inv nvdevice.Inventory
			require.NoError(t, json.Unmarshal(b, &inv))
			out, defects, expected, summary := compareLines(t, &inv)
			assert.Contains(t, out, "the simulator's "+tc.machine+" GPU 0")
			assert.Empty(t, defects, out)
			assert.ElementsMatch(t, []string{"cudaDriverVersion", "driverVersion", "nvlinkDomain", "resource.kubernetes.io/numaNode",
				"resource.kubernetes.io/pciBusID", "uuid"}, expected, out)
			assert.Regexp(t, `^0 defect\(s\) \(\*\), 6 expected difference\(s\)`, summary)
		})
	}
}

// A changed figure is a defect, not an expected difference.
func TestCompareFindsADefect(t *testing.T) {
	m, err := sim.NewBuiltin("hgx-h200-nomig", "n")
	require.NoError(t, err)
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	inv.GPUs[0].MemoryMiB--
	out, defects, _, summary := compareLines(t, inv)
	assert.Equal(t, []string{"memory"}, defects, out)
	assert.Regexp(t, `^1 defect\(s\) \(\*\)`, summary)
}

func TestSimMachineFor(t *testing.T) {
	for product, want := range map[string]string{
		"NVIDIA H100 80GB HBM3": "dgx-h100-nomig",
		"NVIDIA H100 PCIe":      "h100-pcie",
		"NVIDIA H200":           "hgx-h200-nomig",
		"NVIDIA H100 NVL":       "",
		"NVIDIA H200 NVL":       "",
		"NVIDIA GH200 480GB":    "",
		"NVIDIA A100-SXM4-80GB": "",
	} {
		assert.Equal(t, want, SimMachineFor(product), product)
		if want != "" {
			_, err := sim.LookupSpec(want)
			assert.NoError(t, err, "a built-in machine")
		}
	}
}
