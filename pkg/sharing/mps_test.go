package sharing

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/api/resource"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
	"github.com/gpudra/gpudra/pkg/prepared"
)

func mpsClaim(uid string) prepared.Claim {
	limit := resource.MustParse("40Gi")
	return prepared.Claim{UID: uid, Namespace: "ns", Name: "mps-" + uid, Devices: []prepared.Device{gpu("gpu-0", "GPU-0"), gpu("gpu-1", "GPU-1")},
		Sharing: &gpuapi.Sharing{Strategy: gpuapi.MPS, MPS: &gpuapi.MPSConfig{PinnedMemoryLimit: &limit}}}
}

func controlLog(t *testing.T, root, uid string) []string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(root, "mps", uid, "log", "control.log"))
	require.NoError(t, err)
	return strings.Split(strings.TrimSpace(string(data)), "\n")
}

func count(lines []string, prefix string) int {
	n := 0
	for _, l := range lines {
		if strings.HasPrefix(l, prefix) {
			n++
		}
	}
	return n
}

func TestMPSDaemonLifecycle(t *testing.T) {
	m, root := newManager(t, nil)
	ctx := context.Background()
	c := mpsClaim("uid-1")
	edits, err := m.Prepare(ctx, c)
	require.NoError(t, err)

	pid := m.MPS().Daemons()["uid-1"]
	require.NotZero(t, pid)
	control := ExecMPSControl{}
	assert.True(t, control.Alive(pid))
	pipe := filepath.Join(root, "mps", "uid-1", "pipe")
	assert.Equal(t, []Mount{{HostPath: pipe, ContainerPath: MPSPipeDirectory}}, edits.Mounts)
	assert.Equal(t, "0=40960M,1=40960M", edits.Env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"])
	assert.Equal(t, MPSPipeDirectory, edits.Env["CUDA_MPS_PIPE_DIRECTORY"])
	log := controlLog(t, root, "uid-1")
	assert.Equal(t, "daemon start pid="+itoa(pid)+" CUDA_VISIBLE_DEVICES=GPU-0,GPU-1", log[0])
	assert.Contains(t, log, "command set_default_device_pinned_mem_limit 0 40960M")
	assert.Contains(t, log, "command set_default_device_pinned_mem_limit 1 40960M")

	// Prepared again (the kubelet retries, or a restart replays it): the
	// same daemon, not a second one.
	_, err = m.Prepare(ctx, c)
	require.NoError(t, err)
	assert.Equal(t, pid, m.MPS().Daemons()["uid-1"])
	assert.Equal(t, 1, count(controlLog(t, root, "uid-1"), "daemon start"))

	require.NoError(t, m.Unprepare(ctx, c, nil))
	assert.Eventually(t, func() bool { return !control.Alive(pid) }, 5*time.Second, 20*time.Millisecond, "daemon quit")
	assert.NoDirExists(t, filepath.Join(root, "mps", "uid-1"))
	assert.Empty(t, m.MPS().Daemons())
}

// A plugin restart: a new Manager over the same directory adopts the running
// daemon of a prepared claim, stops the daemon of a claim that is not
// prepared (no orphan), and restarts a daemon that dies (reported).
func TestMPSSurvivesAPluginRestart(t *testing.T) {
	root := t.TempDir()
	control := ExecMPSControl{Path: standIn(t)}
	first, err := NewManager(Options{Root: root, MPSControl: control})
	require.NoError(t, err)
	ctx := context.Background()
	kept, orphan := mpsClaim("kept"), mpsClaim("orphan")
	_, err = first.Prepare(ctx, kept)
	require.NoError(t, err)
	_, err = first.Prepare(ctx, orphan)
	require.NoError(t, err)
	keptPID, orphanPID := first.MPS().Daemons()["kept"], first.MPS().Daemons()["orphan"]

	var mu sync.Mutex
	var restarted []string
	second, err := NewManager(Options{Root: root, MPSControl: control, OnDaemonRestart: func(c prepared.Claim, err error) {
		mu.Lock()
		defer mu.Unlock()
		restarted = append(restarted, c.UID)
		assert.NoError(t, err)
	}})
	require.NoError(t, err)
	// The checkpoint knows only "kept" (the other was unprepared while the
	// plugin was down, or never recorded).
	require.NoError(t, second.Resume(ctx, []prepared.Claim{kept}))
	assert.Equal(t, keptPID, second.MPS().Daemons()["kept"], "adopted, not started again")
	assert.Equal(t, 1, count(controlLog(t, root, "kept"), "daemon start"))
	assert.Eventually(t, func() bool { return !control.Alive(orphanPID) }, 5*time.Second, 20*time.Millisecond, "orphan daemon stopped")
	assert.NoDirExists(t, filepath.Join(root, "mps", "orphan"))
	mu.Lock()
	assert.Empty(t, restarted)
	mu.Unlock()

	// The daemon dies: supervision starts it again and reports it.
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go second.MPS().Run(runCtx, 50*time.Millisecond)
	require.NoError(t, control.Kill(keptPID))
	assert.Eventually(t, func() bool {
		pid := second.MPS().Daemons()["kept"]
		return pid != keptPID && control.Alive(pid)
	}, 5*time.Second, 20*time.Millisecond)
	mu.Lock()
	assert.Equal(t, []string{"kept"}, restarted)
	mu.Unlock()
	log := controlLog(t, root, "kept")
	assert.Equal(t, 2, count(log, "daemon start"))
	assert.Equal(t, 2, count(log, "command set_default_device_pinned_mem_limit 0 40960M"), "limits set again on the new daemon")
	cancel()
	require.NoError(t, second.Unprepare(ctx, kept, nil))
}

func TestMPSWithoutControlBinary(t *testing.T) {
	m, err := NewManager(Options{Root: t.TempDir()})
	require.NoError(t, err)
	_, err = m.Prepare(context.Background(), mpsClaim("x"))
	require.EqualError(t, err, "claim ns/mps-x: MPS sharing: this node has no MPS control binary configured (--mps-control-binary)")
}

func itoa(i int) string { return strconv.Itoa(i) }
