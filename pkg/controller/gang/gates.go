package gang

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// The gate path's last step (PathGates): the admission webhook holds each
// gang pod with gpudra's scheduling gate; once the gang's claims are
// written (commit.go), its pods are released by lifting the gate, and the
// scheduler binds each pod where its devices are.

// gated says whether the pod carries gpudra's gate.
func gated(p *corev1.Pod) bool {
	return slices.ContainsFunc(p.Spec.SchedulingGates, func(g corev1.PodSchedulingGate) bool { return g.Name == gpudrav1.SchedulingGate })
}

// stillGated is waitsOnGpudra on the gate path: the pod carries gpudra's
// gate, and this controller did not just lift it (the informer may not
// show the lift yet).
func (c *Controller) stillGated(p *corev1.Pod) bool {
	return gated(p) && !c.justReleased(p)
}

// release marks the gang allocated on its gated members and lifts their
// gates.
func (c *Controller) release(ctx context.Context, g *Gang) error {
	c.mu.Lock()
	delete(c.reported, g.Key)
	c.mu.Unlock()
	patch := gangConditionPatch(corev1.ConditionTrue, ReasonGangAllocated, "the gang's devices are allocated")
	var errs []error
	for _, p := range g.Waiting {
		if err := c.conditions.set(ctx, p, patch); err != nil {
			errs = append(errs, err)
		}
		if err := ungate(ctx, c.opts.Client, p); err != nil {
			errs = append(errs, err)
			continue
		}
		c.rememberReleased(p)
	}
	return errors.Join(errs...)
}

// ungate removes gpudra's scheduling gate from a pod with a JSON patch
// that tests the gates first, so that a concurrent change (Grove lifting
// its own gate) is not lost; on such a change it reads the pod again.
func ungate(ctx context.Context, client kubernetes.Interface, p *corev1.Pod) error {
	for attempt := 0; ; attempt++ {
		if !gated(p) {
			return nil
		}
		var gates []corev1.PodSchedulingGate
		for _, g := range p.Spec.SchedulingGates {
			if g.Name != gpudrav1.SchedulingGate {
				gates = append(gates, g)
			}
		}
		if gates == nil {
			gates = []corev1.PodSchedulingGate{}
		}
		patch, err := json.Marshal([]map[string]any{
			{"op": "test", "path": "/spec/schedulingGates", "value": p.Spec.SchedulingGates},
			{"op": "replace", "path": "/spec/schedulingGates", "value": gates},
		})
		if err != nil {
			return err
		}
		_, err = client.CoreV1().Pods(p.Namespace).Patch(ctx, p.Name, types.JSONPatchType, patch, metav1.PatchOptions{})
		switch {
		case err == nil || apierrors.IsNotFound(err):
			return nil
		case (apierrors.IsInvalid(err) || apierrors.IsBadRequest(err)) && attempt < 3:
			// The test failed: the gates changed meanwhile.
			fresh, gerr := client.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
			if apierrors.IsNotFound(gerr) {
				return nil
			}
			if gerr != nil {
				return fmt.Errorf("lift the gang gate of pod %s/%s: %w", p.Namespace, p.Name, gerr)
			}
			p = fresh
		default:
			return fmt.Errorf("lift the gang gate of pod %s/%s: %w", p.Namespace, p.Name, err)
		}
	}
}
