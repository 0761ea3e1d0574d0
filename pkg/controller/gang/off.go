package gang

import (
	"context"
	"errors"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2"
)

// ReasonGangsOff is the pod condition's reason, and the Event's, on a gang
// pod released because gangs are off on this cluster.
const ReasonGangsOff = "GangsOff"

// ReleaseGated lifts gpudra's gate from every live pod that carries it,
// where gangs are off (why says why): gated by a webhook that still had
// gangs on, nothing would ever lift it. Each pod gets the condition
// gpudra.dev/GangAllocated=False with reason GangsOff and an Event saying
// why; it then schedules as a plain pod. It returns how many it released.
func ReleaseGated(ctx context.Context, client kubernetes.Interface, recorder events.EventRecorder, why string) (int, error) {
	list, err := client.CoreV1().Pods(metav1.NamespaceAll).List(ctx, metav1.ListOptions{})
	if err != nil {
		return 0, fmt.Errorf("list pods to release from the gang gate: %w", err)
	}
	patch := gangConditionPatch(corev1.ConditionFalse, ReasonGangsOff, why)
	var errs []error
	n := 0
	for i := range list.Items {
		p := &list.Items[i]
		if !gated(p) || !member(p) {
			continue
		}
		// Announced first: the Event says why before the gate goes.
		if recorder != nil {
			recorder.Eventf(p, nil, corev1.EventTypeNormal, ReasonGangsOff, ActionPlan, "gangs are off: %s; released to schedule as a plain pod", truncate(why))
		}
		if err := setGangCondition(ctx, client, p, patch); err != nil {
			errs = append(errs, err)
		}
		if err := ungate(ctx, client, p); err != nil {
			errs = append(errs, err)
			continue
		}
		klog.FromContext(ctx).Info("Released a gang pod: gangs are off", "pod", klog.KObj(p))
		n++
	}
	return n, errors.Join(errs...)
}
