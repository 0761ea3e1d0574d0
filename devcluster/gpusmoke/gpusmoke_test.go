package gpusmoke

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"

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
	a := resourceapi.Device{Name: "gpu-0",
		Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"productName": str("NVIDIA H100 80GB HBM3"), "uuid": str("GPU-a")},
		Capacity:   map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{"memory": {Value: resource.MustParse("80Gi")}}}
	b := resourceapi.Device{Name: "gpu-0",
		Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"productName": str("NVIDIA H100 80GB HBM3"), "uuid": str("GPU-b"), "extra": str("x")},
		Capacity:   map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{"memory": {Value: resource.MustParse("79Gi")}}}
	rows, differ := CompareDevices(a, b)
	marked := map[string]string{}
	for _, r := range rows {
		marked[r.Name] = r.Mark
	}
	assert.Equal(t, map[string]string{"attribute productName": "", "attribute uuid": "*", "attribute extra": "*", "capacity memory": "*"}, marked)
	assert.Equal(t, 3, differ)
}

// The simulator compared with its own model of the same product differs
// only in what identifies one GPU: the comparison does not invent
// differences, and names the model.
func TestCompareWithTheSimulatorItself(t *testing.T) {
	m, err := sim.NewBuiltin("dgx-h100-nomig", "another-node")
	require.NoError(t, err)
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	var out bytes.Buffer
	require.NoError(t, Compare(context.Background(), &out, inv))
	assert.Contains(t, out.String(), "the simulator's dgx-h100-nomig GPU 0")
	for _, line := range bytes.Split(out.Bytes(), []byte("\n")) {
		if bytes.HasPrefix(line, []byte("*")) {
			assert.Regexp(t, `^\*\s+attribute (uuid|serial|pciBusID|nvlinkDomain)\s`, string(line), "only identity differs")
		}
	}
	assert.Equal(t, "h100-pcie", SimMachineFor("NVIDIA H100 PCIe"))
	assert.Equal(t, "", SimMachineFor("NVIDIA A100-SXM4-80GB"))
}
