package e2e

import (
	"bufio"
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/devcluster/noderuntime"
)

// These tests cover what the devcluster does in place of a container
// runtime: it really runs MPS server pods (process pods), and a plugin
// container restart kills every process the plugin started but not those
// of other pods.

// containersNode is where these tests run their pods; its plugin is killed
// and started again.
const containersNode = "dgx-h100-1"

// mpsServerPod is shaped as the plugin's MPS server pod: the server's host
// directory hostDir is mounted at serverDir (the plugin mounts it at the
// same path), the host's / at /driver-root.
func mpsServerPod(t *testing.T, ns, name, hostDir, serverDir string) *v1.Pod {
	t.Helper()
	control, err := filepath.Abs("../../hack/fake-nvidia-cuda-mps-control")
	require.NoError(t, err)
	// Under the driver root (the host's /): the server may run in a
	// container of its own, which sees the host's files only there.
	control = strings.TrimPrefix(control, "/")
	dirOrCreate := v1.HostPathDirectoryOrCreate
	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns,
			Labels: map[string]string{"app.kubernetes.io/name": "gpudra", "app.kubernetes.io/component": "mps-server"}},
		Spec: v1.PodSpec{
			NodeName: containersNode, RestartPolicy: v1.RestartPolicyAlways, PriorityClassName: "system-node-critical",
			Tolerations: []v1.Toleration{{Operator: v1.TolerationOpExists}},
			Containers: []v1.Container{{
				Name: "mps-server", Image: chart.MPSServerImage, Command: []string{noderuntime.MPSServerCommand},
				Args: []string{"--driver-root=/driver-root", "--control-binary=" + control, "--dir=" + serverDir,
					"--devices=GPU-aaaa,GPU-bbbb", "-v=2"},
				VolumeMounts: []v1.VolumeMount{{Name: "server", MountPath: serverDir}, {Name: "shm", MountPath: "/dev/shm"},
					{Name: "driver-root", MountPath: "/driver-root", ReadOnly: true}},
			}},
			Volumes: []v1.Volume{
				{Name: "server", VolumeSource: v1.VolumeSource{HostPath: &v1.HostPathVolumeSource{Path: hostDir, Type: &dirOrCreate}}},
				{Name: "shm", VolumeSource: v1.VolumeSource{HostPath: &v1.HostPathVolumeSource{Path: filepath.Join(hostDir, "shm"), Type: &dirOrCreate}}},
				{Name: "driver-root", VolumeSource: v1.VolumeSource{HostPath: &v1.HostPathVolumeSource{Path: "/"}}},
			},
		},
	}
}

// hasMarker tells whether the process is alive (not a zombie) and carries
// the marker of container id.
func hasMarker(pid int, id string) bool {
	environ, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/environ")
	if err != nil {
		return false
	}
	for _, e := range bytes.Split(environ, []byte{0}) {
		if string(e) == noderuntime.ContainerMarker(id) {
			return true
		}
	}
	return false
}

// nsPID is the pid of host process pid in its innermost PID namespace
// (the last NSpid of its status); 0 if it is gone.
func nsPID(pid int) int {
	status, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(status), "\n") {
		if rest, ok := strings.CutPrefix(line, "NSpid:"); ok {
			f := strings.Fields(rest)
			if len(f) > 0 {
				n, _ := strconv.Atoi(f[len(f)-1])
				return n
			}
		}
	}
	return 0
}

// daemonHostPID reads the pid the fake control daemon of the server in
// hostDir wrote (its own namespace's: the MPS server pod's container has
// its own) and finds it on the host among the processes of container id;
// 0 if none.
func daemonHostPID(hostDir, id string) int {
	data, err := os.ReadFile(filepath.Join(hostDir, "pipe", "control.pid"))
	if err != nil {
		return 0
	}
	want, _ := strconv.Atoi(strings.TrimSpace(string(data)))
	pids, err := noderuntime.ContainerProcesses(id)
	if err != nil || want == 0 {
		return 0
	}
	for _, pid := range pids {
		if nsPID(pid) == want {
			return pid
		}
	}
	return 0
}

// waitDaemon waits until the fake control daemon of the server in hostDir
// runs with a (host) pid other than not, carrying the pod's marker, and
// returns its host pid.
func waitDaemon(t *testing.T, hostDir string, uid string, not int) int {
	t.Helper()
	var pid int
	err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		pid = daemonHostPID(hostDir, uid)
		return pid != 0 && pid != not && hasMarker(pid, uid), nil
	})
	require.NoError(t, err, "no MPS control daemon with the marker of pod %s in %s (last pid %d)", uid, hostDir, pid)
	return pid
}

func TestProcessPodRunsMPSServer(t *testing.T) {
	for _, tc := range []struct {
		name string
		// serverDir is where the pod sees the host directory; "": at the
		// same path, as the plugin mounts it.
		serverDir string
	}{
		{name: "same path"},
		{name: "mounted elsewhere", serverDir: "/run/gpudra-mps"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			ns := namespace(t)
			hostDir := t.TempDir()
			serverDir := tc.serverDir
			if serverDir == "" {
				serverDir = hostDir
			}
			pod, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, mpsServerPod(t, ns, "mps-server", hostDir, serverDir), metav1.CreateOptions{})
			require.NoError(t, err)
			uid := string(pod.UID)
			waitRunning(t, ns, pod.Name)
			pid := waitDaemon(t, hostDir, uid, 0)
			if realMPSContainers() {
				assert.NotEqual(t, pid, nsPID(pid), "the server's container has a PID namespace of its own")
			}
			log := filepath.Join(hostDir, "log", "control.log")
			data, err := os.ReadFile(log)
			require.NoError(t, err)
			assert.Contains(t, string(data), "CUDA_VISIBLE_DEVICES=GPU-aaaa,GPU-bbbb")
			pids, err := noderuntime.ContainerProcesses(uid)
			require.NoError(t, err)
			assert.Contains(t, pids, pid)

			// The daemon dies: the container is restarted (restartPolicy
			// Always), with a new daemon, and the restart is counted.
			require.NoError(t, syscall.Kill(pid, syscall.SIGKILL))
			pid = waitDaemon(t, hostDir, uid, pid)
			daemonNSPID := nsPID(pid)
			err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
				p, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, pod.Name, metav1.GetOptions{})
				return err == nil && len(p.Status.ContainerStatuses) == 1 && p.Status.ContainerStatuses[0].RestartCount >= 1, nil
			})
			require.NoError(t, err, "the restart is not counted in the container status")

			// Deleting the pod tells the daemon to quit before the pod goes.
			require.NoError(t, cluster.Client.CoreV1().Pods(ns).Delete(ctx, pod.Name, metav1.DeleteOptions{}))
			waitPodGone(t, ns, pod.Name)
			data, err = os.ReadFile(log)
			require.NoError(t, err)
			assert.Contains(t, string(data), "daemon quit pid="+strconv.Itoa(daemonNSPID))
			assert.False(t, hasMarker(pid, uid), "daemon %d still runs", pid)
		})
	}
}

// startMarked starts a command in the plugin container's name: its
// environment carries the container's marker, as the plugin's runner gives
// it. With reports, the command's first line of output is returned (a pid
// the command reports).
func startMarked(t *testing.T, containerID string, setsid, reports bool, name string, args ...string) (*exec.Cmd, string) {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Env = append(os.Environ(), noderuntime.ContainerMarker(containerID))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: setsid}
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	var line string
	if reports {
		line, _ = bufio.NewReader(out).ReadString('\n')
	}
	go func() { _ = cmd.Wait() }() // reaped once killed
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	return cmd, strings.TrimSpace(line)
}

func TestPluginContainerKillSparesProcessPods(t *testing.T) {
	ctx := context.Background()
	node := cluster.Node(containersNode)
	require.NotNil(t, node)
	t.Cleanup(func() {
		// Leave the node as the other tests expect it.
		if node.Plugin() == nil {
			require.NoError(t, node.StartPlugin())
			require.NoError(t, node.WaitForSlices(ctx))
		}
	})
	inst := node.PluginInstance()
	require.NotNil(t, inst)
	assert.Contains(t, inst.ContainerID, inst.PodUID)

	// An MPS server pod, with its own container.
	ns := namespace(t)
	hostDir := t.TempDir()
	pod, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, mpsServerPod(t, ns, "mps-server", hostDir, hostDir), metav1.CreateOptions{})
	require.NoError(t, err)
	waitRunning(t, ns, pod.Name)
	daemon := waitDaemon(t, hostDir, string(pod.UID), 0)

	// Processes of the plugin's container, some of which escape it as
	// daemons do: a new session, a grandchild, an orphan.
	sleeper, _ := startMarked(t, inst.ContainerID, true, false, "sleep", "300")
	shell, grandchild := startMarked(t, inst.ContainerID, false, true, "sh", "-c", "sleep 300 & echo $!; wait")
	_, orphan := startMarked(t, inst.ContainerID, false, true, "sh", "-c", "setsid sleep 300 </dev/null >/dev/null 2>&1 & echo $!")
	pids := map[string]int{"setsid child": sleeper.Process.Pid, "shell": shell.Process.Pid}
	for what, s := range map[string]string{"grandchild": grandchild, "orphan": orphan} {
		pid, err := strconv.Atoi(s)
		require.NoError(t, err, "%s pid %q", what, s)
		pids[what] = pid
		t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGKILL) })
	}
	// A process between two execs (sh, setsid, sleep) reads with an empty
	// environment for a moment: wait until every one has shown up.
	var listed []int
	require.Eventually(t, func() bool {
		listed, err = noderuntime.ContainerProcesses(inst.ContainerID)
		require.NoError(t, err)
		for _, pid := range pids {
			if !slices.Contains(listed, pid) {
				return false
			}
		}
		return true
	}, 5*time.Second, 20*time.Millisecond, "every process is one of the container's: %v listed, want %v", listed, pids)

	killed, err := node.KillPluginContainer()
	require.NoError(t, err)
	assert.GreaterOrEqual(t, killed, len(pids), "killed %d processes", killed)
	assert.Nil(t, node.Plugin(), "the plugin is stopped")
	for what, pid := range pids {
		assert.False(t, hasMarker(pid, inst.ContainerID), "%s (pid %d) survived the container's end", what, pid)
	}
	left, err := noderuntime.ContainerProcesses(inst.ContainerID)
	require.NoError(t, err)
	assert.Empty(t, left)
	assert.True(t, hasMarker(daemon, string(pod.UID)), "the MPS server pod's daemon is not the plugin's to kill")
	p, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, pod.Name, metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, v1.PodRunning, p.Status.Phase)

	// A new container: a new instance with a marker of its own.
	require.NoError(t, node.StartPlugin())
	require.NoError(t, node.WaitForSlices(ctx))
	next := node.PluginInstance()
	require.NotNil(t, next)
	assert.NotEqual(t, inst.ContainerID, next.ContainerID)
	assert.True(t, hasMarker(daemon, string(pod.UID)), "the daemon outlives the plugin's restart")
}
