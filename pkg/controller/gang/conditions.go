package gang

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// gpudra's gang condition on pods: what it says (gangConditionPatch), and
// the writer that sets it off the round goroutine.

// PodConditionGang is the condition gpudra sets on a gang pod: False with
// the reason it waits, while it waits; True with the reason it was handed
// over (ReasonGangAllocated on the gate path, ReasonPodGroupCreated on the
// Workload API path).
const PodConditionGang corev1.PodConditionType = gpudrav1.GroupName + "/GangAllocated"

// gangConditionPatch is the status patch that sets gpudra's pod condition:
// a strategic merge of one condition, by type, that leaves the others.
func gangConditionPatch(status corev1.ConditionStatus, reason, message string) []byte {
	cond := map[string]any{"type": PodConditionGang, "status": status, "reason": reason, "message": truncate(message),
		"lastTransitionTime": metav1.Now().UTC().Format(time.RFC3339)}
	patch, _ := json.Marshal(map[string]any{"status": map[string]any{"conditions": []any{cond}}})
	return patch
}

// setGangCondition applies a gangConditionPatch to a pod; a pod gone is no
// error.
func setGangCondition(ctx context.Context, client kubernetes.Interface, p *corev1.Pod, patch []byte) error {
	_, err := client.CoreV1().Pods(p.Namespace).Patch(ctx, p.Name, types.StrategicMergePatchType, patch, metav1.PatchOptions{}, "status")
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("set gang condition of pod %s/%s: %w", p.Namespace, p.Name, err)
	}
	return nil
}

// conditionWorkers write pod conditions in parallel, at the client's rate.
const conditionWorkers = 4

// conditionWriter writes gpudra's gang condition to pods off the round
// goroutine. The round says what each pod's condition should be; workers
// write the latest one per pod at the client's rate, so a queue change
// that touches every pod of 100 waiting gangs of 64 (6,400 patches) no
// longer holds up the next admission. Pending writes are bounded by the
// number of pods: a newer condition replaces an unwritten older one.
type conditionWriter struct {
	client kubernetes.Interface
	// write applies a patch to a pod (setGangCondition; tests slow it).
	write func(ctx context.Context, p *corev1.Pod, patch []byte) error

	mu      sync.Mutex
	async   bool
	pending map[types.NamespacedName][]byte
	order   []types.NamespacedName
	// writing are the pods a worker is writing now: a newer condition of
	// such a pod waits until that write returns, so that the older one can
	// never land last (two workers' patches of one pod race in the API
	// server; the pod kept the older, and the round, which reports a
	// change only once, never wrote it again).
	writing map[types.NamespacedName]bool
	wake    chan struct{}
}

func newConditionWriter(client kubernetes.Interface) *conditionWriter {
	w := &conditionWriter{client: client, pending: map[types.NamespacedName][]byte{}, writing: map[types.NamespacedName]bool{},
		wake: make(chan struct{}, 1)}
	w.write = func(ctx context.Context, p *corev1.Pod, patch []byte) error {
		return setGangCondition(ctx, w.client, p, patch)
	}
	return w
}

// set writes patch (a gangConditionPatch) to the pod: queued once run has
// started, at once before (as in unit tests that drive rounds by hand).
func (w *conditionWriter) set(ctx context.Context, p *corev1.Pod, patch []byte) error {
	w.mu.Lock()
	if !w.async {
		w.mu.Unlock()
		return w.write(ctx, p, patch)
	}
	key := types.NamespacedName{Namespace: p.Namespace, Name: p.Name}
	if _, queued := w.pending[key]; !queued {
		w.order = append(w.order, key)
	}
	w.pending[key] = patch
	w.mu.Unlock()
	select {
	case w.wake <- struct{}{}:
	default:
	}
	return nil
}

// run writes queued conditions with workers until ctx ends.
func (w *conditionWriter) run(ctx context.Context, workers int) {
	w.mu.Lock()
	w.async = true
	w.mu.Unlock()
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for {
				key, patch, ok := w.next()
				if !ok {
					select {
					case <-ctx.Done():
						return
					case <-w.wake:
						continue
					}
				}
				pod := &corev1.Pod{}
				pod.Namespace, pod.Name = key.Namespace, key.Name
				if err := w.write(ctx, pod, patch); err != nil && ctx.Err() == nil {
					// The next round sets it again if it still matters.
					klog.FromContext(ctx).V(2).Info("Set gang condition", "pod", key, "err", err)
				}
				w.done(key)
				// Others may be queued: let the next worker look too.
				select {
				case w.wake <- struct{}{}:
				default:
				}
			}
		})
	}
	<-ctx.Done()
	wg.Wait()
}

// next takes the oldest queued write of a pod no worker is writing, and
// marks the pod as being written (done ends it).
func (w *conditionWriter) next() (types.NamespacedName, []byte, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for i, key := range w.order {
		if w.writing[key] {
			continue
		}
		w.order = append(w.order[:i:i], w.order[i+1:]...)
		patch := w.pending[key]
		delete(w.pending, key)
		w.writing[key] = true
		return key, patch, true
	}
	return types.NamespacedName{}, nil, false
}

// done ends a pod's write; a newer condition queued meanwhile is next.
func (w *conditionWriter) done(key types.NamespacedName) {
	w.mu.Lock()
	delete(w.writing, key)
	w.mu.Unlock()
}
