package plugin

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/cdi"
)

// A pod whose one claim has two requests, one per container (a whole GPU
// and a MIG device), prepared by the node state on the simulated node: the
// OCI spec of each container, resolved by the CDI library, has its own
// device nodes only, env naming only its own GPU, and
// NVIDIA_VISIBLE_DEVICES=void.
func TestTwoRequestClaimEachContainerSeesItsOwnDevice(t *testing.T) {
	e := newEnv(t)
	s := e.start()
	c := claim("u1", []string{"gpu-4", "gpu-1-mig-3g-40gb-4"})
	c.Status.Allocation.Devices.Results[0].Request = "first"
	c.Status.Allocation.Devices.Results[1].Request = "second"
	devs, err := prep(s, c)
	require.NoError(t, err)
	require.Len(t, devs, 2)
	inv, err := e.machine.Inventory(context.Background())
	require.NoError(t, err)
	migs := e.migDevices()
	require.Len(t, migs, 1)
	host, err := e.machine.Host(context.Background())
	require.NoError(t, err)
	giMinor, ciMinor, err := host.CapMinors(inv.GPUs[1].Minor, migs[0].GPUInstanceID, migs[0].ComputeInstanceID)
	require.NoError(t, err)

	control := []string{"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}
	containers := []struct {
		device, uuid string
		nodes        []string
	}{
		{"gpu-4", inv.GPUs[4].UUID, []string{cdi.GPUNode(host.Majors, inv.GPUs[4].Minor).Path}},
		{"gpu-1-mig-3g-40gb-4", migs[0].UUID, []string{cdi.GPUNode(host.Majors, inv.GPUs[1].Minor).Path,
			cdi.CapNode(host.Majors, giMinor).Path, cdi.CapNode(host.Majors, ciMinor).Path}},
	}
	for i, want := range containers {
		other := containers[1-i]
		require.Equal(t, want.device, devs[i].Device)
		spec := inject(t, e.cdiDir, devs[i].CDIDeviceIDs)
		var paths []string
		for _, d := range spec.Linux.Devices {
			paths = append(paths, d.Path)
		}
		assert.ElementsMatch(t, append(append([]string{}, control...), want.nodes...), paths, "container of %s", want.device)
		assert.ElementsMatch(t, []string{"NVIDIA_VISIBLE_DEVICES=void", cdi.DeviceUUIDEnv(cdi.DeviceName("u1", want.device)) + "=" + want.uuid},
			spec.Process.Env, "container of %s", want.device)
		for _, env := range spec.Process.Env {
			assert.NotContains(t, env, other.uuid, "container of %s", want.device)
			assert.False(t, strings.HasPrefix(env, "CUDA_VISIBLE_DEVICES="), "container of %s", want.device)
		}
	}
}
