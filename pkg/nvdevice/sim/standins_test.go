package sim

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestDriverStandIns(t *testing.T) {
	m, err := NewBuiltin("dgx-h100-nomig", "standins")
	require.NoError(t, err)
	table := m.DeviceTable()
	lines := strings.Split(strings.TrimSuffix(table, "\n"), "\n")
	require.Len(t, lines, 9, "the CUDA version and 8 GPUs")
	assert.Equal(t, "cuda 12080", lines[0])
	g := m.Devices()[0]
	assert.Equal(t, "gpu 0 0000:18:00.0 "+g.UUID+" 85520809984 NVIDIA H100 80GB HBM3", lines[1])

	dir := t.TempDir()
	lib := filepath.Join(dir, "libcuda.so")
	require.NoError(t, os.WriteFile(lib, []byte("\x7fELF..."), 0o644))
	root := filepath.Join(dir, "root")
	require.NoError(t, m.WriteDriverRoot(root, DriverStandIns{LibCUDA: lib, NvidiaSMI: true}))
	got, err := os.ReadFile(filepath.Join(root, LibDir, "libcuda.so.1"))
	require.NoError(t, err)
	assert.Equal(t, "\x7fELF...\n#gpudra-fakecuda-table v1\n"+table+"#end\n", string(got), "the table after the library's own bytes")
	smi, err := os.ReadFile(filepath.Join(root, BinDir, "nvidia-smi"))
	require.NoError(t, err)
	assert.Contains(t, string(smi), "<<'GPUDRA_DEVICE_TABLE'\n"+table+"GPUDRA_DEVICE_TABLE\n")
	assert.NotContains(t, string(smi), "@TABLE@")

	// What nvcdi's discovery finds is the same set of files as without
	// stand-ins.
	m.SetDriverRoot(root)
	withStandIns, err := m.DriverFiles(context.Background())
	require.NoError(t, err)
	plain := filepath.Join(dir, "plain")
	require.NoError(t, WriteDriverRoot(plain, m.DriverVersion()))
	m.SetDriverRoot(plain)
	without, err := m.DriverFiles(context.Background())
	require.NoError(t, err)
	require.Len(t, withStandIns.Mounts, len(without.Mounts))
	for i := range without.Mounts {
		assert.Equal(t, without.Mounts[i].ContainerPath, withStandIns.Mounts[i].ContainerPath)
	}
}

func TestCUDAVersionNumber(t *testing.T) {
	assert.Equal(t, 12080, cudaVersionNumber("12.8"))
	assert.Equal(t, 13000, cudaVersionNumber("13.0"))
}
