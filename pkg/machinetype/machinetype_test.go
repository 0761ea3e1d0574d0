package machinetype

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

func TestTypes(t *testing.T) {
	tests := []struct {
		name, product string
		gpus          int
		migMachine    string
	}{
		{"p5.48xlarge", "NVIDIA H100 80GB HBM3", 8, "dgx-h100"},
		{"a3-highgpu-8g", "NVIDIA H100 80GB HBM3", 8, "dgx-h100"},
		{"Standard_ND96isr_H100_v5", "NVIDIA H100 80GB HBM3", 8, "dgx-h100"},
		{"p5e.48xlarge", "NVIDIA H200", 8, "hgx-h200"},
		{"p5en.48xlarge", "NVIDIA H200", 8, "hgx-h200"},
		{"a3-ultragpu-8g", "NVIDIA H200", 8, "hgx-h200"},
		{"h100-pcie-nvlink", "NVIDIA H100 PCIe", 4, ""},
	}
	for _, tt := range tests {
		typ, err := Lookup(tt.name)
		require.NoError(t, err)
		assert.Equal(t, tt.gpus, typ.GPUs, tt.name)
		assert.Equal(t, tt.product, typ.GPUProduct, tt.name)
		m, err := typ.Machine(true)
		if tt.migMachine == "" {
			assert.ErrorContains(t, err, "no MIG mode variant", tt.name)
			continue
		}
		require.NoError(t, err)
		assert.Equal(t, tt.migMachine, m)
	}
	_, err := Lookup("p4d.24xlarge")
	assert.ErrorContains(t, err, `unknown machine type "p4d.24xlarge": known are p5.48xlarge, a3-highgpu-8g`)
}

// TestSlicesOfAFreshNodeOnly: options only a running node has are refused.
func TestSlicesOfAFreshNodeOnly(t *testing.T) {
	typ, err := Lookup("p5.48xlarge")
	require.NoError(t, err)
	_, err = Slices(context.Background(), typ, false, "n", slicebuilder.Options{ManagedMigDevices: map[string]bool{"MIG-x": true}})
	assert.ErrorIs(t, err, ErrNotFresh)
}
