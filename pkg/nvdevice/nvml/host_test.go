package nvml

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

type recordingPolicy struct{ set map[string]int }

func (p *recordingPolicy) SetTimeSlice(_ context.Context, gpu string, level int) error {
	p.set[gpu] = level
	return nil
}

// TestHostOf runs with and without cgo: a real node's Host comes from the
// proc root's files and the policy the caller gave.
func TestHostOf(t *testing.T) {
	const devices = "Character devices:\n195 nvidia-frontend\n236 nvidia-caps\n507 nvidia-uvm\n"
	const minors = "config 1\nmonitor 2\ngpu3/gi2/access 300\ngpu3/gi2/ci0/access 301\n"
	for _, tc := range []struct {
		name    string
		files   map[string]string // under the proc root
		policy  nvdevice.ComputePolicy
		wantErr string // "" for success; "PROC" stands for the proc root
	}{
		{name: "devices and mig-minors", files: map[string]string{"devices": devices, "driver/nvidia-caps/mig-minors": minors},
			policy: &recordingPolicy{set: map[string]int{}}},
		{name: "no policy: time-slicing refused", files: map[string]string{"devices": devices, "driver/nvidia-caps/mig-minors": minors}},
		{name: "no nvidia-uvm", files: map[string]string{"devices": "Character devices:\n195 nvidia-frontend\n"},
			wantErr: "device majors from PROC/devices: no nvidia-uvm entry: is the nvidia-uvm module loaded?"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			proc := t.TempDir()
			for name, content := range tc.files {
				require.NoError(t, os.MkdirAll(filepath.Dir(filepath.Join(proc, name)), 0o755))
				require.NoError(t, os.WriteFile(filepath.Join(proc, name), []byte(content), 0o600))
			}
			host, err := hostOf(Options{ProcRoot: proc, ComputePolicy: tc.policy})
			if tc.wantErr != "" {
				require.EqualError(t, err, strings.ReplaceAll(tc.wantErr, "PROC", proc), "the error names the file")
				return
			}
			require.NoError(t, err)
			assert.Equal(t, nvdevice.DeviceMajors{NVIDIA: 195, UVM: 507, Caps: 236}, host.Majors)
			gi, ci, err := host.CapMinors(3, 2, 0)
			require.NoError(t, err)
			assert.Equal(t, [2]int{300, 301}, [2]int{gi, ci})
			_, _, err = host.CapMinors(0, 2, 0)
			require.ErrorContains(t, err, "no entry for gpu0/gi2/access")
			assert.Equal(t, tc.policy, host.ComputePolicy)
		})
	}
}

// TestHostOfReadsMigMinorsLate: the mig-minors file may appear after the
// plugin started (the MIG capability module loads late); the Host still
// finds it.
func TestHostOfReadsMigMinorsLate(t *testing.T) {
	proc := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(proc, "devices"), []byte("Character devices:\n195 nvidia\n508 nvidia-uvm\n"), 0o600))
	host, err := hostOf(Options{ProcRoot: proc})
	require.NoError(t, err, "no mig-minors yet is no error at start")
	_, _, err = host.CapMinors(0, 1, 0)
	require.ErrorIs(t, err, os.ErrNotExist)

	require.NoError(t, os.MkdirAll(filepath.Join(proc, "driver/nvidia-caps"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(proc, "driver/nvidia-caps/mig-minors"), []byte("gpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\n"), 0o600))
	gi, ci, err := host.CapMinors(0, 1, 0)
	require.NoError(t, err)
	assert.Equal(t, [2]int{12, 13}, [2]int{gi, ci})
}
