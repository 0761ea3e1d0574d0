package imagemode

import (
	"context"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
)

// A pod run from the image: its status, written as a kubelet writes it.

// podState is what report says of the container: running since
// startedAt, or waiting (ContainerCreating, CrashLoopBackOff) with a
// message; finishedAt is when it last ended.
type podState struct {
	waiting, message      string
	startedAt, finishedAt time.Time
}

// report writes the pod's status as a kubelet would: Running with its
// container running and ready (or not); Pending while its first container
// cannot be set up; the container waiting in CrashLoopBackOff with the end
// of its output once it ended.
func (p *Pod) report(ctx context.Context, st podState) {
	p.mu.Lock()
	if !st.finishedAt.IsZero() {
		p.lastFinished = st.finishedAt
	}
	restarts, lastExit, lastFinished, id := p.restarts, p.lastExit, p.lastFinished, p.id
	p.mu.Unlock()
	running := st.waiting == ""
	ready := p.ready.Load() && running
	c := p.pod.Spec.Containers[0]
	now := metav1.Now()
	cs := v1.ContainerStatus{Name: c.Name, Image: c.Image, ImageID: "sha256:" + p.r.img.Digest.Hex,
		Ready: ready, RestartCount: restarts, Started: ptr.To(running)}
	if running || restarts > 0 {
		cs.ContainerID = "runc://" + id
	}
	if running {
		cs.State.Running = &v1.ContainerStateRunning{StartedAt: metav1.NewTime(st.startedAt)}
	} else {
		cs.State.Waiting = &v1.ContainerStateWaiting{Reason: st.waiting, Message: st.message}
	}
	if lastExit != "" {
		// The exit code is not known here (runc state does not keep it).
		cs.LastTerminationState.Terminated = &v1.ContainerStateTerminated{Reason: "Error", Message: lastExit, FinishedAt: metav1.NewTime(lastFinished)}
	}
	phase := v1.PodRunning
	if !running && restarts == 0 {
		phase = v1.PodPending
	}
	cond := func(t v1.PodConditionType, ok bool) v1.PodCondition {
		s := v1.ConditionFalse
		if ok {
			s = v1.ConditionTrue
		}
		return v1.PodCondition{Type: t, Status: s, LastTransitionTime: now}
	}
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := p.r.admin.CoreV1().Pods(p.pod.Namespace).Get(ctx, p.pod.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if cur.UID != p.pod.UID {
			return nil // another pod of that name now
		}
		cur.Status = v1.PodStatus{Phase: phase, StartTime: cur.Status.StartTime,
			Conditions: []v1.PodCondition{cond(v1.PodScheduled, true), cond(v1.PodInitialized, true),
				cond(v1.ContainersReady, ready), cond(v1.PodReady, ready)},
			ContainerStatuses: []v1.ContainerStatus{cs}, QOSClass: cur.Status.QOSClass}
		if cur.Status.StartTime == nil {
			cur.Status.StartTime = &now
		}
		_, err = p.r.admin.CoreV1().Pods(p.pod.Namespace).UpdateStatus(ctx, cur, metav1.UpdateOptions{})
		return err
	})
	if err != nil && ctx.Err() == nil && !apierrors.IsNotFound(err) {
		klog.FromContext(ctx).Error(err, "Pod status")
	}
}
