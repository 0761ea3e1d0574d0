package nodeagent

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"path"
	"slices"
	"time"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/apis/core/v1/helper/qos"

	"github.com/gpudra/gpudra/devcluster/noderuntime"
	"github.com/gpudra/gpudra/pkg/probe"
)

// runcID is a process pod's container's runc id: the pod's UID and the
// container's name (runc takes letters, digits and -_.+).
func runcID(uid types.UID, container string) string { return string(uid) + "-" + container }

// containerRunner runs a pod's containers: *noderuntime.OCIRuntime (a double in unit
// tests).
type containerRunner interface {
	// Start runs the container and returns what its probe reported.
	Start(ctx context.Context, id string, spec *oci.Spec) (*probe.Report, error)
	// PID is the host PID of the container's first process.
	PID(ctx context.Context, id string) (int, error)
	// Stop kills and deletes the container; one gone is no error.
	Stop(ctx context.Context, id string) error
	// RemoveCgroup removes a pod's cgroup once its containers are gone.
	RemoveCgroup(cgroup string) error
	// Exited says whether the container's process has exited by itself,
	// and its exit code.
	Exited(id string) (int32, bool)
}

// runningContainer is a container the kubelet started for a pod.
type runningContainer struct {
	Name string
	// ID is the container's ID (newContainerID), its runc id too.
	ID string
	// PID is its first process on the host, where the kubelet listed it
	// on the node's simulated devices (SimLoadEnv); 0 otherwise.
	PID int
	// Cgroup is its cgroup (containerCgroupPath), Log its log; both
	// empty for a process pod's container.
	Cgroup string
	Log    noderuntime.ContainerLog
}

// newContainerID is a container's ID: 64 hex digits, the shape of
// containerd's and CRI-O's (which node agents parse out of cgroup paths),
// unique to this try of this container of this pod: a start retried gets
// new IDs, as a real runtime creates new containers.
func newContainerID(uid types.UID, container string, try uint64) string {
	sum := sha256.Sum256([]byte(fmt.Sprintf("%s/%s/%d", uid, container, try)))
	return hex.EncodeToString(sum[:])
}

// containerCgroupPath is the container's cgroup, where the kubelet's
// cgroupfs driver puts it (cgroup v1 and v2 alike): below the pod's,
// below its QoS class's, below /kubepods.
func containerCgroupPath(pod *v1.Pod, id string) string {
	podCgroup := "pod" + string(pod.UID)
	switch qos.GetPodQOS(pod) {
	case v1.PodQOSGuaranteed:
		return path.Join("/kubepods", podCgroup, id)
	case v1.PodQOSBurstable:
		return path.Join("/kubepods/burstable", podCgroup, id)
	default:
		return path.Join("/kubepods/besteffort", podCgroup, id)
	}
}

// containerID is the container's status ID: runc://<id> where it runs for
// real, devcluster://<pod UID>/<name> where it is only resolved.
func (k *kubelet) containerID(pod *v1.Pod, container string) string {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, c := range k.containers[pod.UID] {
		if c.Name == container {
			return "runc://" + c.ID
		}
	}
	return "devcluster://" + string(pod.UID) + "/" + container
}

// startContainers runs the pod's containers with the node's runtime and
// records what each probe reported in its view. Each gets its log link
// before it starts and, where it declares a load (loads, SimLoadEnv), its
// process on each simulated device its CDI devices give it. A container
// that does not start fails the sync (retried); what was done for it and
// for the pod's other containers is undone (stopped, processes off the
// devices, logs gone), so a pod is never reported Running without its
// containers and a failed try leaves nothing behind.
func (k *kubelet) startContainers(ctx context.Context, pod *v1.Pod, views map[string]noderuntime.ContainerView, specs map[string]*oci.Spec, loads map[string]SimLoad) error {
	// A start retried (the pod's status write failed, or a stale cache
	// synced it again) replaces the containers of the earlier try.
	k.stopContainers(ctx, pod.UID)
	k.mu.Lock()
	k.tries++
	try := k.tries
	k.mu.Unlock()
	var started []runningContainer
	fail := func(err error) error {
		for _, c := range started {
			k.removeContainer(ctx, c)
		}
		k.removePodCgroup(ctx, pod.UID, started)
		return err
	}
	for _, c := range pod.Spec.Containers {
		id := newContainerID(pod.UID, c.Name, try)
		// Listed before anything is done for it: a failure undoes it too.
		started = append(started, runningContainer{Name: c.Name, ID: id, Cgroup: containerCgroupPath(pod, id),
			Log: noderuntime.ContainerLogPaths(k.logRoot, pod, c.Name, id)})
		rc := &started[len(started)-1]
		// The container's own variables (literal ones) come first, as the
		// kubelet hands them to the runtime; the CDI edits after them win.
		spec := *specs[c.Name]
		process := *spec.Process
		var env []string
		for _, e := range c.Env {
			if e.ValueFrom == nil {
				env = append(env, e.Name+"="+e.Value)
			}
		}
		process.Env = append(env, process.Env...)
		var err error
		if process.Args, err = probeArgs(pod, &c); err != nil {
			return fail(err)
		}
		spec.Process = &process
		linux := *spec.Linux
		linux.CgroupsPath = rc.Cgroup
		spec.Linux = &linux
		if k.logRoot != "" {
			if err := rc.Log.Create(); err != nil {
				return fail(fmt.Errorf("container %s: %w", c.Name, err))
			}
		}
		start := time.Now()
		report, err := k.runner.Start(ctx, id, &spec)
		if err != nil {
			return fail(fmt.Errorf("container %s: %w", c.Name, err))
		}
		// docs/benchmarks.md reads these: the start-up a real runtime adds.
		klog.FromContext(ctx).V(2).Info("Container started", "container", c.Name, "containerID", id, "seconds", time.Since(start).Seconds())
		if load, ok := loads[c.Name]; ok && k.sims != nil {
			if rc.PID, err = k.runner.PID(ctx, id); err != nil {
				return fail(fmt.Errorf("container %s: %w", c.Name, err))
			}
			for _, dev := range views[c.Name].GPUs {
				if err := k.sims.StartProcess(dev, rc.PID, load.SMShare, load.MemoryBytes); err != nil {
					return fail(fmt.Errorf("container %s: %s: process %d on %s: %w", c.Name, SimLoadEnv, rc.PID, dev, err))
				}
			}
			klog.FromContext(ctx).V(2).Info("Container's load on its devices", "container", c.Name, "pid", rc.PID,
				"devices", views[c.Name].GPUs, "smShare", load.SMShare, "memoryBytes", load.MemoryBytes)
		}
		v := views[c.Name]
		v.Report = report
		views[c.Name] = v
	}
	k.mu.Lock()
	k.containers[pod.UID] = started
	k.mu.Unlock()
	return nil
}

// removeContainer undoes startContainers for one container, in the order
// a node agent never sees a half: its process off the devices first (a
// listed process always has its container), then the container, then its
// log link.
func (k *kubelet) removeContainer(ctx context.Context, c runningContainer) {
	logger := klog.FromContext(ctx)
	if c.PID != 0 && k.sims != nil {
		k.sims.EndProcess(c.PID)
	}
	if err := k.runner.Stop(ctx, c.ID); err != nil {
		logger.Error(err, "Stop container", "container", c.Name, "containerID", c.ID)
	}
	if k.logRoot != "" && c.Log.Link != "" {
		if err := c.Log.Remove(); err != nil {
			logger.Error(err, "Remove container log", "container", c.Name, "containerID", c.ID)
		}
	}
}

// stopContainers stops a pod's real containers, if it has any.
func (k *kubelet) stopContainers(ctx context.Context, uid types.UID) {
	k.mu.Lock()
	containers := k.containers[uid]
	delete(k.containers, uid)
	k.mu.Unlock()
	for _, c := range containers {
		k.removeContainer(ctx, c)
	}
	k.removePodCgroup(ctx, uid, containers)
}

// removePodCgroup removes the cgroup of a pod whose containers are gone.
func (k *kubelet) removePodCgroup(ctx context.Context, uid types.UID, containers []runningContainer) {
	if len(containers) == 0 || containers[0].Cgroup == "" {
		return
	}
	if err := k.runner.RemoveCgroup(path.Dir(containers[0].Cgroup)); err != nil {
		klog.FromContext(ctx).Error(err, "Remove the pod's cgroup", "podUID", uid)
	}
}

// stopAllContainers stops every real container, when the kubelet stops:
// a container must not outlive its cluster.
func (k *kubelet) stopAllContainers(ctx context.Context) {
	k.mu.Lock()
	var uids []types.UID
	for uid := range k.containers {
		uids = append(uids, uid)
	}
	k.mu.Unlock()
	for _, uid := range uids {
		k.stopContainers(ctx, uid)
	}
}

// ProbeCommandAnnotation on a pod holds a command (a JSON array) that the
// probe of each of its real containers runs before its report, the output
// in the report (make gpu-smoke runs nvidia-smi -L).
const ProbeCommandAnnotation = "devcluster.gpudra.dev/probe-command"

// probeArgs are the arguments of the probe that runs as the container's
// process. Every container runs the probe, whatever its command: the
// image is not run. A container whose command is the probe itself
// (noderuntime.ProbeCommand, any directory) gives it its arguments, so a
// pod says what the probe does: `gpudra-probe --exit-after=5s` is a job's
// container that runs 5 s and completes (exit 0). The pod's probe command
// (ProbeCommandAnnotation) comes after --, unless the container's
// arguments have a command of their own.
func probeArgs(pod *v1.Pod, c *v1.Container) ([]string, error) {
	var args []string
	if len(c.Command) > 0 && path.Base(c.Command[0]) == noderuntime.ProbeCommand {
		args = append(append(args, c.Command[1:]...), c.Args...)
	}
	data, ok := pod.Annotations[ProbeCommandAnnotation]
	if !ok || slices.Contains(args, "--") {
		return args, nil
	}
	var cmd []string
	if err := json.Unmarshal([]byte(data), &cmd); err != nil {
		return nil, fmt.Errorf("annotation %s: want a JSON array of strings: %w", ProbeCommandAnnotation, err)
	}
	if len(cmd) == 0 {
		return args, nil
	}
	return append(append(args, "--"), cmd...), nil
}

// containerExits are the exit codes of the pod's containers that have
// exited by themselves, by name; empty while all run (or it has none).
func (k *kubelet) containerExits(uid types.UID) map[string]int32 {
	k.mu.Lock()
	containers := k.containers[uid]
	k.mu.Unlock()
	exits := map[string]int32{}
	for _, c := range containers {
		if c.Cgroup == "" {
			continue // a process pod's container: restarted by startProcess
		}
		if code, ok := k.runner.Exited(c.ID); ok {
			exits[c.Name] = code
		}
	}
	return exits
}
