package webhook

import (
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/utils/ptr"

	gpudraapi "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
)

// hasOurConfig is CEL that is true when a list of device configs holds an
// opaque config for gpu.gpudra.dev. The API server evaluates it before
// calling the webhook, so objects without our config never reach it and an
// outage of ours blocks nobody else.
func hasOurConfig(list string) string {
	return list + ".exists(c, has(c.opaque) && c.opaque.driver == '" + DriverName + "')"
}

// matchConditions per resource: the same test at each resource's path.
var matchConditions = map[schema.GroupVersionResource]string{
	ResourceClaims:         "has(object.spec.devices) && has(object.spec.devices.config) && " + hasOurConfig("object.spec.devices.config"),
	ResourceClaimTemplates: "has(object.spec.spec.devices) && has(object.spec.spec.devices.config) && " + hasOurConfig("object.spec.spec.devices.config"),
	DeviceClasses:          "has(object.spec.config) && " + hasOurConfig("object.spec.config"),
	PodCliqueSets: "has(object.spec.template) && has(object.spec.template.resourceClaimTemplates) && " +
		"object.spec.template.resourceClaimTemplates.exists(t, has(t.templateSpec) && has(t.templateSpec.spec) && " +
		"has(t.templateSpec.spec.devices) && has(t.templateSpec.spec.devices.config) && " + hasOurConfig("t.templateSpec.spec.devices.config") + ")",
}

// webhookNames name one webhook per resource: matchConditions belong to a
// webhook, not to a rule.
var webhookNames = map[schema.GroupVersionResource]string{
	ResourceClaims:         "resourceclaims.gpu.gpudra.dev",
	ResourceClaimTemplates: "resourceclaimtemplates.gpu.gpudra.dev",
	DeviceClasses:          "deviceclasses.gpu.gpudra.dev",
	PodCliqueSets:          "podcliquesets.gpu.gpudra.dev",
	GpuReservations:        "gpureservations.gpudra.dev",
	GpuQueues:              "gpuqueues.gpudra.dev",
}

// Configuration is the ValidatingWebhookConfiguration that sends the
// webhook what it validates, calling it through client (a Service in a
// cluster, a URL in devcluster). The chart renders the same configuration
// (templates/webhook.yaml); grove adds the PodCliqueSet webhook. The API
// server matches rules by name, so a rule for PodCliqueSets is accepted, and
// harmless, where Grove's CRD is not installed. GpuReservations and
// GpuQueues are all ours: their webhooks have no matchConditions.
func Configuration(name string, client admissionregistrationv1.WebhookClientConfig, grove bool) *admissionregistrationv1.ValidatingWebhookConfiguration {
	resources := []schema.GroupVersionResource{ResourceClaims, ResourceClaimTemplates, DeviceClasses, GpuReservations, GpuQueues}
	if grove {
		resources = append(resources, PodCliqueSets)
	}
	cfg := &admissionregistrationv1.ValidatingWebhookConfiguration{ObjectMeta: metav1.ObjectMeta{Name: name}}
	for _, r := range resources {
		scope := admissionregistrationv1.AllScopes
		var conditions []admissionregistrationv1.MatchCondition
		if cel, ok := matchConditions[r]; ok {
			conditions = []admissionregistrationv1.MatchCondition{{Name: "has-gpudra-config", Expression: cel}}
		}
		cfg.Webhooks = append(cfg.Webhooks, admissionregistrationv1.ValidatingWebhook{
			Name:         webhookNames[r],
			ClientConfig: client,
			Rules: []admissionregistrationv1.RuleWithOperations{{
				Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create, admissionregistrationv1.Update},
				Rule:       admissionregistrationv1.Rule{APIGroups: []string{r.Group}, APIVersions: []string{r.Version}, Resources: []string{r.Resource}, Scope: &scope},
			}},
			MatchConditions:         conditions,
			FailurePolicy:           ptr.To(admissionregistrationv1.Fail),
			SideEffects:             ptr.To(admissionregistrationv1.SideEffectClassNone),
			AdmissionReviewVersions: []string{"v1"},
			TimeoutSeconds:          ptr.To[int32](5),
		})
	}
	return cfg
}

// GangWebhookName is the mutating webhook that gates gang pods.
const GangWebhookName = "pods.gang.gpudra.dev"

// gangPodCondition is IsGangPod in CEL, and pods that name a scheduling
// group: only those, for the default scheduler, reach the webhook, so that
// its outage blocks no other pod. The second kind is checked on the
// Workload API path: a pod may not join another gang's PodGroup
// (refuseForeignSchedulingGroup). A pod's nodeName is not tested: a pod
// created bound skips the scheduler, is rare, and the webhook lets it
// through unchanged.
const gangPodCondition = "((has(object.metadata.labels) && ('" + gpudraapi.LabelGang + "' in object.metadata.labels || '" +
	LabelGrovePodGang + "' in object.metadata.labels)) || has(object.spec.schedulingGroup)) && " +
	"(!has(object.spec.schedulerName) || object.spec.schedulerName == '" + corev1.DefaultSchedulerName + "')"

// MutatingConfiguration is the MutatingWebhookConfiguration that sends the
// webhook the pods of gangs at creation, calling it through client, which
// must name MutatePath (the Service's path, or the URL's). The chart
// renders the same configuration (templates/webhook.yaml, gangs.enabled).
// failurePolicy Fail: a gang pod admitted without its gate would be
// scheduled alone, which is what gangs exist to prevent. Reinvoked if a
// later webhook changes the pod, so that the gate survives one that
// rewrites schedulingGates.
func MutatingConfiguration(name string, client admissionregistrationv1.WebhookClientConfig) *admissionregistrationv1.MutatingWebhookConfiguration {
	scope := admissionregistrationv1.AllScopes
	return &admissionregistrationv1.MutatingWebhookConfiguration{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Webhooks: []admissionregistrationv1.MutatingWebhook{{
			Name:         GangWebhookName,
			ClientConfig: client,
			Rules: []admissionregistrationv1.RuleWithOperations{{
				Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create},
				Rule:       admissionregistrationv1.Rule{APIGroups: []string{Pods.Group}, APIVersions: []string{Pods.Version}, Resources: []string{Pods.Resource}, Scope: &scope},
			}},
			MatchConditions:         []admissionregistrationv1.MatchCondition{{Name: "gang-pod", Expression: gangPodCondition}},
			FailurePolicy:           ptr.To(admissionregistrationv1.Fail),
			SideEffects:             ptr.To(admissionregistrationv1.SideEffectClassNone),
			ReinvocationPolicy:      ptr.To(admissionregistrationv1.IfNeededReinvocationPolicy),
			AdmissionReviewVersions: []string{"v1"},
			TimeoutSeconds:          ptr.To[int32](5),
		}},
	}
}
