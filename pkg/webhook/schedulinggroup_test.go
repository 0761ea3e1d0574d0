package webhook

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	gpudraapi "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// podGroupsOf answers PodGroupGang from gpudra's PodGroups, as
// "<namespace>/<name>" to gang.
func podGroupsOf(gangs map[string]string) PodGroupGang {
	return func(_ context.Context, namespace, name string) (string, error) {
		return gangs[namespace+"/"+name], nil
	}
}

// naming is pod (nil labels: a pod of no gang) naming PodGroup group.
func naming(labels map[string]string, group string) *corev1.Pod {
	p := gangPod(labels, nil)
	if labels == nil {
		p.Labels, p.Annotations = nil, nil
	}
	p.Spec.SchedulingGroup = &corev1.PodSchedulingGroup{PodGroupName: ptr.To(group)}
	return p
}

// TestHandlerRefusesForeignSchedulingGroup: on the Workload API path a pod
// may name its own gang's PodGroup, or one that is no gang's, but not a
// gang's that it is not one of: one gpudra-controller made for that gang,
// or, before it is made, the one named after a gang whose pods exist. The
// message names the PodGroup and the gang. The gate path makes no
// PodGroups and checks nothing.
func TestHandlerRefusesForeignSchedulingGroup(t *testing.T) {
	train := map[string]string{gpudraapi.LabelGang: "train"}
	other := map[string]string{gpudraapi.LabelGang: "other"}
	podGroups := podGroupsOf(map[string]string{"ns/train": "train"})
	waiting := member("wait-0", map[string]string{gpudraapi.LabelGang: "wait"}, "", 0, 0)
	members := membersOf(waiting)
	for _, tc := range []struct {
		name string
		pod  *corev1.Pod
		path string
		want string // "": allowed
	}{
		{"a pod of no gang, in gang train's PodGroup", naming(nil, "train"), GangPathWorkload,
			`spec.schedulingGroup.podGroupName: Forbidden: PodGroup "train" is gang "train"'s (gpudra-controller made it for that gang): ` +
				`kube-scheduler places its pods together, and a pod of no gang may not join it; only the gang's pods (label gpudra.dev/gang=train) name it`},
		{"another gang's pod, in gang train's PodGroup", naming(other, "train"), GangPathWorkload,
			`PodGroup "train" is gang "train"'s (gpudra-controller made it for that gang): kube-scheduler places its pods together, and a pod of gang "other" may not join it`},
		{"a Grove gang's pod, in gang train's PodGroup", naming(map[string]string{LabelGrovePodGang: "pcs-0"}, "train"), GangPathWorkload,
			`a pod of gang "pcs-0" may not join it`},
		{"a pod of no gang, in the PodGroup of a gang not handed over yet", naming(nil, "wait"), GangPathWorkload,
			`PodGroup "wait" is gang "wait"'s (gpudra-controller makes it for that gang's pods, such as wait-0, once its queue lets the gang go)`},
		{"gang train's pod, in its own PodGroup", naming(train, "train"), GangPathWorkload, ""},
		{"a pod of no gang, in a PodGroup of its own", naming(nil, "mine"), GangPathWorkload, ""},
		{"a gang's pod, in a PodGroup of its user's own", naming(other, "mine"), GangPathWorkload, ""},
		{"a pod of no gang, without a scheduling group", gangPod(map[string]string{"app": "x"}, map[string]string{}), GangPathWorkload, ""},
		{"on the gate path", naming(nil, "train"), GangPathGates, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := NewHandler(nil)
			h.GangPath = func() string { return tc.path }
			h.GangMembers, h.PodGroupGang = members, podGroups
			resp := serve(t, h, podRequest(admissionv1.Create, tc.pod))
			if tc.want == "" {
				assert.True(t, resp.Allowed, "%+v", resp.Result)
				return
			}
			require.False(t, resp.Allowed)
			assert.Equal(t, int32(http.StatusForbidden), resp.Result.Code)
			assert.Contains(t, resp.Result.Message, tc.want)
		})
	}
}

// TestHandlerRefusesWhenPodGroupUnknown: a PodGroup that cannot be read is
// no PodGroup of nobody's: the pod is refused, saying why.
func TestHandlerRefusesWhenPodGroupUnknown(t *testing.T) {
	h := NewHandler(nil)
	h.GangPath = func() string { return GangPathWorkload }
	h.PodGroupGang = func(context.Context, string, string) (string, error) { return "", errors.New("connection refused") }
	resp := serve(t, h, podRequest(admissionv1.Create, naming(nil, "train")))
	require.False(t, resp.Allowed)
	assert.Equal(t, "PodGroup ns/train that the pod names in spec.schedulingGroup: connection refused", resp.Result.Message)
}

// serve is h's answer to req at MutatePath.
func serve(t *testing.T, h *Handler, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
	t.Helper()
	body, err := json.Marshal(admissionv1.AdmissionReview{TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"}, Request: req})
	require.NoError(t, err)
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest(http.MethodPost, MutatePath, bytes.NewReader(body)))
	require.Equal(t, http.StatusOK, w.Code, w.Body.String())
	var out admissionv1.AdmissionReview
	require.NoError(t, json.Unmarshal(w.Body.Bytes(), &out))
	require.NotNil(t, out.Response)
	return out.Response
}
