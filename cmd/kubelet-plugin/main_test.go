package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/drivertools"
)

func TestDriverTool(t *testing.T) {
	root := t.TempDir()
	smi := filepath.Join(root, "usr/bin/nvidia-smi")
	require.NoError(t, os.MkdirAll(filepath.Dir(smi), 0o755))
	require.NoError(t, os.WriteFile(smi, []byte("#!/bin/sh\n"), 0o755))
	standIn := filepath.Join(t.TempDir(), "fake-nvidia-cuda-mps-control")
	require.NoError(t, os.WriteFile(standIn, []byte("#!/bin/sh\n"), 0o755))
	tools := drivertools.Runner{Root: root}

	for flag, want := range map[string]string{
		"":                    smi, // the default: nvidia-smi in drivertools.ToolDirs under the driver root
		"/usr/bin/nvidia-smi": smi, // a path inside the driver root
		"usr/bin/nvidia-smi":  smi,
		smi:                   smi, // a path under the driver root as the plugin sees it
		standIn:               standIn,
	} {
		got, err := driverTool(tools, "nvidia-smi", flag, "nvidia-smi")
		require.NoError(t, err, flag)
		assert.Equal(t, want, got, flag)
	}

	got, err := driverTool(tools, "mps-control-binary", "", "nvidia-cuda-mps-control")
	require.NoError(t, err)
	assert.Empty(t, got, "no default binary: MPS claims are refused later, with a message")

	_, err = driverTool(tools, "mps-control-binary", "/opt/nvidia-cuda-mps-control", "nvidia-cuda-mps-control")
	assert.EqualError(t, err, "--mps-control-binary=/opt/nvidia-cuda-mps-control: not found (a path under driver root "+root+", or an absolute path outside it)")

	// A driver under /usr/local/nvidia: the default finds its tools there.
	control := filepath.Join(root, "usr/local/nvidia/bin/nvidia-cuda-mps-control")
	require.NoError(t, os.MkdirAll(filepath.Dir(control), 0o755))
	require.NoError(t, os.WriteFile(control, []byte("#!/bin/sh\n"), 0o755))
	got, err = driverTool(tools, "mps-control-binary", "", "nvidia-cuda-mps-control")
	require.NoError(t, err)
	assert.Equal(t, control, got)
}
