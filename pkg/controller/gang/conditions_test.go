package gang

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// TestConditionWriterKeepsTheLatest: conditions queued for a pod before a
// worker gets to it are written once, the latest; set never waits for the
// API server once the writer runs.
func TestConditionWriterKeepsTheLatest(t *testing.T) {
	a, b := plain("a", "g", "2"), plain("b", "g", "2")
	client := fake.NewClientset(a, b)
	var patches atomic.Int32 // the writers' goroutines count, the test reads
	client.PrependReactor("patch", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
		patches.Add(1)
		return false, nil, nil
	})
	w := newConditionWriter(client)
	w.async = true // queued, as after run started
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for _, reason := range []string{"WaitingForPods", "BehindInQueue", "WaitingForDevices"} {
		require.NoError(t, w.set(ctx, a, gangConditionPatch(corev1.ConditionFalse, reason, "m")))
	}
	require.NoError(t, w.set(ctx, b, gangConditionPatch(corev1.ConditionFalse, "WaitingForPods", "m")))
	assert.Zero(t, patches.Load(), "nothing written in the caller's goroutine")
	go w.run(ctx, 2)
	require.Eventually(t, func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		return len(w.order) == 0
	}, 10*time.Second, 10*time.Millisecond)
	require.Eventually(t, func() bool {
		p, err := client.CoreV1().Pods("ns").Get(ctx, "a", metav1.GetOptions{})
		return err == nil && len(p.Status.Conditions) == 1 && p.Status.Conditions[0].Reason == "WaitingForDevices"
	}, 10*time.Second, 10*time.Millisecond, "the latest condition")
	// The queue is empty once the workers took both pods, which may be
	// before the second write is made: wait for it, then make sure no
	// third one follows.
	require.Eventually(t, func() bool { return patches.Load() >= 2 }, 10*time.Second, 10*time.Millisecond, "both pods written")
	time.Sleep(100 * time.Millisecond)
	cancel()
	assert.Equal(t, int32(2), patches.Load(), "one write per pod")
}

// TestConditionWriterNeverLandsAnOlderCondition: a pod's condition changes
// while a worker is still writing the older one (the API server is slow
// for it). Another worker must not write the newer one beside it: the two
// patches race, and the older could land last, for good (the round reports
// a change once). Seen in the e2e suite: a gang stayed WaitingForPods on its
// pods while its Events said WaitingForDevices.
func TestConditionWriterNeverLandsAnOlderCondition(t *testing.T) {
	a := plain("a", "g", "2")
	w := newConditionWriter(fake.NewClientset(a))
	// The API server, as two workers' patches of one pod reach it: without
	// a lock between them. The older write is slow.
	var mu sync.Mutex
	var landed []string
	entered, release := make(chan struct{}), make(chan struct{})
	var first atomic.Bool
	w.write = func(_ context.Context, _ *corev1.Pod, patch []byte) error {
		if first.CompareAndSwap(false, true) {
			close(entered)
			<-release
		}
		mu.Lock()
		defer mu.Unlock()
		landed = append(landed, string(patch))
		return nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.run(ctx, 2)
	require.Eventually(t, func() bool { w.mu.Lock(); defer w.mu.Unlock(); return w.async }, 5*time.Second, 5*time.Millisecond)
	older, newer := gangConditionPatch(corev1.ConditionFalse, "WaitingForPods", "m"), gangConditionPatch(corev1.ConditionFalse, "WaitingForDevices", "m")
	require.NoError(t, w.set(ctx, a, older))
	<-entered
	require.NoError(t, w.set(ctx, a, newer))
	time.Sleep(200 * time.Millisecond) // another worker is free meanwhile
	close(release)
	require.Eventually(t, func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		return len(w.order) == 0 && len(w.writing) == 0
	}, 5*time.Second, 5*time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, landed, 2)
	assert.Equal(t, string(newer), landed[1], "the newer condition lands last")
}
