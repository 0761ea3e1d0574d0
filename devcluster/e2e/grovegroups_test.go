package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"sigs.k8s.io/yaml"

	"github.com/gpudra/gpudra/pkg/controller/grove"
)

// The gpudra controller reports a Grove sharing group that cannot work with
// an Event on the claim (and on its Grove owner), once. Each case is a
// group as Grove makes it: a claim with Grove's labels and the pods that
// name it.

// groveLabels are the labels Grove puts on its claims and pods.
func groveLabels(pcs string) map[string]string {
	return map[string]string{grove.LabelManagedBy: grove.ManagedByGrove, grove.LabelPartOf: pcs,
		grove.LabelComponent: grove.ComponentResourceClaim}
}

// groveClaim creates a claim labelled as Grove's PodCliqueSet-level claim.
func groveClaim(t *testing.T, ns, name string, count int64) {
	t.Helper()
	claim := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: groveLabels("pcs")},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
			Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.gpudra.dev", AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: count,
				Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: `!("sharing" in device.attributes["gpu.gpudra.dev"])`}}}},
		}}}},
	}
	_, err := cluster.Client.ResourceV1().ResourceClaims(ns).Create(context.Background(), claim, metav1.CreateOptions{})
	require.NoError(t, err)
}

// groveConsumer creates a pod that uses the claim in its container, as
// Grove injects it; gated pods are never scheduled.
func groveConsumer(t *testing.T, ns, name, claim string, mutate func(*v1.Pod)) {
	t.Helper()
	labels := groveLabels("pcs")
	delete(labels, grove.LabelComponent)
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels},
		Spec: v1.PodSpec{
			ResourceClaims: []v1.PodResourceClaim{{Name: claim, ResourceClaimName: ptr(claim)}},
			Containers: []v1.Container{{Name: "c", Image: "cuda", Command: []string{"sleep", "infinity"},
				Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: claim}}}}},
		},
	}
	if mutate != nil {
		mutate(pod)
	}
	_, err := cluster.Client.CoreV1().Pods(ns).Create(context.Background(), pod, metav1.CreateOptions{})
	require.NoError(t, err)
}

// waitGroupEvents waits for the controller's Events of a reason regarding
// an object, and checks that there is one, not a copy per replica or per
// resync (the count of a series may grow; the objects may not).
func waitGroupEvents(t *testing.T, ns, kind, name, reason string) eventsv1.Event {
	t.Helper()
	var found []eventsv1.Event
	require.Eventually(t, func() bool {
		list, err := cluster.Client.EventsV1().Events(ns).List(context.Background(), metav1.ListOptions{})
		if err != nil {
			return false
		}
		found = nil
		for _, e := range list.Items {
			if e.Reason == reason && e.Regarding.Kind == kind && e.Regarding.Name == name {
				found = append(found, e)
			}
		}
		return len(found) > 0
	}, 90*time.Second, 250*time.Millisecond, "an Event %s regarding %s %s/%s; pods: %s", reason, kind, ns, name, podStates(ns))
	// Resyncs and the second replica must not report it again.
	time.Sleep(3 * time.Second)
	list, err := cluster.Client.EventsV1().Events(ns).List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	var again []string
	for _, e := range list.Items {
		if e.Reason == reason && e.Regarding.Kind == kind && e.Regarding.Name == name {
			again = append(again, e.Note)
		}
	}
	require.Len(t, again, 1, "reported once: %v", again)
	require.Equal(t, v1.EventTypeWarning, found[0].Type)
	return found[0]
}

func TestGroveGroupTooManyConsumers(t *testing.T) {
	ns := namespace(t)
	groveClaim(t, ns, "pcs-all-big", 1)
	gated := func(p *v1.Pod) {
		p.Spec.SchedulingGates = []v1.PodSchedulingGate{{Name: "grove.io/podgang-pending-creation"}}
	}
	for i := 0; i <= resourceapi.ResourceClaimReservedForMaxSize; i++ {
		groveConsumer(t, ns, fmt.Sprintf("consumer-%d", i), "pcs-all-big", gated)
	}
	e := waitGroupEvents(t, ns, "ResourceClaim", "pcs-all-big", "TooManyConsumers")
	require.Contains(t, e.Note, "257")
}

func TestGroveGroupConsumerNodeExcluded(t *testing.T) {
	ns := namespace(t)
	groveClaim(t, ns, "pcs-all-gpu", 1)
	groveConsumer(t, ns, "first", "pcs-all-gpu", nil)
	first := waitRunning(t, ns, "first")
	nodes, err := cluster.Client.CoreV1().Nodes().List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	other := ""
	for _, n := range nodes.Items {
		if n.Name != first.Spec.NodeName {
			other = n.Name
			break
		}
	}
	require.NotEmpty(t, other)
	groveConsumer(t, ns, "elsewhere", "pcs-all-gpu", func(p *v1.Pod) {
		p.Spec.NodeSelector = map[string]string{"kubernetes.io/hostname": other}
	})
	e := waitGroupEvents(t, ns, "ResourceClaim", "pcs-all-gpu", "ConsumerNodeExcluded")
	require.Contains(t, e.Note, "elsewhere")
}

func TestGroveGroupConsumersPending(t *testing.T) {
	ns := namespace(t)
	// Nine whole GPUs: no node has more than eight, so the group can never start.
	groveClaim(t, ns, "pcs-all-huge", 9)
	groveConsumer(t, ns, "waiting", "pcs-all-huge", nil)
	e := waitGroupEvents(t, ns, "ResourceClaim", "pcs-all-huge", "ConsumersPending")
	require.Contains(t, e.Note, "waiting")
}

// A PodCliqueSet through the Grove stand-in: the primary and the shadow of
// a scaling group share an MPS claim but run as different users, which one
// MPS server cannot serve. The claim and its owner, the scaling group, both
// get the Event.
func TestGroveGroupMPSUsersDiffer(t *testing.T) {
	ns := namespace(t)
	const manifest = `
apiVersion: grove.io/v1alpha1
kind: PodCliqueSet
metadata:
  name: mps-users
spec:
  replicas: 1
  template:
    cliqueStartupType: CliqueStartupTypeAnyOrder
    resourceClaimTemplates:
    - name: engine-gpu
      templateSpec:
        spec:
          devices:
            requests:
            - name: gpu
              exactly:
                deviceClassName: gpu.gpudra.dev
                selectors:
                - cel:
                    expression: '!("sharing" in device.attributes["gpu.gpudra.dev"])'
            config:
            - requests: ["gpu"]
              opaque:
                driver: gpu.gpudra.dev
                parameters:
                  apiVersion: gpu.gpudra.dev/v1alpha1
                  kind: GpuConfig
                  sharing:
                    strategy: MPS
    podCliqueScalingGroups:
    - name: engine
      cliqueNames: ["primary", "shadow"]
      replicas: 1
      minAvailable: 1
      resourceSharing:
      - name: engine-gpu
        scope: PerReplica
    cliques:
    - name: primary
      spec:
        roleName: primary
        replicas: 1
        minAvailable: 1
        podSpec:
          securityContext: {runAsUser: 1000}
          containers:
          - {name: engine, image: cuda, command: ["sleep", "infinity"]}
    - name: shadow
      spec:
        roleName: shadow
        replicas: 1
        minAvailable: 1
        podSpec:
          securityContext: {runAsUser: 2000}
          containers:
          - {name: engine, image: cuda, command: ["sleep", "infinity"]}
`
	var obj map[string]any
	require.NoError(t, yaml.Unmarshal([]byte(manifest), &obj))
	dyn, err := dynamic.NewForConfig(cluster.RESTConfig)
	require.NoError(t, err)
	pcs := &unstructured.Unstructured{Object: obj}
	_, err = dyn.Resource(podCliqueSetGVR).Namespace(ns).Create(context.Background(), pcs, metav1.CreateOptions{})
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = dyn.Resource(podCliqueSetGVR).Namespace(ns).Delete(context.Background(), "mps-users", metav1.DeleteOptions{})
	})

	// Grove names the scaling group <pcs>-<replica>-<group> and its
	// PerReplica claim <owner>-<replica>-<template>.
	const owner, claim = "mps-users-0-engine", "mps-users-0-engine-0-engine-gpu"
	e := waitGroupEvents(t, ns, "ResourceClaim", claim, "MPSUsersDiffer")
	require.True(t, strings.Contains(e.Note, "1000") && strings.Contains(e.Note, "2000"), "the users are named: %s", e.Note)
	require.NotNil(t, e.Related)
	require.Equal(t, "PodCliqueScalingGroup", e.Related.Kind)
	waitGroupEvents(t, ns, "PodCliqueScalingGroup", owner, "MPSUsersDiffer")
}

var podCliqueSetGVR = schema.GroupVersionResource{Group: "grove.io", Version: "v1alpha1", Resource: "podcliquesets"}

// podStates describes a namespace's pods, for failure messages.
func podStates(ns string) string {
	pods, err := cluster.Client.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		return err.Error()
	}
	var out []string
	for i := range pods.Items {
		if i == 3 {
			out = append(out, fmt.Sprintf("... %d more", len(pods.Items)-3))
			break
		}
		out = append(out, pods.Items[i].Name+": "+describe(&pods.Items[i]))
	}
	return strings.Join(out, "; ")
}
