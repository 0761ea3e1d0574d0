package webhook

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	gpudraapi "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// member is an existing pod of a gang, created at minute, with priority
// from class (value).
func member(name string, labels map[string]string, class string, value int32, minute int) *corev1.Pod {
	p := gangPod(labels, nil)
	p.Name = name
	p.CreationTimestamp = metav1.NewTime(time.Date(2025, 1, 1, 0, minute, 0, 0, time.UTC))
	p.Spec.PriorityClassName, p.Spec.Priority = class, ptr.To(value)
	return p
}

// prioritized is a gang pod as the API server's Priority admission hands
// it to the webhook: class resolved into spec.priority.
func prioritized(p *corev1.Pod, class string, value int32) *corev1.Pod {
	p.Spec.PriorityClassName, p.Spec.Priority = class, ptr.To(value)
	return p
}

// membersOf answers GangMembers from pods, by namespace and gang.
func membersOf(pods ...*corev1.Pod) GangMembers {
	return func(namespace, gang string) []*corev1.Pod {
		var out []*corev1.Pod
		for _, p := range pods {
			if p.Namespace == namespace && PodGroupName(p) == gang {
				out = append(out, p)
			}
		}
		return out
	}
}

// TestMutateRefusesAGangPodOfAnotherPriority: on both gang paths a gang
// pod whose priority differs from its gang's existing pods is refused with
// a message naming the gang, both priorities and the other pod; pods that
// ended, are being deleted or belong to another gang or namespace do not
// count, and two PriorityClasses of one value are one priority (what
// kube-scheduler compares).
func TestMutateRefusesAGangPodOfAnotherPriority(t *testing.T) {
	train := map[string]string{gpudraapi.LabelGang: "train"}
	grove := map[string]string{LabelGrovePodGang: "pcs-0"}
	high := func(name string, minute int) *corev1.Pod { return member(name, train, "high", 1000, minute) }
	with := func(p *corev1.Pod, change func(*corev1.Pod)) *corev1.Pod { change(p); return p }
	for name, tc := range map[string]struct {
		pod     *corev1.Pod
		members []*corev1.Pod
		refused []string // substrings of the message; nil: allowed
	}{
		"first pod of its gang": {pod: prioritized(gangPod(nil, nil), "high", 1000)},
		"same class":            {pod: prioritized(gangPod(nil, nil), "high", 1000), members: []*corev1.Pod{high("train-0", 0), high("train-1", 1)}},
		"no class, like the others": {pod: gangPod(nil, nil), members: []*corev1.Pod{
			member("train-0", train, "", 0, 0)}},
		"another class of the same value": {pod: prioritized(gangPod(nil, nil), "high-too", 1000), members: []*corev1.Pod{high("train-0", 0)}},
		"lower than the gang": {pod: gangPod(nil, nil), members: []*corev1.Pod{high("train-1", 1), high("train-0", 0)},
			refused: []string{`gang "train": this pod's priority 0 (no PriorityClass) differs from 1000 (PriorityClass "high") of the gang's pod train-0`,
				"give every pod of the gang one PriorityClass", "spec.priority: Forbidden"}},
		"higher than the gang": {pod: prioritized(gangPod(nil, nil), "urgent", 5000), members: []*corev1.Pod{high("train-0", 0)},
			refused: []string{`gang "train": this pod's priority 5000 (PriorityClass "urgent") differs from 1000 (PriorityClass "high") of the gang's pod train-0`}},
		"a grove member": {pod: prioritized(gangPod(grove, map[string]string{}), "low", 10), members: []*corev1.Pod{member("pcs-0-a-0", grove, "high", 1000, 0)},
			refused: []string{`gang "pcs-0"`, `10 (PriorityClass "low")`, `pcs-0-a-0`}},
		"the others ended or are going": {pod: gangPod(nil, nil), members: []*corev1.Pod{
			with(high("train-0", 0), func(p *corev1.Pod) { p.Status.Phase = corev1.PodSucceeded }),
			with(high("train-1", 1), func(p *corev1.Pod) { p.Status.Phase = corev1.PodFailed }),
			with(high("train-2", 2), func(p *corev1.Pod) { p.DeletionTimestamp = ptr.To(metav1.Now()) }),
		}},
		"its own earlier self": {pod: gangPod(nil, nil), members: []*corev1.Pod{high("p", 0)}},
		"another gang":         {pod: gangPod(nil, nil), members: []*corev1.Pod{member("eval-0", map[string]string{gpudraapi.LabelGang: "eval"}, "high", 1000, 0)}},
		"another namespace": {pod: gangPod(nil, nil), members: []*corev1.Pod{
			with(high("train-0", 0), func(p *corev1.Pod) { p.Namespace = "other" })}},
		"not the default scheduler's": {pod: with(gangPod(nil, nil), func(p *corev1.Pod) { p.Spec.SchedulerName = "volcano" }),
			members: []*corev1.Pod{high("train-0", 0)}},
		"not a gang pod": {pod: gangPod(map[string]string{"app": "x"}, map[string]string{}), members: []*corev1.Pod{high("train-0", 0)}},
	} {
		for _, path := range []string{GangPathGates, GangPathWorkload} {
			t.Run(name+"/"+path, func(t *testing.T) {
				resp := MutateGang(podRequest(admissionv1.Create, tc.pod), path, membersOf(tc.members...))
				if tc.refused != nil {
					require.False(t, resp.Allowed, "refused")
					assert.Equal(t, int32(http.StatusUnprocessableEntity), resp.Result.Code)
					for _, want := range tc.refused {
						assert.Contains(t, resp.Result.Message, want)
					}
					assert.Empty(t, resp.Patch)
					return
				}
				require.True(t, resp.Allowed, "%v", resp.Result)
			})
		}
	}
	// Without a member list (Mutate) nothing is compared.
	resp := Mutate(podRequest(admissionv1.Create, gangPod(nil, nil)), GangPathWorkload)
	assert.True(t, resp.Allowed)
}

// TestHandlerChecksGangPriority: the handler asks its GangMembers.
func TestHandlerChecksGangPriority(t *testing.T) {
	h := NewHandler(nil)
	h.GangPath = func() string { return GangPathWorkload }
	h.GangMembers = membersOf(member("train-0", map[string]string{gpudraapi.LabelGang: "train"}, "high", 1000, 0))
	body, err := json.Marshal(admissionv1.AdmissionReview{TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"},
		Request: podRequest(admissionv1.Create, gangPod(nil, nil))})
	require.NoError(t, err)
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest(http.MethodPost, MutatePath, bytes.NewReader(body)))
	require.Equal(t, http.StatusOK, w.Code, w.Body.String())
	var out admissionv1.AdmissionReview
	require.NoError(t, json.Unmarshal(w.Body.Bytes(), &out))
	require.False(t, out.Response.Allowed)
	assert.Contains(t, out.Response.Result.Message, `gang "train"`)
}
