package sharing

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestNvidiaSMISetTimeSlice(t *testing.T) {
	dir := t.TempDir()
	args := filepath.Join(dir, "args")
	bin := filepath.Join(dir, "nvidia-smi")
	require.NoError(t, os.WriteFile(bin, []byte("#!/bin/sh\necho \"$@ lib=$LD_LIBRARY_PATH\" > "+args+"\n[ \"$3\" = GPU-bad ] && { echo 'No devices were found' >&2; exit 6; }\nexit 0\n"), 0o755))

	smi := NvidiaSMI{Path: bin, Env: []string{"LD_LIBRARY_PATH=/run/nvidia/driver/usr/lib64"}}
	require.NoError(t, smi.SetTimeSlice(context.Background(), "GPU-1", 3))
	got, err := os.ReadFile(args)
	require.NoError(t, err)
	assert.Equal(t, "compute-policy -i GPU-1 --set-timeslice 3 lib=/run/nvidia/driver/usr/lib64\n", string(got), "the driver root's libraries are on its path")

	err = NvidiaSMI{Path: bin}.SetTimeSlice(context.Background(), "GPU-bad", 1)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "--set-timeslice 1: exit status 6: No devices were found")
}
