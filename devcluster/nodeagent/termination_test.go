package nodeagent

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestStatusAfterExits: what a pod's status becomes when its containers
// exit, by restart policy and exit codes, as the kubelet computes it.
func TestStatusAfterExits(t *testing.T) {
	started := metav1.NewTime(time.Date(2025, 1, 1, 10, 0, 0, 0, time.UTC))
	earlier := metav1.NewTime(started.Add(time.Minute))
	now := metav1.NewTime(started.Add(time.Hour))
	running := func(name string) v1.ContainerStatus {
		return v1.ContainerStatus{Name: name, Ready: true, Started: ptrTo(true), ContainerID: "runc://" + name,
			State: v1.ContainerState{Running: &v1.ContainerStateRunning{StartedAt: started}}}
	}
	pod := func(policy v1.RestartPolicy, statuses ...v1.ContainerStatus) *v1.Pod {
		p := &v1.Pod{Spec: v1.PodSpec{RestartPolicy: policy}, Status: v1.PodStatus{Phase: v1.PodRunning,
			Conditions: []v1.PodCondition{{Type: v1.PodReady, Status: v1.ConditionTrue}, {Type: v1.ContainersReady, Status: v1.ConditionTrue}}}}
		for _, s := range statuses {
			p.Spec.Containers = append(p.Spec.Containers, v1.Container{Name: s.Name})
			p.Status.ContainerStatuses = append(p.Status.ContainerStatuses, s)
		}
		return p
	}
	terminated := func(code int32, reason string, finished metav1.Time) *v1.ContainerStateTerminated {
		return &v1.ContainerStateTerminated{ExitCode: code, Reason: reason, StartedAt: started, FinishedAt: finished, ContainerID: "runc://main"}
	}
	for _, tc := range []struct {
		name  string
		pod   *v1.Pod
		exits map[string]int32
		phase v1.PodPhase
		// state of container "main"; lastState its last termination.
		state, lastState *v1.ContainerStateTerminated
		waiting          string
		notReady         string
	}{
		{name: "Never, exit 0: Succeeded", pod: pod(v1.RestartPolicyNever, running("main")), exits: map[string]int32{"main": 0},
			phase: v1.PodSucceeded, state: terminated(0, "Completed", now), notReady: "PodCompleted"},
		{name: "Never, exit 3: Failed", pod: pod(v1.RestartPolicyNever, running("main")), exits: map[string]int32{"main": 3},
			phase: v1.PodFailed, state: terminated(3, "Error", now), notReady: "PodCompleted"},
		{name: "OnFailure, exit 0: Succeeded", pod: pod(v1.RestartPolicyOnFailure, running("main")), exits: map[string]int32{"main": 0},
			phase: v1.PodSucceeded, state: terminated(0, "Completed", now), notReady: "PodCompleted"},
		{name: "OnFailure, exit 1: restarted, so Running", pod: pod(v1.RestartPolicyOnFailure, running("main")), exits: map[string]int32{"main": 1},
			phase: v1.PodRunning, lastState: terminated(1, "Error", now), waiting: "CrashLoopBackOff", notReady: "ContainersNotReady"},
		{name: "Always, exit 0: restarted, so Running", pod: pod(v1.RestartPolicyAlways, running("main")), exits: map[string]int32{"main": 0},
			phase: v1.PodRunning, lastState: terminated(0, "Completed", now), waiting: "CrashLoopBackOff", notReady: "ContainersNotReady"},
		{name: "Never, one of two exited: Running", pod: pod(v1.RestartPolicyNever, running("main"), running("side")), exits: map[string]int32{"main": 0},
			phase: v1.PodRunning, state: terminated(0, "Completed", now), notReady: "ContainersNotReady"},
		{name: "Never, both exited, one failed: Failed", pod: pod(v1.RestartPolicyNever, running("main"), running("side")),
			exits: map[string]int32{"main": 0, "side": 137}, phase: v1.PodFailed, state: terminated(0, "Completed", now), notReady: "PodCompleted"},
		{name: "Never, computed again: the finish time kept", exits: map[string]int32{"main": 0}, pod: pod(v1.RestartPolicyNever,
			v1.ContainerStatus{Name: "main", ContainerID: "runc://main", State: v1.ContainerState{Terminated: terminated(0, "Completed", earlier)}}, running("side")),
			phase: v1.PodRunning, state: terminated(0, "Completed", earlier), notReady: "ContainersNotReady"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := statusAfterExits(tc.pod, tc.exits, now)
			assert.Equal(t, tc.phase, got.Phase)
			require.Len(t, got.ContainerStatuses, len(tc.pod.Spec.Containers))
			main := got.ContainerStatuses[0]
			assert.Equal(t, "main", main.Name)
			assert.False(t, main.Ready, "an exited container is not ready")
			assert.Equal(t, tc.state, main.State.Terminated)
			assert.Equal(t, tc.lastState, main.LastTerminationState.Terminated)
			if tc.waiting != "" {
				require.NotNil(t, main.State.Waiting)
				assert.Equal(t, tc.waiting, main.State.Waiting.Reason)
			} else {
				assert.Nil(t, main.State.Waiting)
			}
			for _, ct := range []v1.PodConditionType{v1.PodReady, v1.ContainersReady} {
				cond := podCondition(&got, ct)
				require.NotNil(t, cond, ct)
				assert.Equal(t, v1.ConditionFalse, cond.Status, ct)
				assert.Equal(t, tc.notReady, cond.Reason, ct)
			}
			assert.Equal(t, v1.PodRunning, tc.pod.Status.Phase, "the pod given is not changed")
			assert.True(t, exitsReported(&v1.Pod{Status: got}, tc.exits), "the status computed shows every exit")
		})
	}
	assert.False(t, exitsReported(pod(v1.RestartPolicyNever, running("main")), map[string]int32{"main": 0}), "a running status does not show the exit")
}

// TestProbeArgs: every container runs the probe; one whose command is the
// probe gives it its arguments, and the pod's probe command comes after --
// unless the container has one.
func TestProbeArgs(t *testing.T) {
	annotated := map[string]string{ProbeCommandAnnotation: `["nvidia-smi","-L"]`}
	for _, tc := range []struct {
		name        string
		annotations map[string]string
		container   v1.Container
		want        []string
		wantErr     string
	}{
		{name: "another command: the probe, nothing else", container: v1.Container{Command: []string{"python", "train.py", "--exit-after=1s"}}},
		{name: "the probe's arguments", container: v1.Container{Command: []string{"gpudra-probe", "--exit-after=5s"}, Args: []string{"-v=2"}},
			want: []string{"--exit-after=5s", "-v=2"}},
		{name: "the probe by path", container: v1.Container{Command: []string{"/usr/local/bin/gpudra-probe"}, Args: []string{"--exit"}},
			want: []string{"--exit"}},
		{name: "as args only: not the probe's", container: v1.Container{Args: []string{"gpudra-probe", "--exit"}}},
		{name: "the pod's probe command", annotations: annotated, container: v1.Container{Command: []string{"sleep"}},
			want: []string{"--", "nvidia-smi", "-L"}},
		{name: "the probe's arguments and the pod's command", annotations: annotated,
			container: v1.Container{Command: []string{"gpudra-probe", "--exit"}}, want: []string{"--exit", "--", "nvidia-smi", "-L"}},
		{name: "the container's own command wins", annotations: annotated,
			container: v1.Container{Command: []string{"gpudra-probe", "--exit", "--", "true"}}, want: []string{"--exit", "--", "true"}},
		{name: "a bad annotation", annotations: map[string]string{ProbeCommandAnnotation: `nvidia-smi`},
			wantErr: "annotation devcluster.gpudra.dev/probe-command: want a JSON array of strings"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Annotations: tc.annotations}}
			got, err := probeArgs(pod, &tc.container)
			if tc.wantErr != "" {
				assert.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, got)
		})
	}
}
