package devcluster

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
)

// runcID is a container's runc id: the pod's UID and the container's name
// (runc takes letters, digits and -_.+).
func runcID(uid types.UID, container string) string { return string(uid) + "-" + container }

// containerID is the container's status ID: runc://<id> where it runs for
// real, devcluster://<pod UID>/<name> where it is only resolved.
func (k *kubelet) containerID(pod *v1.Pod, container string) string {
	k.mu.Lock()
	defer k.mu.Unlock()
	if len(k.containers[pod.UID]) > 0 {
		return "runc://" + runcID(pod.UID, container)
	}
	return "devcluster://" + string(pod.UID) + "/" + container
}

// startContainers runs the pod's containers with the node's runtime and
// records what each probe reported in its view. A container that does not
// start fails the sync (retried); those already started are stopped, so a
// pod is never reported Running without its containers.
func (k *kubelet) startContainers(ctx context.Context, pod *v1.Pod, views map[string]ContainerView, specs map[string]*oci.Spec) (err error) {
	var started []string
	for _, c := range pod.Spec.Containers {
		id := runcID(pod.UID, c.Name)
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
		if process.Args, err = probeCommand(pod); err != nil {
			return err
		}
		spec.Process = &process
		start := time.Now()
		report, err := k.runtime.Start(ctx, id, &spec)
		if err != nil {
			for _, s := range append(started, id) {
				if serr := k.runtime.Stop(ctx, s); serr != nil {
					klog.FromContext(ctx).Error(serr, "Stop a container of a pod that did not start", "container", s)
				}
			}
			return fmt.Errorf("container %s: %w", c.Name, err)
		}
		started = append(started, id)
		// docs/benchmarks.md reads these: the start-up a real runtime adds.
		klog.FromContext(ctx).V(2).Info("Container started", "container", id, "seconds", time.Since(start).Seconds())
		v := views[c.Name]
		v.Report = report
		views[c.Name] = v
	}
	k.mu.Lock()
	k.containers[pod.UID] = started
	k.mu.Unlock()
	return nil
}

// stopContainers stops a pod's real containers, if it has any.
func (k *kubelet) stopContainers(ctx context.Context, uid types.UID) {
	k.mu.Lock()
	ids := k.containers[uid]
	delete(k.containers, uid)
	k.mu.Unlock()
	for _, id := range ids {
		if err := k.runtime.Stop(ctx, id); err != nil {
			klog.FromContext(ctx).Error(err, "Stop container", "container", id)
		}
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

func probeCommand(pod *v1.Pod) ([]string, error) {
	data, ok := pod.Annotations[ProbeCommandAnnotation]
	if !ok {
		return nil, nil
	}
	var cmd []string
	if err := json.Unmarshal([]byte(data), &cmd); err != nil {
		return nil, fmt.Errorf("annotation %s: want a JSON array of strings: %w", ProbeCommandAnnotation, err)
	}
	return cmd, nil
}
