package nodeagent

import (
	"context"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// Container reasons, as the kubelet writes them.
const (
	reasonCompleted        = "Completed"
	reasonError            = "Error"
	reasonCrashLoopBackOff = "CrashLoopBackOff"
	reasonPodCompleted     = "PodCompleted"
	reasonNotReady         = "ContainersNotReady"
)

// exitWatchInterval is how often the kubelet looks for containers that
// exited: one read of a small file per running container.
const exitWatchInterval = 500 * time.Millisecond

// statusAfterExits is the pod's status once the containers in exits have
// exited with those codes, as the kubelet computes it. A container the
// restart policy does not restart (Never; OnFailure after exit 0) is
// Terminated (Completed at 0, else Error); one it would restart waits in
// CrashLoopBackOff with the exit as its last state: devcluster restarts no
// exited container. Once every container is terminated the pod is
// Succeeded (all exited 0) or Failed; until then Running, not ready. A
// container already Terminated keeps its times, so a status computed
// again is the same. Pure.
func statusAfterExits(pod *v1.Pod, exits map[string]int32, now metav1.Time) v1.PodStatus {
	status := *pod.Status.DeepCopy()
	current := map[string]v1.ContainerStatus{}
	for _, cs := range pod.Status.ContainerStatuses {
		current[cs.Name] = cs
	}
	status.ContainerStatuses = nil
	allTerminated, anyFailed := true, false
	for _, c := range pod.Spec.Containers {
		cs, ok := current[c.Name]
		if !ok {
			cs = v1.ContainerStatus{Name: c.Name, Image: c.Image}
		}
		code, exited := exits[c.Name]
		if !exited {
			allTerminated = false
			status.ContainerStatuses = append(status.ContainerStatuses, cs)
			continue
		}
		term := v1.ContainerStateTerminated{ExitCode: code, Reason: reasonCompleted, FinishedAt: now, ContainerID: cs.ContainerID}
		if code != 0 {
			term.Reason = reasonError
		}
		switch {
		case cs.State.Running != nil:
			term.StartedAt = cs.State.Running.StartedAt
		case cs.State.Terminated != nil:
			term.StartedAt, term.FinishedAt = cs.State.Terminated.StartedAt, cs.State.Terminated.FinishedAt
		case cs.LastTerminationState.Terminated != nil:
			term.StartedAt, term.FinishedAt = cs.LastTerminationState.Terminated.StartedAt, cs.LastTerminationState.Terminated.FinishedAt
		}
		cs.Ready, cs.Started = false, ptrTo(false)
		policy := pod.Spec.RestartPolicy
		if policy == v1.RestartPolicyAlways || policy == "" || (policy == v1.RestartPolicyOnFailure && code != 0) {
			allTerminated = false
			cs.LastTerminationState = v1.ContainerState{Terminated: &term}
			cs.State = v1.ContainerState{Waiting: &v1.ContainerStateWaiting{Reason: reasonCrashLoopBackOff,
				Message: fmt.Sprintf("exited with %d; devcluster's kubelet restarts no exited container", code)}}
		} else {
			if code != 0 {
				anyFailed = true
			}
			cs.State = v1.ContainerState{Terminated: &term}
		}
		status.ContainerStatuses = append(status.ContainerStatuses, cs)
	}
	notReady := reasonNotReady
	if allTerminated {
		status.Phase, notReady = v1.PodSucceeded, reasonPodCompleted
		if anyFailed {
			status.Phase = v1.PodFailed
		}
	}
	for _, t := range []v1.PodConditionType{v1.ContainersReady, v1.PodReady} {
		if cond := podCondition(&pod.Status, t); cond != nil && cond.Status == v1.ConditionFalse && cond.Reason == notReady {
			continue // unchanged: keeps its transition time
		}
		setCondition(&status, v1.PodCondition{Type: t, Status: v1.ConditionFalse, Reason: notReady, LastTransitionTime: now})
	}
	return status
}

func podCondition(status *v1.PodStatus, t v1.PodConditionType) *v1.PodCondition {
	for i := range status.Conditions {
		if status.Conditions[i].Type == t {
			return &status.Conditions[i]
		}
	}
	return nil
}

// exitsReported says whether the pod's status already shows every exit.
func exitsReported(pod *v1.Pod, exits map[string]int32) bool {
	for _, cs := range pod.Status.ContainerStatuses {
		if _, exited := exits[cs.Name]; exited && cs.State.Running != nil {
			return false
		}
	}
	return true
}

// watchExits syncs every running pod of the node one of whose containers
// has exited and whose status does not show it yet, until ctx ends.
func (k *kubelet) watchExits(ctx context.Context) {
	wait.UntilWithContext(ctx, func(ctx context.Context) {
		pods, err := k.pods.List(labels.Everything())
		if err != nil {
			return
		}
		for _, pod := range pods {
			if pod.Status.Phase != v1.PodRunning || pod.DeletionTimestamp != nil {
				continue
			}
			if exits := k.containerExits(pod.UID); len(exits) > 0 && !exitsReported(pod, exits) {
				k.queue.Add(cache.MetaObjectToName(pod).String())
			}
		}
	}, exitWatchInterval)
}

// syncExits writes the status of a running pod some of whose containers
// exited; once it is Succeeded or Failed, its containers are removed and
// its claims unprepared (syncTerminated), as the kubelet does for a pod
// that has terminated.
func (k *kubelet) syncExits(ctx context.Context, pod *v1.Pod, exits map[string]int32) error {
	if !exitsReported(pod, exits) {
		updated := pod.DeepCopy()
		updated.Status = statusAfterExits(pod, exits, metav1.Now())
		written, err := k.client.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, updated, metav1.UpdateOptions{})
		if err != nil {
			return fmt.Errorf("record the containers' exit: %w", err)
		}
		klog.FromContext(ctx).V(2).Info("Containers exited", "exitCodes", exits, "phase", written.Status.Phase)
		pod = written
	}
	if pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed {
		return k.syncTerminated(ctx, pod)
	}
	return nil
}

// syncTerminated removes what a Succeeded or Failed pod's containers left
// (stopped, off the simulated devices, cgroup and log links gone) and
// unprepares its claims, as the kubelet does once a pod has terminated:
// the claims are the DRA driver's to release now, not at the pod's
// deletion. Both are no-ops once done.
func (k *kubelet) syncTerminated(ctx context.Context, pod *v1.Pod) error {
	k.stopContainers(ctx, pod.UID)
	if err := k.dra.UnprepareResources(ctx, pod); err != nil {
		k.recorder.Event(pod, v1.EventTypeWarning, reasonFailedUnprepare, err.Error())
		return err
	}
	return nil
}
