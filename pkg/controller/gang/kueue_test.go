package gang

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// kueued is a gang pod of a job Kueue admitted: Kueue's queue-name label.
func kueued(p *corev1.Pod) *corev1.Pod {
	p.Labels[gpudrav1.LabelKueueQueue] = "gpus"
	return p
}

func createdAfter(t *testing.T, d time.Duration) func(*corev1.Pod) *corev1.Pod {
	return func(p *corev1.Pod) *corev1.Pod { p.CreationTimestamp = metav1.NewTime(t0.Add(d)); return p }
}

// TestKueueGangsWaitInNoGpuQueue is docs/queues.md's first rule: a gang
// Kueue admitted waits in no GpuQueue. Kueue decided when it starts, so
// it is placed as soon as its devices are free, even behind a GpuQueue's
// head that waits for devices (there it would wait twice, once in each
// queue); and one that does not fit now holds back no item of a GpuQueue.
// One of the node's two GPUs is taken in both cases.
func TestKueueGangsWaitInNoGpuQueue(t *testing.T) {
	t.Run("placed past a GpuQueue's waiting head", func(t *testing.T) {
		h := newRoundHarness(t,
			withUID(plain("a0", "head", "2", "ca0")), withUID(plain("a1", "head", "2", "ca1")),
			createdAfter(t, time.Second)(withUID(kueued(plain("k0", "kueue-job", "1", "ck0")))),
			createdAfter(t, 2*time.Second)(withUID(plain("b0", "gpudra-job", "1", "cb0"))),
			oneGPUClaim("ca0"), oneGPUClaim("ca1"), oneGPUClaim("ck0"), oneGPUClaim("cb0"), busyGPU())
		h.addTwoGPUNode(t)

		require.NoError(t, h.round(t))
		assert.Equal(t, gpudrav1.ReasonWaitingForDevices, gangConditionOf(h.pod(t, "a0")).Reason, "the GpuQueue's head waits for 2 GPUs")
		assert.NotNil(t, h.getClaim(t, "ck0").Status.Allocation, "Kueue's gang is placed on the free GPU: %+v", gangConditionOf(h.pod(t, "k0")))
		assert.Equal(t, gpudrav1.ReasonBehindInQueue, gangConditionOf(h.pod(t, "b0")).Reason, "a GpuQueue stays strictly ordered")
	})
	t.Run("waiting, holds back no GpuQueue item", func(t *testing.T) {
		h := newRoundHarness(t,
			withUID(kueued(plain("k0", "kueue-job", "2", "ck0"))), withUID(kueued(plain("k1", "kueue-job", "2", "ck1"))),
			createdAfter(t, time.Second)(withUID(plain("b0", "gpudra-job", "1", "cb0"))),
			oneGPUClaim("ck0"), oneGPUClaim("ck1"), oneGPUClaim("cb0"), busyGPU())
		h.addTwoGPUNode(t)

		require.NoError(t, h.round(t))
		cond := gangConditionOf(h.pod(t, "k0"))
		assert.Equal(t, gpudrav1.ReasonWaitingForDevices, cond.Reason)
		assert.Contains(t, cond.Message, "admitted by Kueue (LocalQueue gpus), in no GpuQueue")
		assert.NotNil(t, h.getClaim(t, "cb0").Status.Allocation, "the GpuQueue's gang is placed: %+v", gangConditionOf(h.pod(t, "b0")))
	})
}

// busyGPU is a claim of a running pod that holds gpu-0 of n0.
func busyGPU() *resourceapi.ResourceClaim {
	c := allocatedClaim("busy", "gpu-0")
	c.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: "running", UID: "uid-running"}}
	return c
}
