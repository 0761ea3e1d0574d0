package submit

import (
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/gpudra/gpudra/pkg/kuberay"
)

// KubeRay's RayJob (ray.io/v1, KubeRay v1.5). Only the fields submit sets
// and reads are here: KubeRay's Go module pins other Kubernetes versions
// than gpudra's, so it is not imported; the object goes through the
// dynamic client.
const (
	KindRayJob = "RayJob"
	// RayHeadContainer and RayWorkerContainer are the Ray containers'
	// names, as in KubeRay's samples.
	RayHeadContainer   = "ray-head"
	RayWorkerContainer = "ray-worker"
	// RayWorkerGroupName is the one worker group's name.
	RayWorkerGroupName = "gpus"
	// rayNumGPUs is the rayStartParams key for ray start --num-gpus.
	rayNumGPUs = "num-gpus"
)

// RayJobs is the RayJob resource.
var RayJobs = kuberay.RayJobs

// RayJob is the part of a KubeRay RayJob that submit writes.
type RayJob struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              RayJobSpec `json:"spec"`
}

// RayJobSpec is the part of spec submit sets.
type RayJobSpec struct {
	// Entrypoint is the command KubeRay's submitter runs with ray job
	// submit, a shell line.
	Entrypoint string `json:"entrypoint"`
	// ShutdownAfterJobFinishes deletes the Ray cluster (and with its pods
	// their claims: the GPUs go back) once the job ends.
	ShutdownAfterJobFinishes bool           `json:"shutdownAfterJobFinishes"`
	RayClusterSpec           RayClusterSpec `json:"rayClusterSpec"`
}

// RayClusterSpec is a head and worker groups.
type RayClusterSpec struct {
	HeadGroupSpec    RayHeadGroup     `json:"headGroupSpec"`
	WorkerGroupSpecs []RayWorkerGroup `json:"workerGroupSpecs"`
}

// RayHeadGroup is the head's pod template and ray start's parameters.
type RayHeadGroup struct {
	RayStartParams map[string]string      `json:"rayStartParams"`
	Template       corev1.PodTemplateSpec `json:"template"`
}

// RayWorkerGroup is a worker group of a fixed size.
type RayWorkerGroup struct {
	GroupName      string                 `json:"groupName"`
	Replicas       *int32                 `json:"replicas,omitempty"`
	MinReplicas    *int32                 `json:"minReplicas,omitempty"`
	MaxReplicas    *int32                 `json:"maxReplicas,omitempty"`
	RayStartParams map[string]string      `json:"rayStartParams"`
	Template       corev1.PodTemplateSpec `json:"template"`
}

// rayJob is the RayJob of workers pods of perPod GPUs each, from the claim
// template, and a head without GPUs: all one gang, as
// examples/ray/rayjob-gang.yaml (docs/ray.md).
func (s Spec) rayJob(labels map[string]string, workers, perPod int64, template string) *RayJob {
	gang := workers + 1
	head := s.podTemplate(RayHeadContainer, gang, "")
	worker := s.podTemplate(RayWorkerContainer, gang, template)
	for _, t := range []*corev1.PodTemplateSpec{&head, &worker} {
		// KubeRay runs ray start as the container's command, and decides
		// the restart policy; the user's command is the entrypoint.
		t.Spec.Containers[0].Command = nil
		t.Spec.RestartPolicy = ""
		// --duration is declared only (ShortestJobFirst): KubeRay makes a
		// Ray pod that a deadline stopped again, alone, outside its gang;
		// the RayJob's own activeDeadlineSeconds would count the wait in
		// the queue.
		t.Spec.ActiveDeadlineSeconds = nil
	}
	n := ptr.To(int32(workers))
	return &RayJob{
		TypeMeta:   metav1.TypeMeta{APIVersion: RayJobs.GroupVersion().String(), Kind: KindRayJob},
		ObjectMeta: metav1.ObjectMeta{Name: s.Name, Namespace: s.Namespace, Labels: labels},
		Spec: RayJobSpec{
			Entrypoint:               shellJoin(s.Command),
			ShutdownAfterJobFinishes: true,
			RayClusterSpec: RayClusterSpec{
				// KubeRay derives --num-gpus only from an nvidia.com/gpu
				// limit, which a DRA pod has not: it is given here.
				HeadGroupSpec: RayHeadGroup{RayStartParams: map[string]string{rayNumGPUs: "0"}, Template: head},
				// A gang's size is fixed: min = max = replicas, no
				// autoscaling.
				WorkerGroupSpecs: []RayWorkerGroup{{GroupName: RayWorkerGroupName, Replicas: n, MinReplicas: n, MaxReplicas: ptr.To(*n),
					RayStartParams: map[string]string{rayNumGPUs: strconv.FormatInt(perPod, 10)}, Template: worker}},
			},
		},
	}
}

// shellJoin quotes each argument for the shell that runs the entrypoint,
// so that the words after -- reach the program as typed.
func shellJoin(args []string) string {
	out := make([]string, len(args))
	for i, a := range args {
		if a != "" && strings.Trim(a, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:,+@%") == "" {
			out[i] = a
			continue
		}
		out[i] = "'" + strings.ReplaceAll(a, "'", `'"'"'`) + "'"
	}
	return strings.Join(out, " ")
}
