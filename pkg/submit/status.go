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

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
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
	State           string
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
	st := JobStatus{Namespace: job.Namespace, Name: job.Name, Age: now.Sub(job.CreationTimestamp.Time).Truncate(time.Second),
		Queue: gpudrav1.DefaultQueue}
	if q := job.Spec.Template.Annotations[gpudrav1.AnnotationQueue]; q != "" {
		st.Queue = q
	}
	total := int32(1)
	if job.Spec.Completions != nil {
		total = *job.Spec.Completions
	}
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
	return st
}
