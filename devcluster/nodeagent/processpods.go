package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"sort"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/devcluster/noderuntime"
	"github.com/gpudra/gpudra/pkg/component"
	"github.com/gpudra/gpudra/pkg/mpsserver"
)

// A process pod is a pod whose own command the devcluster kubelet runs,
// because what it does matters to the node: the MPS server pods the plugin
// creates. With a real runtime (noderuntime.OCIRuntime.MPSServer set) it runs
// gpudra-mps-server in a container of its own; without, the server's code
// runs in this process, its paths translated to the host's. Every other
// pod's containers run the probe (noderuntime.OCIRuntime) or are only resolved.

// processCommands are the container commands (by base name) the kubelet
// can run. A command gets its arguments (command[1:] then args) and the
// environment to add for its child processes, both with container paths
// already translated to host paths.
var processCommands = map[string]func(ctx context.Context, args, env []string) error{
	noderuntime.MPSServerCommand: runMPSServer,
}

// runMPSServer is gpudra-mps-server's main, minus signals and logging
// (this process's own): ctx ends when the pod is deleted. The flags are the
// binary's, logging flags included, so that what the plugin passes is parsed
// as the image would.
func runMPSServer(ctx context.Context, args, env []string) error {
	c := component.New(noderuntime.MPSServerCommand)
	c.Flags.SetOutput(io.Discard)
	cfg := mpsserver.AddFlags(c.Flags)
	// The container's environment is not this process's.
	noEnv := func(string) (string, bool) { return "", false }
	if err := c.Parse(args, noEnv); err != nil {
		return fmt.Errorf("%s: %w", noderuntime.MPSServerCommand, err)
	}
	cfg.Tools.Env = append(cfg.Tools.Env, env...)
	return mpsserver.Run(ctx, *cfg)
}

// processCommand returns the runner of the pod's one container, or nil
// when the pod is simulated.
func processCommand(pod *v1.Pod) func(ctx context.Context, args, env []string) error {
	if len(pod.Spec.Containers) != 1 || len(pod.Spec.InitContainers) != 0 || len(pod.Spec.Containers[0].Command) == 0 {
		return nil
	}
	return processCommands[path.Base(pod.Spec.Containers[0].Command[0])]
}

// containerArgv is the container's arguments and added environment as the
// host sees them: every value that is a hostPath volume's mount path, or
// below it, is rewritten to the volume's host path (--driver-root=/driver-root
// becomes --driver-root=/ where the host's / is mounted there). The
// container marker comes last, so that the container cannot override it.
func containerArgv(pod *v1.Pod) (args, env []string) {
	c := pod.Spec.Containers[0]
	hostPaths := map[string]string{}
	for _, vol := range pod.Spec.Volumes {
		if vol.HostPath != nil {
			hostPaths[vol.Name] = vol.HostPath.Path
		}
	}
	type mount struct{ container, host string }
	var mounts []mount
	for _, m := range c.VolumeMounts {
		if h, ok := hostPaths[m.Name]; ok && m.SubPath == "" {
			mounts = append(mounts, mount{path.Clean(m.MountPath), h})
		}
	}
	// Longest first: /dev/shm under a mount of /dev goes to its own volume.
	sort.Slice(mounts, func(i, j int) bool { return len(mounts[i].container) > len(mounts[j].container) })
	translate := func(v string) string {
		for _, m := range mounts {
			if v == m.container {
				return m.host
			}
			if prefix := strings.TrimSuffix(m.container, "/") + "/"; strings.HasPrefix(v, prefix) {
				return path.Join(m.host, strings.TrimPrefix(v, prefix))
			}
		}
		return v
	}
	for _, a := range append(append([]string{}, c.Command[1:]...), c.Args...) {
		if name, value, ok := strings.Cut(a, "="); ok && strings.HasPrefix(name, "-") {
			args = append(args, name+"="+translate(value))
		} else {
			args = append(args, translate(a))
		}
	}
	for _, e := range c.Env {
		if e.ValueFrom == nil {
			env = append(env, e.Name+"="+translate(e.Value))
		}
	}
	return args, append(env, noderuntime.ContainerMarker(string(pod.UID)))
}

// processPod is a process pod's running container.
type processPod struct {
	cancel   context.CancelFunc
	done     chan struct{}
	restarts int32
}

// Restart backoff of a process pod's container, as the kubelet's crash
// loop backoff but shorter: tests wait for it.
const (
	processBackoffMin = 500 * time.Millisecond
	processBackoffMax = 10 * time.Second
	// processStopTimeout bounds the wait for a deleted pod's process; the
	// MPS server kills its daemon after 10 s itself.
	processStopTimeout = 30 * time.Second
)

// startProcess starts the pod's container unless it runs already. The
// process lives until the pod is deleted (stopProcess) or the kubelet
// stops, and is restarted whenever it returns.
func (k *kubelet) startProcess(ctx context.Context, pod *v1.Pod, run func(ctx context.Context, args, env []string) error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if _, ok := k.procs[pod.UID]; ok {
		return
	}
	logger := klog.LoggerWithValues(klog.LoggerWithName(klog.FromContext(ctx), "process"), "podUID", pod.UID)
	pctx, cancel := context.WithCancel(klog.NewContext(ctx, logger))
	p := &processPod{cancel: cancel, done: make(chan struct{})}
	k.procs[pod.UID] = p
	// The kubelet makes a DirectoryOrCreate hostPath before the container
	// starts (the MPS server's /dev/shm, which its clients mount too).
	for _, vol := range pod.Spec.Volumes {
		if h := vol.HostPath; h != nil && h.Type != nil && *h.Type == v1.HostPathDirectoryOrCreate {
			if err := os.MkdirAll(h.Path, 0o755); err != nil {
				logger.Error(err, "Create hostPath volume", "volume", vol.Name)
			}
		}
	}
	args, env := containerArgv(pod)
	runOnce := func(ctx context.Context) error { return run(ctx, args, env) }
	if k.runtime != nil && k.runtime.MPSServer != "" {
		// A real container in its own namespaces, with the pod's own
		// paths: nothing translated.
		c := noderuntime.PodProcessContainer(pod)
		if c.Privileged {
			c.Devices = noderuntime.NvidiaDeviceNodes(k.devRoot)
		}
		id := runcID(pod.UID, c.Name)
		// No cgroup or log of the kubelet's: the process runs in the
		// runtime's (noderuntime.OCIRuntime.Run).
		k.containers[pod.UID] = []runningContainer{{Name: c.Name, ID: id}}
		runOnce = func(ctx context.Context) error { return k.runtime.Run(ctx, id, c, processStopTimeout-5*time.Second) }
	}
	go func() {
		defer close(p.done)
		backoff := processBackoffMin
		for {
			started := time.Now()
			logger.V(2).Info("Starting process pod's container", "args", args)
			err := runOnce(pctx)
			if pctx.Err() != nil {
				logger.V(2).Info("Process pod's container stopped", "err", err)
				return
			}
			if err == nil {
				err = errors.New("exited")
			}
			if time.Since(started) > processBackoffMax {
				backoff = processBackoffMin
			}
			logger.Error(err, "Process pod's container exited; restarting", "backoff", backoff)
			k.recordRestart(pctx, pod, p, err)
			select {
			case <-pctx.Done():
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, processBackoffMax)
		}
	}()
}

// stopProcess stops the pod's container, if it runs, and waits for it
// (bounded): the deletion is confirmed only once it is gone.
func (k *kubelet) stopProcess(ctx context.Context, uid types.UID) {
	k.mu.Lock()
	p := k.procs[uid]
	delete(k.procs, uid)
	k.mu.Unlock()
	if p == nil {
		return
	}
	p.cancel()
	select {
	case <-p.done:
	case <-time.After(processStopTimeout):
		klog.FromContext(ctx).Error(nil, "Process pod's container did not stop in time; the pod goes anyway", "podUID", uid, "timeout", processStopTimeout)
	}
}

// stopAllProcesses stops every process pod's container, when the kubelet
// stops.
func (k *kubelet) stopAllProcesses(ctx context.Context) {
	k.mu.Lock()
	uids := make([]types.UID, 0, len(k.procs))
	for uid := range k.procs {
		uids = append(uids, uid)
	}
	k.mu.Unlock()
	for _, uid := range uids {
		k.stopProcess(ctx, uid)
	}
}

// restartCount is what the pod's container status says of its restarts.
func (k *kubelet) restartCount(uid types.UID) int32 {
	k.mu.Lock()
	defer k.mu.Unlock()
	if p := k.procs[uid]; p != nil {
		return p.restarts
	}
	return 0
}

// recordRestart counts a restart in the container status, best effort: a
// conflict with the pod's deletion or a status update is not worth more.
func (k *kubelet) recordRestart(ctx context.Context, pod *v1.Pod, p *processPod, exitErr error) {
	k.mu.Lock()
	p.restarts++
	count := p.restarts
	k.mu.Unlock()
	k.recorder.Eventf(pod, v1.EventTypeWarning, "BackOff", "Back-off restarting failed container: %v", exitErr)
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := k.client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if cur.UID != pod.UID || cur.DeletionTimestamp != nil {
			return nil
		}
		now := metav1.Now()
		for i := range cur.Status.ContainerStatuses {
			cs := &cur.Status.ContainerStatuses[i]
			cs.RestartCount = count
			cs.LastTerminationState = v1.ContainerState{Terminated: &v1.ContainerStateTerminated{
				ExitCode: 1, Reason: "Error", Message: exitErr.Error(), FinishedAt: now}}
			cs.State = v1.ContainerState{Running: &v1.ContainerStateRunning{StartedAt: now}}
		}
		_, err = k.client.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, cur, metav1.UpdateOptions{})
		return err
	})
	if err != nil && ctx.Err() == nil {
		klog.FromContext(ctx).V(2).Info("Could not record the container's restart", "err", err)
	}
}
