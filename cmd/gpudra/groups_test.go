package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	"github.com/gpudra/gpudra/pkg/controller/grove"
)

// groveFixture is grove-demo from docs/sharing-groups.md: a scaling-group
// claim shared by a primary and a shadow through MPS as two users, and a
// PodCliqueSet-wide claim nobody uses yet; beside them a claim of the user's
// own that is no group.
func groveFixture() []runtime.Object {
	groveLabels := func(extra ...string) map[string]string {
		l := map[string]string{grove.LabelManagedBy: grove.ManagedByGrove, grove.LabelComponent: grove.ComponentResourceClaim, grove.LabelPartOf: "grove-demo"}
		for i := 0; i < len(extra); i += 2 {
			l[extra[i]] = extra[i+1]
		}
		return l
	}
	owner := func(kind, name string) []metav1.OwnerReference {
		return []metav1.OwnerReference{{APIVersion: "grove.io/v1alpha1", Kind: kind, Name: name, UID: "owner-uid", Controller: ptr.To(true)}}
	}
	gpuRequest := resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.gpudra.dev"}}}}
	mps := resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{Driver: "gpu.gpudra.dev",
		Parameters: runtime.RawExtension{Raw: []byte(`{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","ipc":true}}`)}}}
	engine := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "grove-demo-0-engine-0-engine-gpu", Namespace: "default", UID: "engine-uid",
			Labels:          groveLabels(grove.LabelScalingGroup, "grove-demo-0-engine", grove.LabelScalingGroupReplica, "0"),
			OwnerReferences: owner("PodCliqueScalingGroup", "grove-demo-0-engine")},
		Spec: resourceapi.ResourceClaimSpec{Devices: gpuRequest},
		Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{
			Devices: resourceapi.DeviceAllocationResult{
				Results: []resourceapi.DeviceRequestAllocationResult{{Request: "gpu", Driver: "gpu.gpudra.dev", Pool: "node-a", Device: "gpu-0"}},
				Config:  []resourceapi.DeviceAllocationConfiguration{{Source: resourceapi.AllocationConfigSourceClaim, DeviceConfiguration: mps}},
			},
			NodeSelector: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchFields: []corev1.NodeSelectorRequirement{
				{Key: "metadata.name", Operator: corev1.NodeSelectorOpIn, Values: []string{"node-a"}}}}}},
		}},
	}
	pool := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "grove-demo-all-pool-gpu", Namespace: "default", UID: "pool-uid",
			Labels: groveLabels(), OwnerReferences: owner("PodCliqueSet", "grove-demo")},
		Spec: resourceapi.ResourceClaimSpec{Devices: gpuRequest},
	}
	mine := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "mine", Namespace: "default"}, Spec: resourceapi.ResourceClaimSpec{Devices: gpuRequest}}
	pod := func(name string, user int64) *corev1.Pod {
		return &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", UID: types.UID("uid-" + name), Labels: map[string]string{grove.LabelManagedBy: grove.ManagedByGrove}},
			Spec: corev1.PodSpec{
				NodeName:        "node-a",
				SecurityContext: &corev1.PodSecurityContext{RunAsUser: ptr.To(user)},
				ResourceClaims:  []corev1.PodResourceClaim{{Name: engine.Name, ResourceClaimName: ptr.To(engine.Name)}},
				Containers:      []corev1.Container{{Name: "engine", Resources: corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: engine.Name}}}}},
			},
			Status: corev1.PodStatus{Phase: corev1.PodRunning},
		}
	}
	slice := &resourceapi.ResourceSlice{
		ObjectMeta: metav1.ObjectMeta{Name: "node-a-gpu"},
		Spec: resourceapi.ResourceSliceSpec{Driver: "gpu.gpudra.dev", Pool: resourceapi.ResourcePool{Name: "node-a", ResourceSliceCount: 1}, NodeName: ptr.To("node-a"),
			Devices: []resourceapi.Device{{Name: "gpu-0", Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				"uuid": {StringValue: ptr.To("GPU-11111111-2222-3333-4444-555555555555")}}}}},
	}
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a"}}
	return []runtime.Object{engine, pool, mine, pod("grove-demo-0-engine-0-primary-abcde", 1000), pod("grove-demo-0-engine-0-shadow-fghij", 2000), slice, node}
}

func runGroups(t *testing.T, args ...string) string {
	t.Helper()
	client := fake.NewClientset(groveFixture()...)
	cmd := newGroupsCommand(func(string, string) (kubernetes.Interface, string, error) { return client, "default", nil })
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetArgs(args)
	require.NoError(t, cmd.ExecuteContext(context.Background()))
	return out.String()
}

func TestGroupsTable(t *testing.T) {
	want := `NAMESPACE  CLAIM                             LEVEL                  SCOPE        OWNER                CONSUMERS  NODE    DEVICES  SHARING  PROBLEMS
default    grove-demo-0-engine-0-engine-gpu  PodCliqueScalingGroup  PerReplica   grove-demo-0-engine  2          node-a  gpu-0    MPS+IPC  MPSUsersDiffer
default    grove-demo-all-pool-gpu           PodCliqueSet           AllReplicas  grove-demo           0          <none>  <none>   Exclusive  <none>
`
	// tabwriter pads per column; compare the fields, not the spaces.
	got := runGroups(t)
	require.Equal(t, fields(want), fields(got), got)
}

func TestGroupsWide(t *testing.T) {
	got := runGroups(t, "-o", "wide", "-A")
	lines := strings.Split(strings.TrimSpace(got), "\n")
	require.Len(t, lines, 3, got)
	assert.Equal(t, []string{"PODS", "UUIDS"}, strings.Fields(lines[0])[10:])
	assert.Equal(t, []string{"grove-demo-0-engine-0-primary-abcde,grove-demo-0-engine-0-shadow-fghij", "GPU-11111111-2222-3333-4444-555555555555"},
		strings.Fields(lines[1])[10:])
}

func TestGroupsJSONAndYAMLAreTheReports(t *testing.T) {
	var fromJSON, fromYAML []grove.Group
	dec := json.NewDecoder(strings.NewReader(runGroups(t, "-o", "json")))
	dec.DisallowUnknownFields()
	require.NoError(t, dec.Decode(&fromJSON))
	require.NoError(t, yaml.UnmarshalStrict([]byte(runGroups(t, "-o", "yaml")), &fromYAML))
	assert.Equal(t, fromJSON, fromYAML)
	require.Len(t, fromJSON, 2)
	g := fromJSON[0]
	assert.Equal(t, grove.LevelScalingGroup, g.Level)
	assert.Equal(t, "node-a", g.Node)
	assert.Equal(t, "GPU-11111111-2222-3333-4444-555555555555", g.Devices[0].UUID)
	require.Len(t, g.Problems, 1)
	assert.Equal(t, grove.ReasonMPSUsersDiffer, g.Problems[0].Reason)
	assert.Equal(t, []string{"grove-demo-0-engine-0-primary-abcde", "grove-demo-0-engine-0-shadow-fghij"}, g.Problems[0].Pods)
}

func TestGroupsNone(t *testing.T) {
	got := runGroups(t, "-n", "elsewhere")
	assert.Equal(t, "No Grove sharing groups found.\n", got)
}

func fields(s string) [][]string {
	var out [][]string
	for _, l := range strings.Split(strings.TrimSpace(s), "\n") {
		out = append(out, strings.Fields(l))
	}
	return out
}
