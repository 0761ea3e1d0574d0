package e2e

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpudra/gpudra/pkg/controller"
	"github.com/gpudra/gpudra/pkg/controller/gang"
)

// TestGangsOff: where gangs are off (gangs.mode off here; auto on a
// cluster without DeviceTaintRules, as on Kubernetes 1.34-1.36, comes to
// the same), a pod gated before is released with the reason on its
// condition and an Event, and new gang pods are not gated: they schedule
// as plain pods instead of waiting for ever. Back on the gate path, gang
// pods are gated again.
func TestGangsOff(t *testing.T) {
	ctx := context.Background()
	onGangPath(t, controller.GangModeGates)
	ns := namespace(t)

	// A gang of two with one pod: gated, waiting for the other.
	create(t, ns, gpus("one-gpu", 1), gangPod("early-0", "early", 2, "one-gpu", nil))
	gangCondition(t, ns, "early-0", v1.ConditionFalse, gang.ReasonWaitingForPods)

	onGangPath(t, controller.GangModeOff)
	waitRunning(t, ns, "early-0")
	cond := gangCondition(t, ns, "early-0", v1.ConditionFalse, gang.ReasonGangsOff)
	assert.Contains(t, cond.Message, "gangs.mode is off")

	create(t, ns, nil, gangPod("late-0", "late", 2, "one-gpu", nil))
	p, err := cluster.Client.CoreV1().Pods(ns).Get(ctx, "late-0", metav1.GetOptions{})
	require.NoError(t, err)
	assert.False(t, gatedByGpudra(p), "no gate with gangs off")
	waitRunning(t, ns, "late-0")

	onGangPath(t, controller.GangModeGates)
	create(t, ns, nil, gangPod("again-0", "again", 2, "one-gpu", nil))
	p, err = cluster.Client.CoreV1().Pods(ns).Get(ctx, "again-0", metav1.GetOptions{})
	require.NoError(t, err)
	assert.True(t, gatedByGpudra(p), "gated again on the gate path")
	gangCondition(t, ns, "again-0", v1.ConditionFalse, gang.ReasonWaitingForPods)
}
