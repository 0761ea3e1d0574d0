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

// shareClaim is a fractional share of 20 GiB of GPU-0 (or another GPU).
func shareClaim(uid, gpuUUID string, gib int64) prepared.Claim {
	return prepared.Claim{UID: uid, Namespace: "ns", Name: "share-" + uid, Sharing: &gpuapi.Sharing{Strategy: gpuapi.MPS},
		Devices: []prepared.Device{{Device: "gpu-0", UUID: gpuUUID, GPUUUID: gpuUUID, MemoryBytes: gib << 30,
			Share: &prepared.Share{ID: "share-" + uid, MemoryBytes: gib << 30}}}}
}

func serverOf(root string, c prepared.Claim) MPSServer {
	var uuids []string
	for _, d := range c.Devices {
		uuids = append(uuids, d.UUID)
	}
	return MPSServerFor(MPSRoot(root), uuids)
}

func controlLog(t *testing.T, s MPSServer) []string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(s.Dir, "log", "control.log"))
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

func daemonPID(t *testing.T, s MPSServer) int {
	t.Helper()
	pid, err := RecordedDaemonPID(s.Dir)
	require.NoError(t, err)
	return pid
}

// One server per GPU: shares of one GPU are clients of one daemon, each
// with its own limits in its environment; the server goes with the last.
func TestOneMPSServerPerGPU(t *testing.T) {
	m, root := newManager(t, nil)
	ctx := context.Background()
	a, b, other := shareClaim("a", "GPU-0", 20), shareClaim("b", "GPU-0", 40), shareClaim("c", "GPU-1", 20)
	ea, err := m.Prepare(ctx, a)
	require.NoError(t, err)
	eb, err := m.Prepare(ctx, b)
	require.NoError(t, err)
	_, err = m.Prepare(ctx, other)
	require.NoError(t, err)

	s0, s1 := serverOf(root, a), serverOf(root, other)
	require.Equal(t, s0, serverOf(root, b))
	require.NotEqual(t, s0.Key, s1.Key)
	pid := daemonPID(t, s0)
	assert.True(t, alive(pid))
	log := controlLog(t, s0)
	assert.Equal(t, 1, count(log, "daemon start"), "one daemon for both shares of GPU-0")
	assert.Equal(t, "daemon start pid="+itoa(pid)+" CUDA_VISIBLE_DEVICES=GPU-0", log[0])
	assert.Zero(t, count(log, "command set_default"), "no daemon defaults: they would apply to every claim on the GPU")

	// Each claim's limits are its own, in its clients' environment.
	assert.Equal(t, "0=20480M", ea.Env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"])
	assert.Equal(t, "0=40960M", eb.Env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"])
	assert.Equal(t, MPSPipeDirectory, ea.Env["CUDA_MPS_PIPE_DIRECTORY"])
	assert.Equal(t, []Mount{{HostPath: s0.PipeDir(), ContainerPath: MPSPipeDirectory}}, ea.Mounts,
		"process servers share no /dev/shm with containers")

	// Prepared again (a kubelet retry): the same daemon.
	_, err = m.Prepare(ctx, a)
	require.NoError(t, err)
	assert.Equal(t, pid, daemonPID(t, s0))

	require.NoError(t, m.Unprepare(ctx, a, []prepared.Claim{b, other}))
	assert.True(t, alive(pid), "b still uses the server")
	require.NoError(t, m.Unprepare(ctx, b, []prepared.Claim{other}))
	assert.Eventually(t, func() bool { return !alive(pid) }, 5*time.Second, 20*time.Millisecond, "daemon quit with the last claim")
	assert.NoDirExists(t, s0.Dir)
	assert.DirExists(t, s1.Dir)
	require.NoError(t, m.Unprepare(ctx, other, nil))
	servers, err := m.MPS().Servers(ctx)
	require.NoError(t, err)
	assert.Empty(t, servers)
}

// Two control daemons on one GPU are what NVIDIA says not to run: a claim
// whose devices overlap another server's without being the same set is
// refused by name.
func TestOverlappingMPSServersAreRefused(t *testing.T) {
	m, _ := newManager(t, nil)
	ctx := context.Background()
	_, err := m.Prepare(ctx, shareClaim("a", "GPU-1", 20))
	require.NoError(t, err)
	_, err = m.Prepare(ctx, mpsClaim("both"))
	require.ErrorContains(t, err, "claim ns/mps-both: MPS sharing: device GPU-1 is already served by the MPS server of other claims (devices GPU-1)")
}

// A plugin restart: a new Manager over the same directory keeps the
// running server of a prepared claim, stops the one no claim uses, and
// supervision starts a server that died again (reported).
func TestMPSSurvivesAPluginRestart(t *testing.T) {
	root := t.TempDir()
	control := ExecMPSControl{Path: standIn(t)}
	first, err := NewManager(Options{Root: root, MPSControl: control})
	require.NoError(t, err)
	ctx := context.Background()
	kept, orphan := shareClaim("kept", "GPU-0", 20), shareClaim("orphan", "GPU-1", 20)
	for _, c := range []prepared.Claim{kept, orphan} {
		_, err = first.Prepare(ctx, c)
		require.NoError(t, err)
	}
	keptServer, orphanServer := serverOf(root, kept), serverOf(root, orphan)
	keptPID, orphanPID := daemonPID(t, keptServer), daemonPID(t, orphanServer)

	var mu sync.Mutex
	var restarted []string
	second, err := NewManager(Options{Root: root, MPSControl: control, OnDaemonRestart: func(s MPSServer, err error) {
		mu.Lock()
		defer mu.Unlock()
		restarted = append(restarted, strings.Join(s.Devices, ","))
		assert.NoError(t, err)
	}})
	require.NoError(t, err)
	// The checkpoint knows only "kept" (the other was unprepared while the
	// plugin was down, or never recorded).
	require.NoError(t, second.Resume(ctx, []prepared.Claim{kept}))
	assert.Equal(t, keptPID, daemonPID(t, keptServer), "kept, not started again")
	assert.Equal(t, 1, count(controlLog(t, keptServer), "daemon start"))
	assert.Eventually(t, func() bool { return !alive(orphanPID) }, 5*time.Second, 20*time.Millisecond, "orphan server stopped")
	assert.NoDirExists(t, orphanServer.Dir)
	mu.Lock()
	assert.Empty(t, restarted)
	mu.Unlock()

	// The daemon dies: supervision starts it again and reports it.
	require.NoError(t, control.Kill(keptPID))
	require.Eventually(t, func() bool { return !alive(keptPID) }, 5*time.Second, 20*time.Millisecond)
	require.NoError(t, second.Supervise(ctx, []prepared.Claim{kept}))
	pid := daemonPID(t, keptServer)
	assert.NotEqual(t, keptPID, pid)
	assert.True(t, alive(pid))
	mu.Lock()
	assert.Equal(t, []string{"GPU-0"}, restarted)
	mu.Unlock()
	// Supervision of a running server does nothing.
	require.NoError(t, second.Supervise(ctx, []prepared.Claim{kept}))
	assert.Eventually(t, func() bool { return count(controlLog(t, keptServer), "daemon start") == 2 }, 20*time.Second, 20*time.Millisecond)
	time.Sleep(100 * time.Millisecond)
	assert.Equal(t, 2, count(controlLog(t, keptServer), "daemon start"))
	require.NoError(t, second.Unprepare(ctx, kept, nil))
	assert.Eventually(t, func() bool { return !alive(pid) }, 5*time.Second, 20*time.Millisecond)
}

// A server that never answers fails the prepare with a message that names
// where it runs.
func TestMPSServerThatDoesNotAnswer(t *testing.T) {
	root := t.TempDir()
	// A daemon that never opens its pipe.
	silent := filepath.Join(t.TempDir(), "nvidia-cuda-mps-control")
	require.NoError(t, os.WriteFile(silent, []byte("#!/bin/sh\nif [ \"$1\" = -f ]; then while :; do sleep 1; done; fi\necho 'Cannot find MPS control daemon process' >&2; exit 1\n"), 0o755))
	m, err := NewManager(Options{Root: root, MPSControl: ExecMPSControl{Path: silent}, MPSReadyTimeout: 300 * time.Millisecond})
	require.NoError(t, err)
	c := shareClaim("a", "GPU-0", 20)
	_, err = m.Prepare(context.Background(), c)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "claim ns/share-a: MPS sharing: MPS server for GPU-0 (process with pid file "+filepath.Join(serverOf(root, c).Dir, "daemon.pid")+") does not answer after 300ms")
	assert.Contains(t, err.Error(), "Cannot find MPS control daemon process")
	pid := daemonPID(t, serverOf(root, c))
	require.NoError(t, m.Unprepare(context.Background(), c, nil))
	assert.Eventually(t, func() bool { return !alive(pid) }, 5*time.Second, 20*time.Millisecond, "the silent daemon is killed at the rollback")
}

func TestMPSWithoutControlBinary(t *testing.T) {
	m, err := NewManager(Options{Root: t.TempDir()})
	require.NoError(t, err)
	_, err = m.Prepare(context.Background(), mpsClaim("x"))
	require.EqualError(t, err, "claim ns/mps-x: MPS sharing: this node has no MPS control binary configured (--mps-control-binary)")
}

func itoa(i int) string { return strconv.Itoa(i) }
