package main

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"

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
		{write("single.yaml", "version: v1\nflags:\n  migStrategy: single\n"), `single.yaml: flags.migStrategy: "single" is not supported`},
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

// DRA mode refuses to start while the kubelet records pods holding GPUs
// through a device plugin.
func TestDRAModeRefusesDevicePluginPods(t *testing.T) {
	cp := kubeletCheckpoint(t)
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	// An API server that refuses connections: the pods cannot be listed,
	// so every entry counts.
	require.NoError(t, os.WriteFile(kubeconfig, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
`), 0o600))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := runWith(t, ctx, "--node-name=a", "--backend=sim", "--kubeconfig="+kubeconfig, "--kubelet-device-checkpoint="+cp,
		"--plugin-data-dir="+t.TempDir(), "--registrar-dir="+t.TempDir(), "--cdi-dir="+t.TempDir(), "--metrics-address=")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "DRA mode refused: the kubelet's device manager checkpoint "+cp+
		" records 2 pod(s) holding GPUs through a device plugin: pod pod-1 (nvidia.com/gpu), pod pod-2 (nvidia.com/mig-1g.10gb); drain them")
	assert.Contains(t, err.Error(), "before switching the node to DRA mode")
}

// Pods the API no longer has on the node (or that finished) are stale
// entries of the kubelet's checkpoint and do not block DRA mode.
func TestCheckDevicePluginDrainedLeavesOutGonePods(t *testing.T) {
	cp := kubeletCheckpoint(t)
	pod := func(uid string, phase corev1.PodPhase) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: uid, Namespace: "ns", UID: types.UID(uid)},
			Spec: corev1.PodSpec{NodeName: "node-a"}, Status: corev1.PodStatus{Phase: phase}}
	}
	o := &options{nodeName: "node-a", gpuResourceName: "nvidia.com/gpu", kubeletDeviceCheckpoint: cp}
	ctx := context.Background()

	err := checkDevicePluginDrained(ctx, fake.NewClientset(pod("pod-1", corev1.PodRunning), pod("pod-2", corev1.PodRunning)), o, nil)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "records 2 pod(s)")

	err = checkDevicePluginDrained(ctx, fake.NewClientset(pod("pod-2", corev1.PodPending)), o, nil)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "records 1 pod(s) holding GPUs through a device plugin: pod pod-2 (nvidia.com/mig-1g.10gb);")

	assert.NoError(t, checkDevicePluginDrained(ctx, fake.NewClientset(pod("pod-1", corev1.PodSucceeded), pod("pod-2", corev1.PodFailed)), o, nil),
		"finished pods hold no GPU")
	assert.NoError(t, checkDevicePluginDrained(ctx, fake.NewClientset(), o, nil), "every pod deleted")

	o.kubeletDeviceCheckpoint = filepath.Join(t.TempDir(), "none")
	assert.NoError(t, checkDevicePluginDrained(ctx, nil, o, nil), "no checkpoint: drained")
}
