package controller

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	metadatafake "k8s.io/client-go/metadata/fake"
	"k8s.io/klog/v2/ktesting"

	"github.com/gpudra/gpudra/pkg/controller/nodehold"
)

// TestLeaderProtectsNodes: the leader marks a node that holds a gpudra
// claim when ProtectNodes is on; with it off, it removes the marks an
// earlier leader set and leaves an administrator's.
func TestLeaderProtectsNodes(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	scheme := metadatafake.NewTestScheme()
	require.NoError(t, metav1.AddMetaToScheme(scheme))
	node := func(name string, annotations map[string]string) *metav1.PartialObjectMetadata {
		return &metav1.PartialObjectMetadata{TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Node"},
			ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: annotations}}
	}
	md := metadatafake.NewSimpleMetadataClient(scheme, node("n1", nil),
		node("admin", map[string]string{nodehold.KarpenterDoNotDisrupt: "true"}))
	claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "a", Name: "job"},
		Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{
			Results: []resourceapi.DeviceRequestAllocationResult{{Request: "gpu", Driver: "gpu.gpudra.dev", Pool: "n1", Device: "gpu-0"}}}}}}
	client := fake.NewClientset(claim)
	annotations := func(name string) map[string]string {
		n, err := md.Resource(nodehold.Nodes).Get(ctx, name, metav1.GetOptions{})
		require.NoError(t, err)
		return n.Annotations
	}
	run := func(protect bool, until func() bool, msg string) {
		t.Helper()
		ctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() {
			done <- Run(ctx, Config{Client: client, Metadata: md, ProtectNodes: protect, Namespace: "gpudra-system", Identity: "a",
				LeaseDuration: 2 * time.Second, RenewDeadline: 1500 * time.Millisecond, RetryPeriod: 100 * time.Millisecond})
		}()
		assert.Eventually(t, until, 10*time.Second, 20*time.Millisecond, msg)
		cancel()
		require.NoError(t, <-done)
	}
	run(true, func() bool { return annotations("n1")[nodehold.Marker] != "" }, "the leader marks the node that holds a claim")
	assert.Equal(t, "true", annotations("n1")[nodehold.ClusterAutoscalerScaleDownDisabled])

	run(false, func() bool { return len(annotations("n1")) == 0 }, "turned off, the leader removes its marks")
	assert.Equal(t, map[string]string{nodehold.KarpenterDoNotDisrupt: "true"}, annotations("admin"), "and leaves the administrator's")
}
