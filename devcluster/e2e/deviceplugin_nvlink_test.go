package e2e

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// dpPCIeNode is a device-plugin node with four H100 PCIe cards in two
// NVLink-bridged pairs (GPUs 0-1 and 2-3): two NVLink domains of two GPUs.
const (
	dpPCIeNode    = "dp-pcie-0"
	dpPCIeMachine = "h100-pcie-nvlink"
)

// The device plugin's preferred allocation keeps a 2-GPU request inside
// one NVLink domain when it matters: once a 1-GPU pod has broken one
// bridged pair, three GPUs are free and only one choice of two of them is
// a pair; the kubelet left to itself could pick any two. A third 1-GPU pod
// then gets the broken pair's other GPU.
func TestDevicePluginNVLinkPairs(t *testing.T) {
	ctx := context.Background()
	node := cluster.Node(dpPCIeNode)
	if node == nil {
		var err error
		node, err = cluster.AddNode(ctx, nodeagent.DevicePluginNode(dpPCIeNode, dpPCIeMachine,
			mustDPConfig("version: v1\nflags:\n  plugin:\n    deviceListStrategy: cdi-cri\n")))
		require.NoError(t, err)
		require.NoError(t, node.WaitForDevicePlugin(ctx))
	}
	c, a := nodeResource(t, dpPCIeNode, "nvidia.com/gpu")
	assert.Equal(t, int64(4), c, "capacity nvidia.com/gpu")
	assert.Equal(t, int64(4), a, "allocatable nvidia.com/gpu")

	gpus, _ := inventory(t, node)
	require.Len(t, gpus, 4)
	members := map[string][]string{} // NVLink domain -> GPU UUIDs
	for uuid, g := range gpus {
		require.NotEmpty(t, g.NVLink.Domain, "GPU %d has no NVLink domain", g.Index)
		members[g.NVLink.Domain] = append(members[g.NVLink.Domain], uuid)
	}
	require.Len(t, members, 2, "two bridged pairs: %v", members)
	for d, uuids := range members {
		require.Len(t, uuids, 2, "domain %s", d)
	}

	ns := namespace(t)
	// gotGPUs waits for the pod to run and returns the whole GPUs its
	// container sees.
	gotGPUs := func(name string, want int) []nvdevice.GPU {
		t.Helper()
		pod := waitRunning(t, ns, name)
		assert.Equal(t, dpPCIeNode, pod.Spec.NodeName, name)
		visible := views(t, pod)["cuda"].VisibleGPUs()
		require.Len(t, visible, want, "%s sees %v", name, visible)
		var out []nvdevice.GPU
		for _, uuid := range visible {
			g, ok := gpus[uuid]
			require.True(t, ok, "%s sees %s, not a GPU of the node", name, uuid)
			out = append(out, g)
		}
		return out
	}

	// One GPU: it breaks one of the pairs.
	create(t, ns, nil, dpPod("one", dpPCIeNode, map[string]int64{"nvidia.com/gpu": 1}))
	first := gotGPUs("one", 1)[0]
	broken := first.NVLink.Domain

	// Two GPUs out of three free: the intact pair.
	create(t, ns, nil, dpPod("pair", dpPCIeNode, map[string]int64{"nvidia.com/gpu": 2}))
	pair := gotGPUs("pair", 2)
	assert.Equal(t, pair[0].NVLink.Domain, pair[1].NVLink.Domain,
		"GPUs %d and %d are not one NVLink domain", pair[0].Index, pair[1].Index)
	for _, g := range pair {
		assert.NotEqual(t, broken, g.NVLink.Domain, "GPU %d is in the domain pod one broke", g.Index)
		assert.NotEqual(t, first.UUID, g.UUID)
	}

	// One more: what is left, the first pod's partner.
	create(t, ns, nil, dpPod("partner", dpPCIeNode, map[string]int64{"nvidia.com/gpu": 1}))
	partner := gotGPUs("partner", 1)[0]
	assert.NotEqual(t, first.UUID, partner.UUID)
	assert.Equal(t, broken, partner.NVLink.Domain, "the last free GPU is the first pod's partner")
	for _, g := range pair {
		assert.NotEqual(t, g.UUID, partner.UUID)
	}
}
