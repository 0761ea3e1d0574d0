package main

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/deviceplugin"
	"github.com/gpudra/gpudra/pkg/plugin/checkpoint"
	"github.com/gpudra/gpudra/pkg/prepared"
)

// runWith parses args as the binary does and runs the node agent.
func runWith(t *testing.T, ctx context.Context, args ...string) error {
	t.Helper()
	c, o, err := parse(t, args, nil)
	require.NoError(t, err)
	return run(ctx, o, c.Features, nil)
}

// preparedClaim writes a DRA checkpoint with one prepared claim.
func preparedClaim(t *testing.T, dir string) {
	t.Helper()
	cp := checkpoint.New("boot")
	cp.Put(prepared.Claim{UID: "claim-uid", Namespace: "team-a", Name: "train", State: prepared.PrepareCompleted})
	require.NoError(t, checkpoint.Store(filepath.Join(dir, deviceplugin.DRACheckpointFile), cp))
}

// kubeletCheckpoint writes a kubelet device manager checkpoint in which
// pod-1 holds a GPU and pod-2 a MIG device.
func kubeletCheckpoint(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kubelet_internal_checkpoint")
	require.NoError(t, os.WriteFile(path, []byte(`{"Data":{"PodDeviceEntries":[
{"PodUID":"pod-1","ContainerName":"c","ResourceName":"nvidia.com/gpu","DeviceIDs":{"0":["gpu-0"]},"AllocResp":"CgA="},
{"PodUID":"pod-2","ContainerName":"c","ResourceName":"nvidia.com/mig-1g.10gb","DeviceIDs":{"0":["mig-0"]},"AllocResp":"CgA="}],
"RegisteredDevices":{}},"Checksum":1}`), 0o600))
	return path
}

// Device plugin mode refuses to start while a DRA claim is prepared, and
// says what to drain; nothing is written to the CDI or device plugin
// directories.
func TestDevicePluginModeRefusesPreparedClaims(t *testing.T) {
	data, cdiDir, dpDir := t.TempDir(), t.TempDir(), t.TempDir()
	preparedClaim(t, data)
	err := runWith(t, context.Background(), "--node-name=a", "--backend=sim", "--mode=device-plugin", "--plugin-data-dir="+data,
		"--cdi-dir="+cdiDir, "--device-plugin-dir="+dpDir, "--metrics-address=")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "device plugin mode refused: the DRA checkpoint "+filepath.Join(data, "checkpoint.json")+" holds 1 prepared claim(s): team-a/train (claim-uid); ")
	assert.Contains(t, err.Error(), deviceplugin.DrainAdvice)
	for _, dir := range []string{cdiDir, dpDir} {
		entries, _ := os.ReadDir(dir)
		assert.Empty(t, entries, dir)
	}
}

func TestDevicePluginModeConfigErrors(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte(content), 0o600))
		return p
	}
	for _, tc := range []struct{ config, want string }{
		{filepath.Join(dir, "missing.yaml"), "--device-plugin-config: open " + filepath.Join(dir, "missing.yaml")},
		{write("strategy.yaml", "version: v1\nflags:\n  migStrategy: all\n"), `strategy.yaml: flags.migStrategy: must be "none", "single" or "mixed", got "all"`},
		{write("unknown.yaml", "version: v1\nflags:\n  gdsEnabled: true\n"), `unknown.yaml: device plugin config: error unmarshaling JSON`},
		// No nvidia-cuda-mps-control under an empty driver root.
		{write("mps.yaml", "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n"),
			"sharing.mps: this node has no MPS control binary"},
	} {
		t.Run(filepath.Base(tc.config), func(t *testing.T) {
			err := runWith(t, context.Background(), "--node-name=a", "--backend=sim", "--sim-machine=dgx-h100-nomig", "--mode=device-plugin",
				"--driver-root="+t.TempDir(), "--plugin-data-dir="+t.TempDir(),
				"--cdi-dir="+t.TempDir(), "--device-plugin-dir="+t.TempDir(), "--metrics-address=", "--device-plugin-config="+tc.config)
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.want)
		})
	}
}

// With nothing prepared, device plugin mode writes its node-wide CDI spec
// and the driver's, and waits for the kubelet's socket until stopped.
func TestDevicePluginModeStarts(t *testing.T) {
	cdiDir := t.TempDir()
	cfg := filepath.Join(t.TempDir(), "config.yaml")
	require.NoError(t, os.WriteFile(cfg, []byte("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"), 0o600))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- runWith(t, ctx, "--node-name=a", "--backend=sim", "--sim-machine=dgx-h100-nomig", "--mode=device-plugin", "--plugin-data-dir="+t.TempDir(),
			"--cdi-dir="+cdiDir, "--device-plugin-dir="+t.TempDir(), "--metrics-address=", "--device-plugin-config="+cfg)
	}()
	w, err := cdi.NewWriter(cdiDir)
	require.NoError(t, err)
	assert.Eventually(t, func() bool { return w.Exists(deviceplugin.SpecUID) }, 10*time.Second, 20*time.Millisecond,
		"the node-wide CDI spec that Allocate's names resolve in")
	cancel()
	select {
	case err := <-done:
		assert.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("device plugin mode did not stop")
	}
}

// With sharing.mps, device plugin mode starts an MPS server per shared GPU
// (processes here: no --mps-server-image) under the plugin data directory,
// and writes each GPU's MPS spec before it advertises anything.
func TestDevicePluginModeRunsMPSServers(t *testing.T) {
	cdiDir, data := t.TempDir(), t.TempDir()
	cfg := filepath.Join(t.TempDir(), "config.yaml")
	require.NoError(t, os.WriteFile(cfg, []byte("version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n      devices: [3]\n"), 0o600))
	standIn, err := filepath.Abs("../../hack/fake-nvidia-cuda-mps-control")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- runWith(t, ctx, "--node-name=a", "--backend=sim", "--sim-machine=dgx-h100-nomig", "--mode=device-plugin", "--plugin-data-dir="+data,
			"--cdi-dir="+cdiDir, "--device-plugin-dir="+t.TempDir(), "--metrics-address=", "--device-plugin-config="+cfg,
			"--mps-control-binary="+standIn)
	}()
	w, err := cdi.NewWriter(cdiDir)
	require.NoError(t, err)
	assert.Eventually(t, func() bool { return w.Exists(deviceplugin.MPSSpecUID("gpu-3")) }, 10*time.Second, 20*time.Millisecond,
		"GPU 3's MPS spec")
	assert.False(t, w.Exists(deviceplugin.MPSSpecUID("gpu-2")), "GPU 2 is not shared with MPS")
	servers, err := filepath.Glob(filepath.Join(data, "sharing", "mps", "mps-*", "pipe", "control.pid"))
	require.NoError(t, err)
	assert.Len(t, servers, 1, "one MPS server, for GPU 3")
	cancel()
	select {
	case err := <-done:
		assert.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("device plugin mode did not stop")
	}
	// The server outlives the agent (its clients keep running); stop it.
	for _, pid := range servers {
		b, err := os.ReadFile(pid)
		require.NoError(t, err)
		p, err := strconv.Atoi(strings.TrimSpace(string(b)))
		require.NoError(t, err)
		_ = syscall.Kill(p, syscall.SIGTERM)
	}
}

// podResources serves the kubelet's pod-resources API on a real unix socket,
// listing pods (namespace/name -> resource -> device IDs), and returns the
// socket's path.
func podResources(t *testing.T, pods map[string]map[string][]string) string {
	t.Helper()
	var list []*podresourcesv1.PodResources
	for ref, resources := range pods {
		ns, name, _ := strings.Cut(ref, "/")
		c := &podresourcesv1.ContainerResources{Name: "c"}
		for r, ids := range resources {
			c.Devices = append(c.Devices, &podresourcesv1.ContainerDevices{ResourceName: r, DeviceIds: ids})
		}
		list = append(list, &podresourcesv1.PodResources{Namespace: ns, Name: name, Containers: []*podresourcesv1.ContainerResources{c}})
	}
	socket := filepath.Join(t.TempDir(), "kubelet.sock")
	lis, err := net.Listen("unix", socket)
	require.NoError(t, err)
	srv := grpc.NewServer()
	podresourcesv1.RegisterPodResourcesListerServer(srv, fixedPodResources{list: list})
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return socket
}

type fixedPodResources struct {
	podresourcesv1.UnimplementedPodResourcesListerServer
	list []*podresourcesv1.PodResources
}

func (f fixedPodResources) List(context.Context, *podresourcesv1.ListPodResourcesRequest) (*podresourcesv1.ListPodResourcesResponse, error) {
	return &podresourcesv1.ListPodResourcesResponse{PodResources: f.list}, nil
}

// DRA mode refuses to start while the kubelet's pod-resources API lists
// pods holding GPUs through a device plugin; it asks no API server (the
// kubeconfig's refuses connections).
func TestDRAModeRefusesDevicePluginPods(t *testing.T) {
	cp := kubeletCheckpoint(t)
	socket := podResources(t, map[string]map[string][]string{
		"team-a/train": {"nvidia.com/gpu": {"GPU-0"}}, "team-b/fpga": {"example.com/fpga": {"f0"}}})
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	require.NoError(t, os.WriteFile(kubeconfig, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
`), 0o600))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	args := []string{"--node-name=a", "--backend=sim", "--kubeconfig=" + kubeconfig, "--kubelet-device-checkpoint=" + cp,
		"--plugin-data-dir=" + t.TempDir(), "--registrar-dir=" + t.TempDir(), "--cdi-dir=" + t.TempDir(), "--metrics-address="}
	err := runWith(t, ctx, append(args, "--pod-resources-socket="+socket)...)
	require.Error(t, err)
	assert.Equal(t, "DRA mode refused: the kubelet's pod-resources API ("+socket+") lists 1 pod(s) holding GPUs through a device plugin: "+
		"pod team-a/train (nvidia.com/gpu); drain them (kubectl drain / delete the pods that request nvidia.com/gpu, nvidia.com/mig-*) before switching the node to DRA mode",
		err.Error())

	// No socket (not mounted): the kubelet's checkpoint, said so.
	missing := filepath.Join(t.TempDir(), "pod-resources", "kubelet.sock")
	err = runWith(t, ctx, append(args, "--pod-resources-socket="+missing)...)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "DRA mode refused: the kubelet's device manager checkpoint "+cp+
		" records 2 pod(s) holding GPUs through a device plugin: pod UID pod-1 (nvidia.com/gpu), pod UID pod-2 (nvidia.com/mig-1g.10gb); drain them")
	assert.Contains(t, err.Error(), `the kubelet's pod-resources socket "`+missing+`" does not exist, so its checkpoint was read instead`)
}

// The checkpoint's entries of pods the kubelet no longer runs do not block
// DRA mode: the pod-resources API does not list them.
func TestCheckDevicePluginDrainedIgnoresStaleCheckpoint(t *testing.T) {
	ctx := context.Background()
	o := &options{nodeName: "node-a", gpuResourceName: "nvidia.com/gpu", kubeletDeviceCheckpoint: kubeletCheckpoint(t)}
	o.podResourcesSocket = podResources(t, map[string]map[string][]string{"team-b/infer": {"nvidia.com/mig-1g.10gb": {"MIG-0"}}})
	err := checkDevicePluginDrained(ctx, o, nil)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "lists 1 pod(s) holding GPUs through a device plugin: pod team-b/infer (nvidia.com/mig-1g.10gb);")

	o.podResourcesSocket = podResources(t, nil)
	assert.NoError(t, checkDevicePluginDrained(ctx, o, nil), "nobody holds a GPU, whatever the checkpoint says")

	o.podResourcesSocket = filepath.Join(t.TempDir(), "none")
	o.kubeletDeviceCheckpoint = filepath.Join(t.TempDir(), "none")
	assert.NoError(t, checkDevicePluginDrained(ctx, o, nil), "no socket, no checkpoint: drained")
}

// Neither mode starts while gpudra local holds or queues allocations on
// the machine (docs/local.md); the error names the state file.
func TestPluginRefusesWhileLocalHoldsGPUs(t *testing.T) {
	state := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(state, "state.json"),
		[]byte(`{"allocations":[{"name":"alice-1","user":"alice","devices":{},"allocated":[{"name":"gpu-0","uuid":"GPU-a"}]}]}`), 0o644))
	for _, mode := range []string{"dra", "device-plugin"} {
		err := runWith(t, context.Background(), "--node-name=a", "--backend=sim", "--mode="+mode, "--plugin-data-dir="+t.TempDir(),
			"--cdi-dir="+t.TempDir(), "--device-plugin-dir="+t.TempDir(), "--metrics-address=", "--local-state-dir="+state)
		require.Error(t, err, mode)
		assert.Contains(t, err.Error(), "gpudra local holds or queues 1 request(s)", mode)
		assert.Contains(t, err.Error(), filepath.Join(state, "state.json"), mode)
	}
}
