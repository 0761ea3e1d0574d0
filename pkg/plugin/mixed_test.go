package plugin

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
)

// mixedMachine mixes products in one node, as examples/machines/
// h100-l40s-mixed.yaml: two H100s in MIG mode, two L40S cards (no MIG).
const mixedMachine = "name: mixed\ngpuModel: h100-sxm5\ngpuCount: 4\nnvlink: nvswitch\nmigEnabled: all\notherModels: [{model: l40s, gpus: [2, 3]}]\n"

// TestMixedProductsNode: a node whose GPUs are not all MIG-capable
// publishes MIG devices and counter sets only for the H100s, whole GPUs
// for all four, without an error for the L40S cards, and prepares work on
// both products over the real DRA socket.
func TestMixedProductsNode(t *testing.T) {
	e := newEnvOf(t, mixedMachine)
	l40s := claim("uid-l40s", []string{"gpu-2"})
	mig := claim("uid-mig", []string{"gpu-0-mig-1g-10gb-6"})
	kubelet, client := startPlugin(t, e, l40s, mig)

	var slices *resourceapi.ResourceSliceList
	require.Eventually(t, func() bool {
		var err error
		slices, err = client.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{})
		return err == nil && len(slices.Items) > 0
	}, 10*time.Second, 50*time.Millisecond)
	devices, counterSets := map[string]resourceapi.Device{}, map[string]bool{}
	for _, s := range slices.Items {
		for _, d := range s.Spec.Devices {
			devices[d.Name] = d
		}
		for _, cs := range s.Spec.SharedCounters {
			counterSets[cs.Name] = true
		}
	}
	for _, gpu := range []string{"gpu-0", "gpu-1", "gpu-2", "gpu-3"} {
		assert.Contains(t, devices, gpu)
	}
	migsOn := map[string]int{}
	for name := range devices {
		if i := strings.Index(name, "-mig-"); i > 0 {
			migsOn[name[:i]]++
		}
	}
	assert.Positive(t, migsOn["gpu-0"])
	assert.Positive(t, migsOn["gpu-1"])
	assert.Zero(t, migsOn["gpu-2"], "no MIG device on an L40S")
	assert.Zero(t, migsOn["gpu-3"], "no MIG device on an L40S")
	assert.Equal(t, map[string]bool{"gpu-0-counters": true, "gpu-1-counters": true}, counterSets)
	l40sDev := devices["gpu-2"]
	assert.Equal(t, "NVIDIA L40S", *l40sDev.Attributes["productName"].StringValue)
	assert.False(t, *l40sDev.Attributes["migEnabled"].BoolValue)
	assert.NotContains(t, l40sDev.Attributes, resourceapi.QualifiedName("nvlinkDomain"))
	assert.NotContains(t, l40sDev.Capacity, resourceapi.QualifiedName("multiprocessors"), "NVML does not say an L40S's SMs: none published rather than 0")
	mem := l40sDev.Capacity["memory"].Value
	assert.Equal(t, "46068Mi", mem.String())

	req := &drapb.NodePrepareResourcesRequest{Claims: []*drapb.Claim{
		{Namespace: l40s.Namespace, Name: l40s.Name, Uid: string(l40s.UID)},
		{Namespace: mig.Namespace, Name: mig.Name, Uid: string(mig.UID)},
	}}
	resp, err := kubelet.dra.NodePrepareResources(context.Background(), req)
	require.NoError(t, err)
	for uid, r := range resp.Claims {
		assert.Empty(t, r.Error, uid)
		assert.Len(t, r.Devices, 1, uid)
	}
	assert.Len(t, e.migDevices(), 1, "the H100's MIG device was made")
	un, err := kubelet.dra.NodeUnprepareResources(context.Background(), &drapb.NodeUnprepareResourcesRequest{Claims: req.Claims})
	require.NoError(t, err)
	for uid, r := range un.Claims {
		assert.Empty(t, r.Error, uid)
	}
	assert.Empty(t, e.migDevices())
	assert.Empty(t, e.cdiSpecs())
}
