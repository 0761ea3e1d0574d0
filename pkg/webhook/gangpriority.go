package webhook

import (
	"cmp"
	"fmt"
	"slices"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/validation/field"
)

// GangMembers returns the pods of a gang that exist now: the pods of the
// namespace whose gang (PodGroupName) is gang, in any order. The
// controller answers from an informer, so a pod created a moment ago may
// be missing.
type GangMembers func(namespace, gang string) []*corev1.Pod

// PodPriority is the priority kube-scheduler gives a pod: spec.priority,
// which the API server's Priority admission sets from the pod's
// PriorityClass before any webhook sees it; 0 without one.
func PodPriority(p *corev1.Pod) int32 {
	if p.Spec.Priority != nil {
		return *p.Spec.Priority
	}
	return 0
}

// DescribePriority says a pod's priority and where it came from, as in
// `1000 (PriorityClass "high")` or `0 (no PriorityClass)`.
func DescribePriority(p *corev1.Pod) string {
	if p.Spec.PriorityClassName == "" {
		return fmt.Sprintf("%d (no PriorityClass)", PodPriority(p))
	}
	return fmt.Sprintf("%d (PriorityClass %q)", PodPriority(p), p.Spec.PriorityClassName)
}

// checkGangPriority refuses a gang pod whose priority is not that of its
// gang's other pods. kube-scheduler places no pod of a PodGroup whose pods'
// priorities differ ("all pods in a single pod group should have the same
// priority"), so on the Workload API path such a gang would wait for ever;
// on the gate path the scheduler could preempt its low-priority members
// alone, breaking it. Pods that ended or are being deleted are no longer
// members (a Job or Grove may make them again with another class).
func checkGangPriority(pod *corev1.Pod, namespace string, members GangMembers) *field.Error {
	gang := PodGroupName(pod)
	others := slices.DeleteFunc(slices.Clone(members(namespace, gang)), func(o *corev1.Pod) bool {
		return o.Name == pod.Name || o.DeletionTimestamp != nil || o.Status.Phase == corev1.PodSucceeded || o.Status.Phase == corev1.PodFailed
	})
	// The oldest first: the message names the same pod every time.
	slices.SortFunc(others, func(a, b *corev1.Pod) int {
		return cmp.Or(a.CreationTimestamp.Compare(b.CreationTimestamp.Time), cmp.Compare(a.Name, b.Name))
	})
	for _, o := range others {
		if PodPriority(o) != PodPriority(pod) {
			return field.Forbidden(field.NewPath("spec", "priority"), fmt.Sprintf(
				"gang %q: this pod's priority %s differs from %s of the gang's pod %s; kube-scheduler places no pod of a gang "+
					"whose pods' priorities differ: give every pod of the gang one PriorityClass (docs/gangs.md)",
				gang, DescribePriority(pod), DescribePriority(o), o.Name))
		}
	}
	return nil
}
