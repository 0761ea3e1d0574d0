package local

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/gpudra/gpudra/pkg/sharing"
)

// Two MPS clients of one GPU share its one control daemon (the stand-in
// nvidia-cuda-mps-control, a real process), which goes with the last, and
// is reaped by the process that started it (no zombie child).
func TestMPSClientsShareOneDaemonPerGPU(t *testing.T) {
	control, err := filepath.Abs("../../hack/fake-nvidia-cuda-mps-control")
	require.NoError(t, err)
	l, _, _ := openLocal(t, "h100-pcie-nvlink", false, func(c *Config) {
		c.MPS = &sharing.ProcessServers{Root: filepath.Join(c.StateDir, "mps"), Control: sharing.ExecMPSControl{Path: control}}
	})
	ctx := context.Background()

	_, err = l.Acquire(ctx, ask(t, "exclusive", "alice", Ask{GPUs: 3}), nil)
	require.NoError(t, err)
	mps := func(name string) Request {
		r := ask(t, name, "bob", Ask{GPUs: 1})
		r.Share, r.MPS = ShareMPS, &MPSLimits{ThreadPercentage: 50, PinnedMiB: 40960}
		return r
	}
	a, err := l.Acquire(ctx, mps("mps-a"), nil)
	require.NoError(t, err)
	b, err := l.Acquire(ctx, mps("mps-b"), nil)
	require.NoError(t, err, "MPS clients share the last GPU")
	assert.Equal(t, uuids(a), uuids(b))
	require.NotEmpty(t, a.MPSDir)
	assert.Equal(t, a.MPSDir, b.MPSDir, "one daemon per GPU")
	env := strings.Join(Env(a), "\n")
	assert.Contains(t, env, "CUDA_MPS_PIPE_DIRECTORY="+filepath.Join(a.MPSDir, "pipe"))
	assert.Contains(t, env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50")
	assert.Contains(t, env, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=40960M")
	logPath := filepath.Join(a.MPSDir, "log", "control.log")
	log := func() string { b, _ := os.ReadFile(logPath); return string(b) }
	assert.Equal(t, 1, strings.Count(log(), "daemon start"), log())
	pid, err := sharing.RecordedDaemonPID(a.MPSDir)
	require.NoError(t, err)

	assert.ErrorContains(t, l.Enqueue(ctx, func() Request { r := mps("two"); r.Devices, _ = Devices(Ask{GPUs: 2}); return r }()),
		"one GPU (or MIG device) per request")
	require.NoError(t, l.Release(ctx, "mps-a", "bob"))
	assert.NotContains(t, log(), "daemon quit", "a client is left")
	require.NoError(t, l.Release(ctx, "mps-b", "bob"))
	_, err = os.Stat(a.MPSDir)
	assert.True(t, os.IsNotExist(err), "the last client gone: the daemon quit and its directory went")
	assert.False(t, zombieChild(t, pid), "the daemon, a child of this process, was reaped when its last client was released")
}

// zombieChild says whether pid is a child of this process in state Z.
func zombieChild(t *testing.T, pid int) bool {
	t.Helper()
	stat, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return false // gone: reaped
	}
	// state and ppid follow the command name in parentheses.
	f := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
	require.GreaterOrEqual(t, len(f), 2)
	return f[0] == "Z" && f[1] == strconv.Itoa(os.Getpid())
}

func TestSharingOfAClaimsGpuConfig(t *testing.T) {
	opaque := func(json string) resourceapi.DeviceClaimConfiguration {
		return resourceapi.DeviceClaimConfiguration{DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{
			Driver: "gpu.gpudra.dev", Parameters: runtime.RawExtension{Raw: []byte(json)}}}}
	}
	for _, tc := range []struct {
		name, config string
		share        string
		limits       *MPSLimits
		err          string
	}{
		{name: "exclusive", config: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"Exclusive"}}`},
		{name: "time-slicing", config: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"TimeSlicing"}}`, share: ShareTimeSlicing},
		{name: "mps", config: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"activeThreadPercentage":25,"pinnedMemoryLimit":"10Gi"}}}`,
			share: ShareMPS, limits: &MPSLimits{ThreadPercentage: 25, PinnedMiB: 10240}},
		{name: "malformed", config: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"Sometimes"}}`, err: "devices.config[0].opaque.parameters"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			share, limits, err := SharingOf(resourceapi.DeviceClaim{Config: []resourceapi.DeviceClaimConfiguration{opaque(tc.config)}})
			if tc.err != "" {
				assert.ErrorContains(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.share, share)
			assert.Equal(t, tc.limits, limits)
		})
	}
}
