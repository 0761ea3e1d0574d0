package e2e

import (
	"context"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/dynamic"
	"sigs.k8s.io/yaml"

	gpudraapi "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/webhook"
)

const (
	goodConfig = `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"TimeSlicing","timeSlicing":{"interval":"Short"}}}`
	badConfig  = `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"Fast"}}`
)

func gpuClaimSpec(driver, params string) resourceapi.ResourceClaimSpec {
	spec := resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
		Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.gpudra.dev"}}},
	}}
	if driver != "" {
		spec.Devices.Config = []resourceapi.DeviceClaimConfiguration{{Requests: []string{"gpu"}, DeviceConfiguration: resourceapi.DeviceConfiguration{
			Opaque: &resourceapi.OpaqueDeviceConfiguration{Driver: driver, Parameters: runtime.RawExtension{Raw: []byte(params)}}}}}
	}
	return spec
}

func createClaim(ctx context.Context, ns, name string, spec resourceapi.ResourceClaimSpec) error {
	_, err := cluster.Client.ResourceV1().ResourceClaims(ns).Create(ctx, &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: spec}, metav1.CreateOptions{})
	return err
}

// TestWebhook: the API server's admission chain calls gpudra's webhook for
// objects with gpudra config, which refuses a wrong GpuConfig naming the
// field and lets a right one through.
func TestWebhook(t *testing.T) {
	ctx := context.Background()
	ns := namespace(t)

	t.Run("claim", func(t *testing.T) {
		err := createClaim(ctx, ns, "bad", gpuClaimSpec(webhook.DriverName, badConfig))
		require.Error(t, err)
		assert.True(t, apierrors.IsInvalid(err) || apierrors.IsForbidden(err) || strings.Contains(err.Error(), "denied the request"), "%v", err)
		assert.Contains(t, err.Error(), `admission webhook "resourceclaims.gpu.gpudra.dev" denied the request`)
		assert.Contains(t, err.Error(), `spec.devices.config[0].opaque.parameters: Invalid value: invalid GpuConfig: sharing.strategy: Unsupported value: "Fast"`)
		require.NoError(t, createClaim(ctx, ns, "good", gpuClaimSpec(webhook.DriverName, goodConfig)))
	})

	t.Run("claim update", func(t *testing.T) {
		claim, err := cluster.Client.ResourceV1().ResourceClaims(ns).Get(ctx, "good", metav1.GetOptions{})
		require.NoError(t, err)
		claim.Spec.Devices.Config[0].Opaque.Parameters.Raw = []byte(badConfig)
		// The spec of a claim is immutable; the API server's own
		// validation answers first, and either refusal keeps the bad config out.
		_, err = cluster.Client.ResourceV1().ResourceClaims(ns).Update(ctx, claim, metav1.UpdateOptions{})
		require.Error(t, err)
	})

	t.Run("template", func(t *testing.T) {
		tmpl := func(name, params string) *resourceapi.ResourceClaimTemplate {
			return &resourceapi.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Name: name},
				Spec: resourceapi.ResourceClaimTemplateSpec{Spec: gpuClaimSpec(webhook.DriverName, params)}}
		}
		_, err := cluster.Client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, tmpl("bad", `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"activeThreadPercentage":500}}}`), metav1.CreateOptions{})
		require.Error(t, err)
		assert.Contains(t, err.Error(), `admission webhook "resourceclaimtemplates.gpu.gpudra.dev" denied the request`)
		assert.Contains(t, err.Error(), `spec.spec.devices.config[0].opaque.parameters: Invalid value: invalid GpuConfig: sharing.mps.activeThreadPercentage`)
		_, err = cluster.Client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, tmpl("good", goodConfig), metav1.CreateOptions{})
		require.NoError(t, err)
	})

	t.Run("deviceclass", func(t *testing.T) {
		class := func(name, params string) *resourceapi.DeviceClass {
			return &resourceapi.DeviceClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: resourceapi.DeviceClassSpec{
				Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: `device.driver == "gpu.gpudra.dev"`}}},
				Config: []resourceapi.DeviceClassConfiguration{{DeviceConfiguration: resourceapi.DeviceConfiguration{
					Opaque: &resourceapi.OpaqueDeviceConfiguration{Driver: webhook.DriverName, Parameters: runtime.RawExtension{Raw: []byte(params)}}}}},
			}}
		}
		dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
		_, err := cluster.Client.ResourceV1().DeviceClasses().Create(ctx, class(ns+"-bad", `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","ipc":true,"extra":1}}`), dry)
		require.Error(t, err)
		assert.Contains(t, err.Error(), `admission webhook "deviceclasses.gpu.gpudra.dev" denied the request`)
		assert.Contains(t, err.Error(), `spec.config[0].opaque.parameters: Invalid value: decode GpuConfig: unknown field "sharing.extra"`)
		_, err = cluster.Client.ResourceV1().DeviceClasses().Create(ctx, class(ns+"-good", goodConfig), dry)
		require.NoError(t, err)
	})

	t.Run("podcliqueset", func(t *testing.T) {
		// devcluster installs Grove's CRDs (Options.Grove): a missing one
		// is a broken install, not a reason to skip.
		_, err := cluster.Client.Discovery().ServerResourcesForGroupVersion("grove.io/v1alpha1")
		require.NoError(t, err, "Grove's CRDs are not served")
		dyn, err := dynamic.NewForConfig(cluster.RESTConfig)
		require.NoError(t, err)
		raw, err := os.ReadFile(examples + "/grove/podcliqueset.yaml")
		require.NoError(t, err)
		pcs := &unstructured.Unstructured{}
		require.NoError(t, yaml.Unmarshal(raw, &pcs.Object))
		pcs.SetNamespace(ns)
		api := dyn.Resource(webhook.PodCliqueSets).Namespace(ns)
		dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
		_, err = api.Create(ctx, pcs, dry)
		require.NoError(t, err, "the example is accepted")
		// The scaling group's template asks for an unknown sharing strategy.
		templates, _, err := unstructured.NestedSlice(pcs.Object, "spec", "template", "resourceClaimTemplates")
		require.NoError(t, err)
		configs, _, err := unstructured.NestedSlice(templates[0].(map[string]any), "templateSpec", "spec", "devices", "config")
		require.NoError(t, err)
		require.NoError(t, unstructured.SetNestedField(configs[0].(map[string]any), "Fast", "opaque", "parameters", "sharing", "strategy"))
		require.NoError(t, unstructured.SetNestedSlice(templates[0].(map[string]any), configs, "templateSpec", "spec", "devices", "config"))
		require.NoError(t, unstructured.SetNestedSlice(pcs.Object, templates, "spec", "template", "resourceClaimTemplates"))
		_, err = api.Create(ctx, pcs, dry)
		require.Error(t, err)
		assert.Contains(t, err.Error(), `admission webhook "podcliquesets.gpu.gpudra.dev" denied the request`)
		assert.Contains(t, err.Error(), `spec.template.resourceClaimTemplates[0].templateSpec.spec.devices.config[0].opaque.parameters: Invalid value: invalid GpuConfig: sharing.strategy`)
	})

	t.Run("gang pods", func(t *testing.T) {
		dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
		for _, tc := range []struct {
			name           string
			labels, annots map[string]string
			scheduler      string
			gated          bool
			refused        string
		}{
			{name: "plain gang", labels: map[string]string{gpudraapi.LabelGang: "train"}, annots: map[string]string{gpudraapi.AnnotationGangSize: "2"}, gated: true},
			{name: "grove member", labels: map[string]string{webhook.LabelGrovePodGang: "pcs-0"}, gated: true},
			{name: "kai-scheduler", labels: map[string]string{gpudraapi.LabelGang: "train"}, scheduler: "kai-scheduler"},
			{name: "not a gang", labels: map[string]string{"app": "x"}},
			{name: "gang without size", labels: map[string]string{gpudraapi.LabelGang: "train"},
				refused: `admission webhook "pods.gang.gpudra.dev" denied the request: metadata.annotations[gpudra.dev/gang-size]: Required value`},
			{name: "bad duration", labels: map[string]string{gpudraapi.LabelGang: "train"},
				annots:  map[string]string{gpudraapi.AnnotationGangSize: "2", gpudraapi.AnnotationDuration: "soon"},
				refused: `metadata.annotations[gpudra.dev/duration]: Invalid value: "soon"`},
		} {
			t.Run(tc.name, func(t *testing.T) {
				got, err := cluster.Client.CoreV1().Pods(ns).Create(ctx, gangTestPod(tc.labels, tc.annots, tc.scheduler), dry)
				if tc.refused != "" {
					require.Error(t, err)
					assert.Contains(t, err.Error(), tc.refused)
					return
				}
				require.NoError(t, err)
				var gates []string
				for _, g := range got.Spec.SchedulingGates {
					gates = append(gates, g.Name)
				}
				if tc.gated {
					assert.Equal(t, []string{"example.com/other", gpudraapi.SchedulingGate}, gates)
				} else {
					assert.Equal(t, []string{"example.com/other"}, gates)
				}
			})
		}
	})

	t.Run("gpureservation", func(t *testing.T) {
		// devcluster installs gpudra's CRDs as the chart does: a missing
		// one fails.
		_, err := cluster.Client.Discovery().ServerResourcesForGroupVersion(gpudraapi.APIVersion)
		require.NoError(t, err, "gpudra's CRDs are not served")
		dyn, err := dynamic.NewForConfig(cluster.RESTConfig)
		require.NoError(t, err)
		dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
		res := func(spec map[string]any) *unstructured.Unstructured {
			return &unstructured.Unstructured{Object: map[string]any{"apiVersion": gpudraapi.APIVersion, "kind": gpudraapi.KindGpuReservation,
				"metadata": map[string]any{"name": "r"}, "spec": spec}}
		}
		api := dyn.Resource(webhook.GpuReservations).Namespace(ns)
		_, err = api.Create(ctx, res(map[string]any{"deviceClassName": "gpu.gpudra.dev", "count": int64(2), "ttl": "1h"}), dry)
		require.NoError(t, err)
		// A selector that does not compile passes the CRD's schema; the
		// webhook refuses it.
		_, err = api.Create(ctx, res(map[string]any{"deviceClassName": "gpu.gpudra.dev", "ttl": "1h", "selectors": []any{"device.("}}), dry)
		require.Error(t, err)
		assert.Contains(t, err.Error(), `admission webhook "gpureservations.gpudra.dev" denied the request`)
		assert.Contains(t, err.Error(), "spec.selectors[0]")
	})

	t.Run("unrelated objects while the webhook is down", func(t *testing.T) {
		cluster.SetWebhookDown(true)
		defer func() {
			cluster.SetWebhookDown(false)
			require.NoError(t, cluster.WaitForWebhook(ctx, 30*time.Second))
		}()
		// No config, and another driver's config: the matchConditions keep
		// them away from the webhook, so its outage blocks nobody.
		require.NoError(t, createClaim(ctx, ns, "no-config", gpuClaimSpec("", "")))
		require.NoError(t, createClaim(ctx, ns, "other-driver", gpuClaimSpec("other.example.com", `{"any":"thing"}`)))
		// Ours fail closed: a wrong config must not slip through an outage.
		err := createClaim(ctx, ns, "ours", gpuClaimSpec(webhook.DriverName, goodConfig))
		require.Error(t, err)
		assert.Contains(t, err.Error(), `failed calling webhook "resourceclaims.gpu.gpudra.dev"`)
		// Pods: only gang pods for the default scheduler wait for the
		// webhook; a gang pod must not slip through ungated.
		dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
		_, err = cluster.Client.CoreV1().Pods(ns).Create(ctx, gangTestPod(map[string]string{"app": "x"}, nil, ""), dry)
		require.NoError(t, err)
		_, err = cluster.Client.CoreV1().Pods(ns).Create(ctx, gangTestPod(map[string]string{gpudraapi.LabelGang: "train"}, nil, "kai-scheduler"), dry)
		require.NoError(t, err)
		_, err = cluster.Client.CoreV1().Pods(ns).Create(ctx, gangTestPod(map[string]string{gpudraapi.LabelGang: "train"},
			map[string]string{gpudraapi.AnnotationGangSize: "2"}, ""), dry)
		require.Error(t, err)
		assert.Contains(t, err.Error(), `failed calling webhook "pods.gang.gpudra.dev"`)
	})
}

// gangTestPod is a pod with another scheduling gate already, so that the
// webhook's patch must append to the list.
func gangTestPod(labels, annotations map[string]string, scheduler string) *v1.Pod {
	return &v1.Pod{ObjectMeta: metav1.ObjectMeta{GenerateName: "gang-", Labels: labels, Annotations: annotations},
		Spec: v1.PodSpec{SchedulerName: scheduler, SchedulingGates: []v1.PodSchedulingGate{{Name: "example.com/other"}},
			Containers: []v1.Container{{Name: "c", Image: "busybox"}}}}
}

// TestWebhookChartMatchesCode: the chart's ValidatingWebhookConfiguration
// is the one pkg/webhook.Configuration builds (which devcluster installs
// and the tests above exercise), but for how the API server reaches it.
func TestWebhookChartMatchesCode(t *testing.T) {
	for _, grove := range []bool{true, false} {
		// Rendered only (not applied): the release's own names.
		out, err := render(t, "--set", "fullnameOverride=gpudra", "--set", "webhook.grove="+strconv.FormatBool(grove))
		require.NoError(t, err, out)
		var got admissionregistrationv1.ValidatingWebhookConfiguration
		for _, o := range objectsFrom(t, out) {
			if o.GetKind() == "ValidatingWebhookConfiguration" {
				require.NoError(t, runtimeConvert(o, &got))
			}
		}
		require.NotEmpty(t, got.Webhooks, "the chart renders a webhook configuration")
		client := admissionregistrationv1.WebhookClientConfig{Service: &admissionregistrationv1.ServiceReference{
			Namespace: chartNamespace, Name: "gpudra-webhook", Path: ptr(webhook.Path), Port: ptr[int32](443)}}
		want := webhook.Configuration("gpudra-webhook", client, grove)
		assert.Equal(t, want.Name, got.Name)
		assert.Equal(t, want.Webhooks, got.Webhooks, "grove=%t", grove)
	}
}

// TestWebhookChartMatchesCodeMutating: the same for the gang pods'
// MutatingWebhookConfiguration, which gangs.enabled=false leaves out.
func TestWebhookChartMatchesCodeMutating(t *testing.T) {
	for _, gangs := range []bool{true, false} {
		out, err := render(t, "--set", "fullnameOverride=gpudra", "--set", "gangs.enabled="+strconv.FormatBool(gangs))
		require.NoError(t, err, out)
		var got *admissionregistrationv1.MutatingWebhookConfiguration
		for _, o := range objectsFrom(t, out) {
			if o.GetKind() == "MutatingWebhookConfiguration" {
				got = &admissionregistrationv1.MutatingWebhookConfiguration{}
				require.NoError(t, runtimeConvert(o, got))
			}
		}
		if !gangs {
			assert.Nil(t, got, "gangs.enabled=false renders no MutatingWebhookConfiguration")
			continue
		}
		require.NotNil(t, got, "the chart renders a MutatingWebhookConfiguration")
		client := admissionregistrationv1.WebhookClientConfig{Service: &admissionregistrationv1.ServiceReference{
			Namespace: chartNamespace, Name: "gpudra-webhook", Path: ptr(webhook.MutatePath), Port: ptr[int32](443)}}
		want := webhook.MutatingConfiguration("gpudra-webhook", client)
		assert.Equal(t, want.Name, got.Name)
		assert.Equal(t, want.Webhooks, got.Webhooks)
	}
}
