package e2e

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/devcluster/noderuntime"
	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/deviceplugin"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// dpNoCDINode runs NVIDIA's default device list strategy (envvar): the
// device plugin answers with device nodes, mounts and variables, no CDI
// names, as a runtime without CDI (containerd 1.7 without enable_cdi)
// needs.
const dpNoCDINode = "dp-h100-nocdi-0"

// TestDevicePluginWithoutCDI: with NVIDIA's default config shape and no
// CDI in the runtime, a container still gets its GPU or MIG device: the
// kubelet's device specs are stat'ed on the (simulated) host and put into
// the OCI spec with their cgroup rules, as containerd does, and the result
// is the same device nodes, GPU and driver files as the CDI path gives for
// the same device (resolved from the node's CDI specs by the CDI library).
func TestDevicePluginWithoutCDI(t *testing.T) {
	ctx := context.Background()
	node := cluster.Node(dpNoCDINode)
	if node == nil {
		// migStrategy mixed, deviceListStrategy left to NVIDIA's default.
		var err error
		node, err = cluster.AddNode(ctx, nodeagent.DevicePluginNode(dpNoCDINode, dpMachine, mustDPConfig("version: v1\nflags:\n  migStrategy: mixed\n")))
		require.NoError(t, err)
		require.NoError(t, node.WaitForDevicePlugin(ctx))
	}
	ns := namespace(t)
	gpus, migs := inventory(t, node)
	migGPU := map[string]nvdevice.GPU{}
	for _, g := range gpus {
		for _, m := range g.MIG.Devices {
			migGPU[m.UUID] = g
		}
	}
	create(t, ns, nil, dpPod("gpu", dpNoCDINode, map[string]int64{"nvidia.com/gpu": 1}),
		dpPod("mig", dpNoCDINode, map[string]int64{"nvidia.com/mig-1g.10gb": 1}))
	for _, name := range []string{"gpu", "mig"} {
		view := views(t, waitRunning(t, ns, name))["cuda"]
		assert.Empty(t, view.CDIDevices, "%s: no CDI names with envvar", name)
		require.Len(t, view.VisibleGPUs(), 1, "%s: %+v", name, view)
		uuid := view.VisibleGPUs()[0]
		assert.Equal(t, uuid, view.Env["NVIDIA_VISIBLE_DEVICES"], "%s: NVIDIA's variable names the device", name)

		// The CDI path for the same device.
		var device string
		if g, ok := gpus[uuid]; ok {
			require.Equal(t, "gpu", name, "a whole GPU for the nvidia.com/gpu pod only")
			device = slicebuilder.GPUDeviceName(&g)
		} else {
			m, ok := migs[uuid]
			require.True(t, ok, "%s sees %s, neither a GPU nor a MIG device of the node", name, uuid)
			require.Equal(t, "mig", name)
			g := migGPU[uuid]
			device = slicebuilder.MigDeviceName(&g, m.Profile, m.Placement.Start)
		}
		viaCDI, err := noderuntime.ResolveCDI(node.CDIDir(), []string{deviceplugin.CDIDeviceName(device), cdi.DriverDeviceID}, noderuntime.MachineDevices(node.Machine))
		require.NoError(t, err)
		assert.Equal(t, viaCDI.VisibleGPUs(), view.VisibleGPUs(), name)
		assert.Equal(t, viaCDI.DeviceNodes, view.DeviceNodes, "%s: the same device nodes as through CDI", name)
		if name == "mig" {
			assert.Contains(t, strings.Join(view.DeviceNodes, " "), "/dev/nvidia-caps/nvidia-cap", "the MIG device's capability nodes")
		}
		assert.Equal(t, mountPoints(viaCDI.DriverMounts), mountPoints(view.DriverMounts), "%s: the driver's files as through CDI", name)
		assert.NotEmpty(t, view.DriverMounts, name)
		for _, m := range view.DriverMounts {
			assert.True(t, strings.HasSuffix(m, ":rbind,rprivate,ro"), "%s: driver file mounted read-only as a bind mount by the runtime: %s", name, m)
		}
	}
}

// mountPoints are "source:destination" of "source:destination:options".
func mountPoints(mounts []string) []string {
	out := make([]string, 0, len(mounts))
	for _, m := range mounts {
		i := strings.LastIndex(m, ":")
		out = append(out, m[:i])
	}
	return out
}
