package submit

import (
	"cmp"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/kueue"
)

// The states of a submitted job.
const (
	StateWaiting   = "Waiting"
	StateStarting  = "Starting"
	StateRunning   = "Running"
	StateSucceeded = "Succeeded"
	StateFailed    = "Failed"
)

// gangCondition is the condition gpudra-controller writes on a gang's pods
// (pkg/controller/gang: PodConditionGang).
const gangCondition = corev1.PodConditionType(gpudrav1.GroupName + "/GangAllocated")

// positionRE reads the place the gang controller writes at the start of
// its condition's message (pkg/controller/gang: reportWaiting), as the
// dashboard reads it.
var positionRE = regexp.MustCompile(`^position (\d+) in queue (\S+): `)

// JobStatus is one submitted job as gpudra jobs shows it.
type JobStatus struct {
	Namespace, Name string
	// Kind is "Job" or "RayJob".
	Kind  string
	State string
	// Pods is "running/total" of the gang.
	Pods string
	// Queue is the GpuQueue it waits in; Position its place (1: next), 0
	// when not waiting or not known yet.
	Queue    string
	Position int
	// Reason and Message say why it waits (the gang condition's, else the
	// scheduler's).
	Reason, Message string
	// Devices are the allocated devices, <node>/<device>.
	Devices []string
	// Utilization is the mean GPU utilization of the devices (0 to 1),
	// nil when not read.
	Utilization *float64
	Age         time.Duration
}

// Status computes a job's status from its Job, its pods and the claims in
// its namespace. Pure.
func Status(job *batchv1.Job, pods []*corev1.Pod, claims map[string]*resourceapi.ResourceClaim, now time.Time) JobStatus {
	st := JobStatus{Namespace: job.Namespace, Name: job.Name, Kind: "Job", Age: now.Sub(job.CreationTimestamp.Time).Truncate(time.Second),
		Queue: queueOf(&job.Spec.Template)}
	for _, c := range job.Status.Conditions {
		if c.Status != corev1.ConditionTrue {
			continue
		}
		switch c.Type {
		case batchv1.JobComplete:
			st.State = StateSucceeded
		case batchv1.JobFailed:
			st.State, st.Reason, st.Message = StateFailed, c.Reason, c.Message
		}
	}
	gangStatus(&st, ptr.Deref(job.Spec.Completions, 1), pods, claims)
	return st
}

func queueOf(t *corev1.PodTemplateSpec) string {
	if q := t.Annotations[gpudrav1.AnnotationQueue]; q != "" {
		return q
	}
	return gpudrav1.DefaultQueue
}

// gangStatus fills in what the gang's pods say: running of total, the
// devices, and why it waits; and the state, unless already final.
func gangStatus(st *JobStatus, total int32, pods []*corev1.Pod, claims map[string]*resourceapi.ResourceClaim) {
	slices.SortFunc(pods, func(a, b *corev1.Pod) int { return cmp.Compare(a.Name, b.Name) })
	running, bound, succeeded, failed := 0, 0, 0, 0
	for _, p := range pods {
		switch {
		case p.Status.Phase == corev1.PodRunning:
			running++
		case p.Status.Phase == corev1.PodSucceeded:
			succeeded++
		case p.Status.Phase == corev1.PodFailed:
			failed++
		case p.Spec.NodeName != "":
			bound++
		}
		for _, c := range p.Status.Conditions {
			switch {
			case c.Type == gangCondition && c.Status == corev1.ConditionFalse && st.Reason == "":
				st.Reason, st.Message = c.Reason, c.Message
				if m := positionRE.FindStringSubmatch(c.Message); m != nil {
					st.Position, _ = strconv.Atoi(m[1])
					st.Queue = m[2]
					st.Message = strings.TrimPrefix(c.Message, m[0])
				}
			case c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && st.Reason == "" &&
				c.Reason != corev1.PodReasonSchedulingGated:
				// Gated pods say SchedulingGated: the gang's condition
				// says why; otherwise the scheduler's reason is the one.
				st.Reason, st.Message = c.Reason, c.Message
			}
		}
		for _, rcs := range p.Status.ResourceClaimStatuses {
			if rcs.ResourceClaimName == nil {
				continue
			}
			c := claims[*rcs.ResourceClaimName]
			if c == nil || c.Status.Allocation == nil {
				continue
			}
			for _, r := range c.Status.Allocation.Devices.Results {
				st.Devices = append(st.Devices, r.Pool+"/"+r.Device)
			}
		}
	}
	st.Pods = fmt.Sprintf("%d/%d", running, total)
	if st.State == "" {
		switch {
		case running > 0:
			st.State = StateRunning
		case bound > 0:
			st.State = StateStarting
		case len(pods) > 0 && succeeded+failed == len(pods) && failed > 0:
			// Every pod has ended, before the Job controller says so.
			st.State = StateFailed
		case len(pods) > 0 && succeeded == len(pods):
			st.State = StateSucceeded
		default:
			st.State = StateWaiting
		}
	}
	if st.State != StateWaiting {
		// What it waited for is over; a failure keeps the Job's reason.
		st.Position = 0
		if st.State != StateFailed {
			st.Reason, st.Message = "", ""
		}
	}
}

// RayJobStatus computes a RayJob's status from the RayJob (KubeRay's
// status.jobDeploymentStatus and status.jobStatus), the gang's pods (its
// head and workers) and the claims in its namespace. Pure.
func RayJobStatus(rj *unstructured.Unstructured, pods []*corev1.Pod, claims map[string]*resourceapi.ResourceClaim, now time.Time) JobStatus {
	st := JobStatus{Namespace: rj.GetNamespace(), Name: rj.GetName(), Kind: KindRayJob, Age: now.Sub(rj.GetCreationTimestamp().Time).Truncate(time.Second),
		Queue: gpudrav1.DefaultQueue}
	var spec RayJob
	total := int32(1)
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(rj.Object, &spec); err == nil {
		for _, g := range spec.Spec.RayClusterSpec.WorkerGroupSpecs {
			total += ptr.Deref(g.Replicas, 0)
		}
		st.Queue = queueOf(&spec.Spec.RayClusterSpec.HeadGroupSpec.Template)
	}
	deployment, _, _ := unstructured.NestedString(rj.Object, "status", "jobDeploymentStatus")
	job, _, _ := unstructured.NestedString(rj.Object, "status", "jobStatus")
	reason, _, _ := unstructured.NestedString(rj.Object, "status", "reason")
	message, _, _ := unstructured.NestedString(rj.Object, "status", "message")
	switch {
	case job == "SUCCEEDED":
		st.State = StateSucceeded
	case job == "FAILED" || job == "STOPPED" || deployment == "Failed" || deployment == "ValidationFailed":
		st.State, st.Reason, st.Message = StateFailed, cmp.Or(reason, "Job"+cmp.Or(job, deployment)), message
	case deployment == "Complete":
		// Complete without SUCCEEDED: KubeRay's own word.
		st.State = StateSucceeded
	}
	gangStatus(&st, total, pods, claims)
	if st.State == StateRunning || st.State == StateStarting {
		// Where the Ray job is: KubeRay's cluster and Ray's job state.
		st.Reason = "RayJob " + cmp.Or(deployment, "New")
		if job != "" {
			st.Reason += ", job " + job
		}
	}
	return st
}

// QueueKueue is how gpudra jobs names a Kueue LocalQueue in its QUEUE
// column: kueue/<LocalQueue>.
const QueueKueue = "kueue/"

// WithKueue adds to a job's status what Kueue says of it, for a job
// labelled for a Kueue LocalQueue (localQueue; "" leaves st as it is):
// while Kueue has not admitted it, it waits, with Kueue's reason (the
// Workload's QuotaReserved or Evicted condition), and it is in no
// GpuQueue (docs/queues.md). w is its Workload, nil when none was read.
// Pure.
func WithKueue(st JobStatus, localQueue string, w *unstructured.Unstructured) JobStatus {
	if localQueue == "" {
		return st
	}
	st.Queue, st.Position = QueueKueue+localQueue, 0
	if st.State == StateSucceeded || st.State == StateFailed {
		return st
	}
	if w == nil {
		if st.State == StateWaiting && st.Reason == "" {
			st.Reason, st.Message = "KueueNoWorkload", "Kueue has not made the job's Workload yet (is Kueue running?)"
		}
		return st
	}
	ks := kueue.StatusOf(w, nil)
	switch ks.State {
	case kueue.Admitted, kueue.Finished:
		return st
	}
	st.State = StateWaiting
	st.Reason, st.Message = "Kueue"+cmp.Or(ks.Reason, "Pending"), cmp.Or(ks.Message, "Kueue has not admitted it yet ("+ks.State+")")
	return st
}
