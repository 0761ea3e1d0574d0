package deviceplugin

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/util/wait"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/mpsserver"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/prepared"
	"github.com/gpudra/gpudra/pkg/sharing"
)

func TestMPSGPUs(t *testing.T) {
	_, nomig := builtin(t, "dgx-h100-nomig")
	rs, err := Resources(nomig, ResourceOptions{Config: mustConfig(t, "version: v1\nsharing:\n  mps:\n    resources: [{name: gpu, replicas: 3, devices: [2, 5]}]\n")})
	require.NoError(t, err)
	gpus := MPSGPUs(rs)
	require.Len(t, gpus, 2, "one per GPU, not per replica")
	assert.Equal(t, MPSGPU{Name: "gpu-2", UUID: nomig.GPUs[2].UUID, Replicas: 3, MemoryMiB: 81559}, gpus[0])
	assert.Equal(t, "gpu-5", gpus[1].Name)
	assert.Equal(t, sharing.MPSLimits{ThreadPercentage: 33, PinnedMiB: []int64{27186}}, gpus[0].Limits())
	assert.Equal(t, []string{"set_default_active_thread_percentage 33", "set_default_device_pinned_mem_limit 0 27186M"}, gpus[0].Commands())
	plain, err := Resources(nomig, ResourceOptions{})
	require.NoError(t, err)
	assert.Empty(t, MPSGPUs(plain))
}

// mpsNode is a served device plugin with MPS replicas of GPU 0 of the
// mixed machine, its servers run as processes of the fake
// nvidia-cuda-mps-control.
type mpsNode struct {
	inv    *nvdevice.Inventory
	cdiDir string
	mps    *sharing.MPS
	client pluginapi.DevicePluginClient
	stop   func() error
}

func serveMPS(t *testing.T, root string, checkpoint string, before func(w *cdi.Writer, m *sharing.MPS)) *mpsNode {
	t.Helper()
	return serveMPSWith(t, root, checkpoint, standInControl(t), before)
}

// standInControl runs hack/fake-nvidia-cuda-mps-control.
func standInControl(t *testing.T) sharing.ExecMPSControl {
	t.Helper()
	standIn, err := filepath.Abs("../../hack/fake-nvidia-cuda-mps-control")
	require.NoError(t, err)
	return sharing.ExecMPSControl{Path: standIn}
}

// serveMPSWith is serveMPS with the servers run through control.
func serveMPSWith(t *testing.T, root string, checkpoint string, control sharing.MPSControl, before func(w *cdi.Writer, m *sharing.MPS)) *mpsNode {
	t.Helper()
	m, inv := migMachine(t)
	dir, cdiDir := t.TempDir(), t.TempDir()
	k := startKubelet(t, dir)
	w, err := cdi.NewWriter(cdiDir)
	require.NoError(t, err)
	mgr, err := sharing.NewManager(sharing.Options{Root: root, MPSControl: control, MPSReadyTimeout: 5 * time.Second})
	require.NoError(t, err)
	if before != nil {
		before(w, mgr.MPS())
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Serve(ctx, ServeOptions{Backend: m, CDI: w, PluginDir: dir, PollInterval: 20 * time.Millisecond,
			XIDPolicy: nvdevice.DefaultXIDPolicy,
			Resources: ResourceOptions{Config: mustConfig(t, "version: v1\nflags: {migStrategy: mixed, plugin: {deviceListStrategy: cdi-cri}}\nsharing:\n  mps:\n    resources: [{name: gpu, replicas: 2}]\n")},
			MPS:       MPSOptions{MPS: mgr.MPS(), KubeletCheckpoint: checkpoint, SuperviseEvery: 50 * time.Millisecond}})
	}()
	stopped := false
	stop := func() error {
		if stopped {
			return nil
		}
		stopped = true
		cancel()
		return <-done
	}
	t.Cleanup(func() {
		_ = stop()
		servers, _ := mgr.MPS().Servers(context.Background())
		for _, s := range servers {
			_ = mgr.MPS().StopServer(context.Background(), s)
		}
	})
	reg := map[string]string{}
	for len(reg) < 3 {
		r := k.waitRegistration(t)
		reg[r.ResourceName] = r.Endpoint
	}
	return &mpsNode{inv: inv, cdiDir: cdiDir, mps: mgr.MPS(), client: dialPlugin(t, dir, reg["nvidia.com/gpu"]), stop: stop}
}

func controlLog(t *testing.T, s sharing.MPSServer) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(s.Dir, mpsserver.LogSubdir, "control.log"))
	require.NoError(t, err)
	return string(b)
}

// An MPS replica's container, resolved by the real CDI library from what
// Allocate answers, gets the GPU's device nodes, the pipe directory of a
// daemon serving that GPU, and the replica's share; the daemon's own
// defaults are set to the same share, and a daemon that dies is started
// and configured again.
func TestServeMPS(t *testing.T) {
	root := t.TempDir()
	n := serveMPS(t, root, "", nil)
	gpu0 := n.inv.GPUs[0].UUID
	resp, err := n.client.Allocate(context.Background(), &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{gpu0 + "::1"}}}})
	require.NoError(t, err)
	cr := resp.ContainerResponses[0]
	require.Len(t, cr.CdiDevices, 1)
	assert.Equal(t, MPSCDIDeviceName("gpu-0"), cr.CdiDevices[0].Name)
	assert.Empty(t, cr.Mounts)

	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(n.cdiDir), cdiapi.WithAutoRefresh(false))
	require.NoError(t, err)
	require.NoError(t, cache.Refresh())
	spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
	_, err = cache.InjectDevices(spec, cr.CdiDevices[0].Name)
	require.NoError(t, err)
	s := n.mps.ServerFor([]string{gpu0})
	assert.Contains(t, spec.Process.Env, "CUDA_MPS_PIPE_DIRECTORY="+sharing.MPSPipeDirectory)
	assert.Contains(t, spec.Process.Env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50")
	assert.Contains(t, spec.Process.Env, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=40779M")
	assert.Contains(t, spec.Process.Env, cdi.VisibleDevicesVoid)
	var mounts []string
	for _, m := range spec.Mounts {
		mounts = append(mounts, m.Source+":"+m.Destination)
	}
	assert.Contains(t, mounts, s.PipeDir()+":"+sharing.MPSPipeDirectory)
	var nodes []string
	for _, d := range spec.Linux.Devices {
		nodes = append(nodes, d.Path)
	}
	assert.Contains(t, nodes, "/dev/nvidia0")
	assert.NotContains(t, nodes, "/dev/nvidia1", "GPU 1 is not this replica's")

	log := controlLog(t, s)
	assert.Equal(t, 1, strings.Count(log, "daemon start"), log)
	assert.Contains(t, log, "CUDA_VISIBLE_DEVICES="+gpu0)
	assert.Contains(t, log, "command set_default_active_thread_percentage 50")
	assert.Contains(t, log, "command set_default_device_pinned_mem_limit 0 40779M")

	// The daemon dies: supervision starts it again and sets its defaults
	// again (a daemon forgets them).
	pid, err := os.ReadFile(filepath.Join(s.PipeDir(), "control.pid"))
	require.NoError(t, err)
	p, err := strconv.Atoi(strings.TrimSpace(string(pid)))
	require.NoError(t, err)
	require.NoError(t, syscall.Kill(p, syscall.SIGKILL))
	// The stand-in logs its start after it opens its FIFO, which the first
	// command's client waits for: their lines come in either order.
	err = wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		log := controlLog(t, s)
		return strings.Count(log, "command set_default_active_thread_percentage 50") >= 2 && strings.Count(log, "daemon start") >= 2, nil
	})
	require.NoError(t, err, "daemon not started and configured again: %s", controlLog(t, s))
	assert.Equal(t, 2, strings.Count(controlLog(t, s), "daemon start"))

	// The agent stops: the server stays, for the clients still running.
	require.NoError(t, n.stop())
	servers, err := n.mps.Servers(context.Background())
	require.NoError(t, err)
	require.Len(t, servers, 1)
	assert.Equal(t, s.Key, servers[0].Key)
}

// A daemon started again that refuses a command of its configuration is
// configured again at the next check, although it runs: it would keep
// no defaults otherwise.
func TestServeMPSConfiguresARestartedServerAgain(t *testing.T) {
	control := &refusingControl{MPSControl: standInControl(t)}
	n := serveMPSWith(t, t.TempDir(), "", control, nil)
	s := n.mps.ServerFor([]string{n.inv.GPUs[0].UUID})
	const command = "set_default_active_thread_percentage 50"
	require.Equal(t, 1, strings.Count(controlLog(t, s), "command "+command))

	control.refuseOnce(command)
	pid, err := os.ReadFile(filepath.Join(s.PipeDir(), "control.pid"))
	require.NoError(t, err)
	p, err := strconv.Atoi(strings.TrimSpace(string(pid)))
	require.NoError(t, err)
	require.NoError(t, syscall.Kill(p, syscall.SIGKILL))
	err = wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return control.refused.Load() && strings.Count(controlLog(t, s), "command "+command) == 2, nil
	})
	require.NoError(t, err, "refused %t; daemon not configured again: %s", control.refused.Load(), controlLog(t, s))
	assert.Equal(t, 2, strings.Count(controlLog(t, s), "daemon start"), "started again once")
}

// refusingControl fails one command, once it is armed, as a daemon that
// does not take it would; the command never reaches the daemon.
type refusingControl struct {
	sharing.MPSControl
	mu      sync.Mutex
	refuse  string
	refused atomic.Bool
}

func (c *refusingControl) refuseOnce(command string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.refuse = command
}

func (c *refusingControl) Command(ctx context.Context, env []string, command string) error {
	c.mu.Lock()
	refuse := c.refuse != "" && c.refuse == command
	if refuse {
		c.refuse = ""
	}
	c.mu.Unlock()
	if refuse {
		c.refused.Store(true)
		return errors.New("refused by the test")
	}
	return c.MPSControl.Command(ctx, env, command)
}

// At start, the specs and servers of GPUs no longer shared with MPS go,
// except a server whose GPU a container still holds a replica of.
func TestServeMPSStale(t *testing.T) {
	root := t.TempDir()
	checkpoint := filepath.Join(t.TempDir(), "kubelet_internal_checkpoint")
	held, free := "GPU-held-by-a-pod", "GPU-nobody-uses"
	cp := map[string]any{"Data": map[string]any{"PodDeviceEntries": []map[string]any{
		{"PodUID": "pod-1", "ContainerName": "c", "ResourceName": "nvidia.com/gpu", "DeviceIDs": map[string][]string{"-1": {held + "::3"}}},
	}}}
	b, err := json.Marshal(cp)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(checkpoint, b, 0o644))
	n := serveMPS(t, root, checkpoint, func(w *cdi.Writer, m *sharing.MPS) {
		for _, u := range []string{held, free} {
			_, err := m.EnsureServer(context.Background(), m.ServerFor([]string{u}), nil, true)
			require.NoError(t, err)
		}
		spec, err := BuildMPSCDISpec(specDevice("gpu-9", "GPU-gone"), sharing.Edits{}, cdi.Majors{NVIDIA: 195, UVM: 510})
		require.NoError(t, err)
		require.NoError(t, w.Write(MPSSpecUID("gpu-9"), spec))
	})
	servers, err := n.mps.Servers(context.Background())
	require.NoError(t, err)
	var keys []string
	for _, s := range servers {
		keys = append(keys, s.Key)
	}
	assert.ElementsMatch(t, []string{n.mps.ServerFor([]string{n.inv.GPUs[0].UUID}).Key, n.mps.ServerFor([]string{held}).Key}, keys)
	entries, err := os.ReadDir(n.cdiDir)
	require.NoError(t, err)
	var specs []string
	for _, e := range entries {
		specs = append(specs, e.Name())
	}
	assert.NotContains(t, strings.Join(specs, " "), MPSSpecUID("gpu-9"))
	assert.Contains(t, strings.Join(specs, " "), MPSSpecUID("gpu-0"))
}

// Without an MPS control binary, a config with MPS replicas is refused at
// start, naming what is missing.
func TestServeMPSWithoutControl(t *testing.T) {
	m, _ := migMachine(t)
	w, err := cdi.NewWriter(t.TempDir())
	require.NoError(t, err)
	err = Serve(context.Background(), ServeOptions{Backend: m, CDI: w, PluginDir: t.TempDir(),
		Resources: ResourceOptions{Config: mustConfig(t, "version: v1\nflags: {migStrategy: mixed}\nsharing:\n  mps:\n    resources: [{name: gpu, replicas: 2}]\n")}})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "sharing.mps: this node has no MPS control binary")
}

func specDevice(name, uuid string) prepared.Device {
	return prepared.Device{Device: name, UUID: uuid, GPUUUID: uuid, Nodes: []prepared.DeviceNode{cdi.GPUNode(cdi.Majors{NVIDIA: 195}, 9)}}
}
