package main

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	"sigs.k8s.io/yaml"

	"github.com/gpudra/gpudra/pkg/machinetype"
)

// TestSlicesAsKarpenterTemplates: -o karpenter prints a machine type's
// fresh-node slices as an autoscaler's templates: node-specific attributes
// left out, devices and counters in separate templates, the policy named;
// an unknown type is refused naming the flag and the known types.
func TestSlicesAsKarpenterTemplates(t *testing.T) {
	tests := []struct {
		args           []string
		gpus, counters int
		migDevices     string
	}{
		{args: []string{"--machine", "p5.48xlarge"}, gpus: 8, migDevices: "existing"},
		{args: []string{"--machine", "a3-ultragpu-8g", "--mig-mode", "--mig-devices", "all"}, gpus: 8 * 26, counters: 8, migDevices: "all"},
		{args: []string{"--machine", "p5e.48xlarge", "--mig-mode"}, migDevices: "existing"}, // a fresh node has no MIG device
		{args: []string{"--machine", "h100-pcie-nvlink"}, gpus: 4, migDevices: "existing"},
	}
	for _, tt := range tests {
		out, err := run(t, append([]string{"slices", "-o", "karpenter"}, tt.args...)...)
		require.NoError(t, err, "%v", tt.args)
		var got machinetype.Templates
		require.NoError(t, yaml.UnmarshalStrict([]byte(out), &got), out)
		assert.Equal(t, tt.migDevices, got.MIGDevices)
		devices, counters := 0, 0
		for _, tmpl := range got.ResourceSliceTemplates {
			assert.Equal(t, "gpu.gpudra.dev", tmpl.Driver)
			assert.False(t, len(tmpl.Devices) > 0 && len(tmpl.SharedCounters) > 0, "devices and counters in separate templates")
			devices += len(tmpl.Devices)
			counters += len(tmpl.SharedCounters)
			for _, d := range tmpl.Devices {
				for _, a := range machinetype.NodeSpecificAttributes {
					assert.NotContains(t, d.Attributes, a, "%v: %s", tt.args, d.Name)
				}
				// A GPU in MIG mode has no NVLink peer-to-peer, and no domain.
				if typ := d.Attributes["type"].StringValue; typ != nil && *typ == "gpu" && !got.MIGMode {
					assert.Contains(t, d.Attributes, resourceapi.QualifiedName("nvlinkDomain"), "%v: %s: matchAttribute on the NVLink domain works before the node exists", tt.args, d.Name)
				}
			}
		}
		assert.Equal(t, tt.gpus, devices, "%v", tt.args)
		assert.Equal(t, tt.counters, counters, "%v", tt.args)
	}
	_, err := run(t, "slices", "-o", "karpenter", "--machine", "p4d.24xlarge")
	require.Error(t, err)
	assert.Contains(t, err.Error(), `--machine: unknown machine type "p4d.24xlarge": known are p5.48xlarge`)
}
