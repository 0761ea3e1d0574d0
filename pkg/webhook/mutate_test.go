package webhook

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionv1 "k8s.io/api/admission/v1"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	gpudraapi "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// gangPod is a plain gang pod of 4 (labels and annotations, when given,
// replace the gang's).
func gangPod(labels, annotations map[string]string) *corev1.Pod {
	if labels == nil {
		labels = map[string]string{gpudraapi.LabelGang: "train"}
	}
	if annotations == nil {
		annotations = map[string]string{gpudraapi.AnnotationGangSize: "4"}
	}
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns", Labels: labels, Annotations: annotations},
		Spec: corev1.PodSpec{SchedulerName: corev1.DefaultSchedulerName, Containers: []corev1.Container{{Name: "c", Image: "i"}}}}
}

func podRequest(op admissionv1.Operation, pod *corev1.Pod) *admissionv1.AdmissionRequest {
	raw, _ := json.Marshal(pod)
	req := &admissionv1.AdmissionRequest{UID: types.UID("u"), Operation: op, Resource: metav1.GroupVersionResource(Pods), Namespace: "ns", Name: "p"}
	req.Object.Raw = raw
	return req
}

const (
	addGates   = `[{"op":"add","path":"/spec/schedulingGates","value":[{"name":"gpudra.dev/gang"}]}]`
	appendGate = `[{"op":"add","path":"/spec/schedulingGates/-","value":{"name":"gpudra.dev/gang"}}]`
)

func TestMutate(t *testing.T) {
	with := func(pod *corev1.Pod, change func(*corev1.Pod)) *corev1.Pod {
		change(pod)
		return pod
	}
	grove := map[string]string{LabelGrovePodGang: "pcs-0"}
	for name, tc := range map[string]struct {
		req       *admissionv1.AdmissionRequest
		wantPatch string   // "" for none
		refused   []string // substrings of the message; nil: allowed
	}{
		"plain gang":            {req: podRequest(admissionv1.Create, gangPod(nil, nil)), wantPatch: addGates},
		"no scheduler name yet": {req: podRequest(admissionv1.Create, with(gangPod(nil, nil), func(p *corev1.Pod) { p.Spec.SchedulerName = "" })), wantPatch: addGates},
		"other gates kept": {req: podRequest(admissionv1.Create, with(gangPod(nil, nil), func(p *corev1.Pod) {
			p.Spec.SchedulingGates = []corev1.PodSchedulingGate{{Name: "example.com/other"}}
		})), wantPatch: appendGate},
		"gate there already (reinvocation)": {req: podRequest(admissionv1.Create, with(gangPod(nil, nil), func(p *corev1.Pod) {
			p.Spec.SchedulingGates = []corev1.PodSchedulingGate{{Name: "example.com/other"}, {Name: gpudraapi.SchedulingGate}}
		}))},
		"grove podgang member, no size needed": {req: podRequest(admissionv1.Create, gangPod(grove, map[string]string{})), wantPatch: addGates},
		"grove member with a duration": {req: podRequest(admissionv1.Create, gangPod(grove, map[string]string{gpudraapi.AnnotationDuration: "1h30m"})),
			wantPatch: addGates},
		"largest gang": {req: podRequest(admissionv1.Create, gangPod(nil, map[string]string{gpudraapi.AnnotationGangSize: "10000"})), wantPatch: addGates},
		"with queue and duration": {req: podRequest(admissionv1.Create, gangPod(nil, map[string]string{gpudraapi.AnnotationGangSize: "2",
			gpudraapi.AnnotationQueue: "research", gpudraapi.AnnotationDuration: "30m"})), wantPatch: addGates},

		// Left alone.
		"not a gang": {req: podRequest(admissionv1.Create, gangPod(map[string]string{"app": "x"}, map[string]string{}))},
		"no labels":  {req: podRequest(admissionv1.Create, gangPod(map[string]string{}, map[string]string{}))},
		"kai-scheduler, even with a wrong size": {req: podRequest(admissionv1.Create, with(gangPod(nil, map[string]string{gpudraapi.AnnotationGangSize: "many"}),
			func(p *corev1.Pod) { p.Spec.SchedulerName = "kai-scheduler" }))},
		"volcano grove member": {req: podRequest(admissionv1.Create, with(gangPod(grove, nil), func(p *corev1.Pod) { p.Spec.SchedulerName = "volcano" }))},
		"bound to a node":      {req: podRequest(admissionv1.Create, with(gangPod(nil, nil), func(p *corev1.Pod) { p.Spec.NodeName = "n" }))},
		"update":               {req: podRequest(admissionv1.Update, gangPod(nil, nil))},
		"delete":               {req: podRequest(admissionv1.Delete, gangPod(nil, nil))},
		"another resource": {req: func() *admissionv1.AdmissionRequest {
			r := podRequest(admissionv1.Create, gangPod(nil, nil))
			r.Resource = metav1.GroupVersionResource(ResourceClaims)
			return r
		}()},

		// Refused, naming what is wrong.
		"size missing": {req: podRequest(admissionv1.Create, gangPod(nil, map[string]string{})),
			refused: []string{"metadata.annotations[gpudra.dev/gang-size]: Required value"}},
		"size zero": {req: podRequest(admissionv1.Create, gangPod(nil, map[string]string{gpudraapi.AnnotationGangSize: "0"})),
			refused: []string{`metadata.annotations[gpudra.dev/gang-size]: Invalid value: "0": must be a whole number from 1 to 10000`}},
		"size negative": {req: podRequest(admissionv1.Create, gangPod(nil, map[string]string{gpudraapi.AnnotationGangSize: "-3"})),
			refused: []string{`gpudra.dev/gang-size`}},
		"size too large": {req: podRequest(admissionv1.Create, gangPod(nil, map[string]string{gpudraapi.AnnotationGangSize: "10001"})),
			refused: []string{`gpudra.dev/gang-size`}},
		"size not a number": {req: podRequest(admissionv1.Create, gangPod(nil, map[string]string{gpudraapi.AnnotationGangSize: "4 pods"})),
			refused: []string{`Invalid value: "4 pods"`}},
		"empty gang name": {req: podRequest(admissionv1.Create, gangPod(map[string]string{gpudraapi.LabelGang: ""}, nil)),
			refused: []string{`metadata.labels[gpudra.dev/gang]: Invalid value: "": must name the gang`}},
		"duration not a duration": {req: podRequest(admissionv1.Create, gangPod(nil, map[string]string{gpudraapi.AnnotationGangSize: "2", gpudraapi.AnnotationDuration: "soon"})),
			refused: []string{`metadata.annotations[gpudra.dev/duration]: Invalid value: "soon"`}},
		"duration zero on a grove member": {req: podRequest(admissionv1.Create, gangPod(grove, map[string]string{gpudraapi.AnnotationDuration: "0s"})),
			refused: []string{`gpudra.dev/duration`}},
		"size and duration both wrong": {req: podRequest(admissionv1.Create, gangPod(nil, map[string]string{gpudraapi.AnnotationGangSize: "x", gpudraapi.AnnotationDuration: "-1m"})),
			refused: []string{`gpudra.dev/gang-size`, `gpudra.dev/duration`}},
		// docs/queues.md: one job, one queue.
		"queued by Kueue and a GpuQueue": {req: podRequest(admissionv1.Create, gangPod(map[string]string{gpudraapi.LabelGang: "train", gpudraapi.LabelKueueQueue: "gpus"},
			map[string]string{gpudraapi.AnnotationGangSize: "4", gpudraapi.AnnotationQueue: "research"})),
			refused: []string{`metadata.annotations[gpudra.dev/queue]: Forbidden: the pod is queued by Kueue (label kueue.x-k8s.io/queue-name=gpus)`}},
		"queued by Kueue alone": {req: podRequest(admissionv1.Create, gangPod(map[string]string{gpudraapi.LabelGang: "train", gpudraapi.LabelKueueQueue: "gpus"}, nil)),
			wantPatch: addGates},
		"not a pod": {req: func() *admissionv1.AdmissionRequest {
			r := podRequest(admissionv1.Create, gangPod(nil, nil))
			r.Object.Raw = []byte(`{"spec":"no"}`)
			return r
		}(), refused: []string{"decode Pod"}},
	} {
		t.Run(name, func(t *testing.T) {
			resp := Mutate(tc.req, GangPathGates)
			assert.Equal(t, tc.req.UID, resp.UID)
			if tc.refused != nil {
				require.False(t, resp.Allowed)
				for _, want := range tc.refused {
					assert.Contains(t, resp.Result.Message, want)
				}
				assert.Empty(t, resp.Patch)
				return
			}
			require.True(t, resp.Allowed, "%v", resp.Result)
			if tc.wantPatch == "" {
				assert.Empty(t, resp.Patch)
				assert.Nil(t, resp.PatchType)
				return
			}
			require.NotNil(t, resp.PatchType)
			assert.Equal(t, admissionv1.PatchTypeJSONPatch, *resp.PatchType)
			assert.JSONEq(t, tc.wantPatch, string(resp.Patch))
		})
	}
}

// TestMutateWorkloadPath: on the Workload API path a gang pod is not gated
// but names its gang's PodGroup; the same annotations are checked.
func TestMutateWorkloadPath(t *testing.T) {
	group := func(name string) string {
		return `[{"op":"add","path":"/spec/schedulingGroup","value":{"podGroupName":"` + name + `"}}]`
	}
	for name, tc := range map[string]struct {
		pod       *corev1.Pod
		wantPatch string
		refused   string
	}{
		"plain gang":   {pod: gangPod(nil, nil), wantPatch: group("train")},
		"grove member": {pod: gangPod(map[string]string{LabelGrovePodGang: "pcs-0"}, map[string]string{}), wantPatch: group("pcs-0")},
		"own group kept": {pod: func() *corev1.Pod {
			p := gangPod(nil, nil)
			p.Spec.SchedulingGroup = &corev1.PodSchedulingGroup{PodGroupName: ptr.To("mine")}
			return p
		}()},
		"not a gang":       {pod: gangPod(map[string]string{"app": "x"}, map[string]string{})},
		"other scheduler":  {pod: func() *corev1.Pod { p := gangPod(nil, nil); p.Spec.SchedulerName = "volcano"; return p }()},
		"size still check": {pod: gangPod(nil, map[string]string{}), refused: "gpudra.dev/gang-size"},
	} {
		t.Run(name, func(t *testing.T) {
			resp := Mutate(podRequest(admissionv1.Create, tc.pod), GangPathWorkload)
			if tc.refused != "" {
				require.False(t, resp.Allowed)
				assert.Contains(t, resp.Result.Message, tc.refused)
				return
			}
			require.True(t, resp.Allowed)
			if tc.wantPatch == "" {
				assert.Empty(t, resp.Patch)
				return
			}
			assert.JSONEq(t, tc.wantPatch, string(resp.Patch))
			assert.NotContains(t, string(resp.Patch), "schedulingGates", "no gate on the Workload API path")
		})
	}
}

// TestHandlerRoutes: one handler answers both webhooks by path, and counts
// pods under resource "pods"; gang pods are gated only while the gang path
// is the gate path.
func TestHandlerRoutes(t *testing.T) {
	reg := prometheus.NewRegistry()
	h := NewHandler(reg)
	path := "off"
	h.GangPath = func() string { return path }
	post := func(path string, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
		body, err := json.Marshal(admissionv1.AdmissionReview{TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"}, Request: req})
		require.NoError(t, err)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest(http.MethodPost, path, bytes.NewReader(body)))
		require.Equal(t, http.StatusOK, w.Code, w.Body.String())
		var out admissionv1.AdmissionReview
		require.NoError(t, json.Unmarshal(w.Body.Bytes(), &out))
		return out.Response
	}
	// Gangs off (the API server serves no DeviceTaintRules, say): a gang
	// pod passes unchanged, so that nothing strands it behind a gate.
	resp := post(MutatePath, podRequest(admissionv1.Create, gangPod(nil, nil)))
	assert.True(t, resp.Allowed)
	assert.Empty(t, resp.Patch, "no gate with gangs off")
	path = GangPathGates
	resp = post(MutatePath, podRequest(admissionv1.Create, gangPod(nil, nil)))
	assert.True(t, resp.Allowed)
	assert.JSONEq(t, addGates, string(resp.Patch))
	resp = post(MutatePath, podRequest(admissionv1.Create, gangPod(nil, map[string]string{})))
	assert.False(t, resp.Allowed)
	path = GangPathWorkload
	resp = post(MutatePath, podRequest(admissionv1.Create, gangPod(nil, nil)))
	assert.True(t, resp.Allowed)
	assert.Contains(t, string(resp.Patch), "schedulingGroup")
	// The validating path does not mutate pods.
	resp = post(Path, podRequest(admissionv1.Create, gangPod(nil, nil)))
	assert.True(t, resp.Allowed)
	assert.Empty(t, resp.Patch)

	assert.Equal(t, 4.0, testutil.ToFloat64(h.requests.WithLabelValues("pods", "true")))
	assert.Equal(t, 1.0, testutil.ToFloat64(h.requests.WithLabelValues("pods", "false")))
}

func TestMutatingConfiguration(t *testing.T) {
	client := admissionregistrationv1.WebhookClientConfig{URL: ptr.To("https://127.0.0.1:1" + MutatePath)}
	cfg := MutatingConfiguration("gpudra-webhook", client)
	assert.Equal(t, "gpudra-webhook", cfg.Name)
	require.Len(t, cfg.Webhooks, 1)
	w := cfg.Webhooks[0]
	assert.Equal(t, "pods.gang.gpudra.dev", w.Name)
	assert.Equal(t, client, w.ClientConfig, "the caller's client config, as given")
	require.Len(t, w.Rules, 1)
	assert.Equal(t, []admissionregistrationv1.OperationType{admissionregistrationv1.Create}, w.Rules[0].Operations)
	assert.Equal(t, []string{""}, w.Rules[0].APIGroups)
	assert.Equal(t, []string{"v1"}, w.Rules[0].APIVersions)
	assert.Equal(t, []string{"pods"}, w.Rules[0].Resources)
	require.Len(t, w.MatchConditions, 1)
	assert.Equal(t, `((has(object.metadata.labels) && ('gpudra.dev/gang' in object.metadata.labels || 'grove.io/podgang' in object.metadata.labels)) || `+
		`has(object.spec.schedulingGroup)) && (!has(object.spec.schedulerName) || object.spec.schedulerName == 'default-scheduler')`, w.MatchConditions[0].Expression,
		"gang pods, and pods that name a scheduling group (refuseForeignSchedulingGroup)")
	assert.Equal(t, admissionregistrationv1.Fail, *w.FailurePolicy, "a gang pod admitted without its gate would be scheduled alone")
	assert.Equal(t, admissionregistrationv1.IfNeededReinvocationPolicy, *w.ReinvocationPolicy)
	assert.Equal(t, admissionregistrationv1.SideEffectClassNone, *w.SideEffects)
	assert.Equal(t, int32(5), *w.TimeoutSeconds)
}

func TestConfigurationOwnResources(t *testing.T) {
	cfg := Configuration("gpudra-webhook", admissionregistrationv1.WebhookClientConfig{URL: ptr.To("https://127.0.0.1:1" + Path)}, true)
	byName := map[string]admissionregistrationv1.ValidatingWebhook{}
	for _, w := range cfg.Webhooks {
		byName[w.Name] = w
	}
	require.Len(t, byName, 6)
	for name, gvr := range map[string]metav1.GroupVersionResource{
		"gpureservations.gpudra.dev": {Group: "gpudra.dev", Version: "v1alpha1", Resource: "gpureservations"},
		"gpuqueues.gpudra.dev":       {Group: "gpudra.dev", Version: "v1alpha1", Resource: "gpuqueues"},
	} {
		w, ok := byName[name]
		require.True(t, ok, name)
		assert.Empty(t, w.MatchConditions, "%s: every object is ours", name)
		assert.Equal(t, []string{gvr.Group}, w.Rules[0].APIGroups)
		assert.Equal(t, []string{gvr.Resource}, w.Rules[0].Resources)
		assert.Equal(t, []admissionregistrationv1.OperationType{admissionregistrationv1.Create, admissionregistrationv1.Update}, w.Rules[0].Operations)
		assert.Equal(t, admissionregistrationv1.Fail, *w.FailurePolicy)
	}
	assert.NotEmpty(t, byName["resourceclaims.gpu.gpudra.dev"].MatchConditions)
}

// TestHandlerRefusesGangPodsUndecided: a replica whose gang path is not
// decided (API discovery has not answered it since it started) refuses a
// new gang pod with the reason, rather than admit it unchanged, which would
// schedule it outside its gang (issue 35, item 1); other pods pass.
func TestHandlerRefusesGangPodsUndecided(t *testing.T) {
	h := NewHandler(nil)
	h.GangPath = func() string { return "" }
	post := func(req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
		body, err := json.Marshal(admissionv1.AdmissionReview{TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"}, Request: req})
		require.NoError(t, err)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest(http.MethodPost, MutatePath, bytes.NewReader(body)))
		var out admissionv1.AdmissionReview
		require.NoError(t, json.Unmarshal(w.Body.Bytes(), &out))
		return out.Response
	}
	resp := post(podRequest(admissionv1.Create, gangPod(nil, nil)))
	require.False(t, resp.Allowed, "a gang pod is not admitted outside its gang")
	assert.Equal(t, int32(http.StatusServiceUnavailable), resp.Result.Code)
	assert.Contains(t, resp.Result.Message, "cannot tell yet")
	plain := gangPod(nil, nil)
	plain.Labels = nil
	assert.True(t, post(podRequest(admissionv1.Create, plain)).Allowed, "a pod of no gang passes")
}
