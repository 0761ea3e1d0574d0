package controller

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/utils/ptr"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/webhook"
)

// TestWatchGangMembers: the webhook's view of gangs lists a gang's pods,
// plain or Grove, once each (a pod with both labels is its
// gpudra.dev/gang's), per namespace, with the fields the priority check
// reads and nothing else kept.
func TestWatchGangMembers(t *testing.T) {
	pod := func(ns, name string, labels map[string]string) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: labels,
			Annotations: map[string]string{"big": "kept out"}},
			Spec: corev1.PodSpec{PriorityClassName: "high", Priority: ptr.To[int32](1000),
				Containers: []corev1.Container{{Name: "c", Image: "i"}}},
			Status: corev1.PodStatus{Phase: corev1.PodPending}}
	}
	client := fake.NewClientset(
		pod("a", "train-0", map[string]string{gpudrav1.LabelGang: "train"}),
		pod("a", "train-1", map[string]string{gpudrav1.LabelGang: "train", webhook.LabelGrovePodGang: "train"}),
		pod("a", "both", map[string]string{gpudrav1.LabelGang: "train", webhook.LabelGrovePodGang: "pcs-0"}),
		pod("a", "pcs-0-x", map[string]string{webhook.LabelGrovePodGang: "pcs-0"}),
		pod("b", "train-0", map[string]string{gpudrav1.LabelGang: "train"}),
		pod("a", "plain", map[string]string{"app": "x"}),
	)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	members := watchGangMembers(ctx, client)
	names := func(ns, gang string) []string {
		var out []string
		for _, p := range members(ns, gang) {
			out = append(out, p.Name)
		}
		slices.Sort(out)
		return out
	}
	// Two informers, one per label: wait for both.
	require.Eventually(t, func() bool { return len(names("a", "train")) == 3 && len(names("a", "pcs-0")) == 1 }, 10*time.Second, 10*time.Millisecond)
	assert.Equal(t, []string{"both", "train-0", "train-1"}, names("a", "train"))
	assert.Equal(t, []string{"pcs-0-x"}, names("a", "pcs-0"))
	assert.Equal(t, []string{"train-0"}, names("b", "train"))
	assert.Empty(t, names("a", "x"))

	p := members("b", "train")[0]
	assert.Equal(t, "high", p.Spec.PriorityClassName)
	assert.Equal(t, int32(1000), *p.Spec.Priority)
	assert.Equal(t, corev1.PodPending, p.Status.Phase)
	assert.Empty(t, p.Annotations, "only what the check reads is kept")
	assert.Empty(t, p.Spec.Containers)

	// A pod made later is seen.
	_, err := client.CoreV1().Pods("b").Create(ctx, pod("b", "train-1", map[string]string{gpudrav1.LabelGang: "train"}), metav1.CreateOptions{})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return len(names("b", "train")) == 2 }, 10*time.Second, 10*time.Millisecond)
}
