package drivertools

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fakeSMI writes a stand-in nvidia-smi at bin that records its arguments
// and LD_LIBRARY_PATH in args, and fails for GPU-bad as nvidia-smi does.
func fakeSMI(t *testing.T, bin, args string) {
	t.Helper()
	require.NoError(t, os.MkdirAll(filepath.Dir(bin), 0o755))
	require.NoError(t, os.WriteFile(bin, []byte("#!/bin/sh\necho \"$@ lib=$LD_LIBRARY_PATH\" > "+args+"\n[ \"$3\" = GPU-bad ] && { echo 'No devices were found' >&2; exit 6; }\nexit 0\n"), 0o755))
}

func TestNvidiaSMISetTimeSlice(t *testing.T) {
	dir := t.TempDir()
	args := filepath.Join(dir, "args")
	bin := filepath.Join(dir, "nvidia-smi")
	fakeSMI(t, bin, args)
	t.Setenv("LD_LIBRARY_PATH", "/run/nvidia/driver/usr/lib64")

	smi := NvidiaSMI{Runner: Runner{Root: "/"}, Path: bin}
	require.NoError(t, smi.SetTimeSlice(context.Background(), "GPU-1", 3))
	got, err := os.ReadFile(args)
	require.NoError(t, err)
	assert.Equal(t, "compute-policy -i GPU-1 --set-timeslice 3 lib=\n", string(got), "no LD_LIBRARY_PATH reaches a driver tool")

	err = NvidiaSMI{Path: bin}.SetTimeSlice(context.Background(), "GPU-bad", 1)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "--set-timeslice 1: exit status 6: No devices were found")
}

func TestNvidiaSMIFromTheDriverRoot(t *testing.T) {
	root := t.TempDir()
	args := filepath.Join(t.TempDir(), "args")
	fakeSMI(t, filepath.Join(root, "usr/bin/nvidia-smi"), args)

	smi := NvidiaSMI{Runner: Runner{Root: root}}
	require.NoError(t, smi.SetTimeSlice(context.Background(), "GPU-1", 2))
	got, err := os.ReadFile(args)
	require.NoError(t, err)
	assert.Equal(t, "compute-policy -i GPU-1 --set-timeslice 2 lib=\n", string(got), "usr/bin/nvidia-smi under the driver root")

	err = NvidiaSMI{Runner: Runner{Root: t.TempDir()}}.SetTimeSlice(context.Background(), "GPU-1", 2)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "setting the time slice of GPU-1: driver tool nvidia-smi: not found under driver root ")
}
