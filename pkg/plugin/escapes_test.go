package plugin

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"

	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// shareOf makes result i of c a share of its GPU with the given memory and
// multiprocessors.
func shareOf(c *resourceapi.ResourceClaim, i int, id, mem, sms string) *resourceapi.ResourceClaim {
	sid := types.UID(id)
	r := &c.Status.Allocation.Devices.Results[i]
	r.ShareID = &sid
	r.ConsumedCapacity = map[resourceapi.QualifiedName]resource.Quantity{
		slicebuilder.CapacityMemory: resource.MustParse(mem), slicebuilder.CapacityMultiprocessors: resource.MustParse(sms)}
	return c
}

// adminOf gives result i of c admin access.
func adminOf(c *resourceapi.ResourceClaim, i int) *resourceapi.ResourceClaim {
	yes := true
	c.Status.Allocation.Devices.Results[i].AdminAccess = &yes
	return c
}

// A share of a GPU cannot change the whole GPU's time slice or ask for
// more than it was given through its opaque config: refused at prepare by
// field, and nothing is set up.
func TestShareCannotEscape(t *testing.T) {
	const head = `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":`
	tests := []struct {
		name    string
		config  string
		wantErr string
	}{
		{name: "time slicing", config: head + `{"strategy":"TimeSlicing","timeSlicing":{"interval":"Long"}}}`,
			wantErr: "sharing.strategy: Forbidden: TimeSlicing is not allowed on a share of device gpu-5"},
		{name: "thread percentage above the share's multiprocessors", config: head + `{"strategy":"MPS","mps":{"activeThreadPercentage":26}}}`,
			wantErr: "sharing.mps.activeThreadPercentage: Invalid value: 26: exceeds the share of device gpu-5 (33 of 132 multiprocessors: at most 25)"},
		{name: "pinned memory above the share", config: head + `{"strategy":"MPS","mps":{"pinnedMemoryLimit":"40Gi"}}}`,
			wantErr: `sharing.mps.pinnedMemoryLimit: Invalid value: "40Gi": exceeds the share of device gpu-5 (20480Mi)`},
		{name: "within the share", config: head + `{"strategy":"MPS","mps":{"activeThreadPercentage":25,"pinnedMemoryLimit":"10Gi"}}}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t)
			s := e.start()
			devs, err := prep(s, shareOf(claim("u1", []string{"gpu-5"}, tt.config), 0, "s1", "20Gi", "33"))
			if tt.wantErr == "" {
				require.NoError(t, err)
				spec := inject(t, e.cdiDir, devs[0].CDIDeviceIDs)
				assert.Contains(t, spec.Process.Env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25")
				assert.Contains(t, spec.Process.Env, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M")
				return
			}
			require.Error(t, err)
			assert.Contains(t, err.Error(), "claim ns/claim-u1: request gpu: invalid GpuConfig: "+tt.wantErr)
			assert.Empty(t, e.cdiSpecs(), "a refused share leaves nothing")
			assert.Empty(t, e.daemonPIDs())
			_, ok := preparedOf(t, s, "u1")
			assert.False(t, ok)
		})
	}
}

// Two requests of one claim that each got a share of the same GPU are two
// CDI devices, both prepared, each capped at its own share.
func TestTwoSharesOfOneGPUInOneClaim(t *testing.T) {
	e := newEnv(t)
	s := e.start()
	c := claim("u1", []string{"gpu-5", "gpu-5"})
	c.Status.Allocation.Devices.Results[1].Request = "second"
	shareOf(shareOf(c, 0, "s-a", "20Gi", "33"), 1, "s-b", "40Gi", "66")
	devs, err := prep(s, c)
	require.NoError(t, err)
	require.Len(t, devs, 2)
	require.Len(t, devs[0].CDIDeviceIDs, 1)
	require.Len(t, devs[1].CDIDeviceIDs, 1)
	assert.NotEqual(t, devs[0].CDIDeviceIDs[0], devs[1].CDIDeviceIDs[0], "distinct CDI device names")
	assert.Equal(t, "gpu.gpudra.dev/claim=u1-gpu-5-share-s-a", devs[0].CDIDeviceIDs[0])
	for _, d := range devs {
		spec := inject(t, e.cdiDir, d.CDIDeviceIDs)
		assert.Contains(t, spec.Process.Env, "NVIDIA_VISIBLE_DEVICES=void")
		var paths []string
		for _, n := range spec.Linux.Devices {
			paths = append(paths, n.Path)
		}
		assert.Contains(t, paths, "/dev/nvidia5")
	}
	assert.Len(t, e.daemonPIDs(), 1, "one MPS server for the GPU")

	// A claim with one share keeps the device name, as before.
	one, err := prep(s, shareOf(claim("u2", []string{"gpu-5"}), 0, "s-c", "10Gi", "0"))
	require.NoError(t, err)
	assert.Equal(t, "gpu.gpudra.dev/claim=u2-gpu-5", one[0].CDIDeviceIDs[0])

	_, err = s.Unprepare(context.Background(), "u1")
	require.NoError(t, err)
	_, err = s.Unprepare(context.Background(), "u2")
	require.NoError(t, err)
	assert.Empty(t, e.cdiSpecs())
	assert.Empty(t, e.daemonPIDs())
}

// Admin access is not a use of a device: it prepares beside the claim that
// uses the device (in either order), creates no MIG instance, and gets the
// monitoring view: the whole GPU's device node, no limits, no sharing.
func TestAdminAccessBesideARunningClaim(t *testing.T) {
	tests := []struct {
		name       string
		running    *resourceapi.ResourceClaim
		admin      *resourceapi.ResourceClaim
		adminFirst bool
		wantNode   string
		wantErr    string
	}{
		{name: "whole GPU in use", running: claim("run", []string{"gpu-3"}), admin: adminOf(claim("adm", []string{"gpu-3"}), 0), wantNode: "/dev/nvidia3"},
		{name: "admin first", running: claim("run", []string{"gpu-3"}), admin: adminOf(claim("adm", []string{"gpu-3"}), 0), adminFirst: true, wantNode: "/dev/nvidia3"},
		{name: "time-sliced claim", running: claim("run", []string{"gpu-4"}, timeSliced), admin: adminOf(claim("adm", []string{"gpu-4"}, timeSliced), 0), wantNode: "/dev/nvidia4"},
		{name: "share of a fractional GPU", running: shareOf(claim("run", []string{"gpu-5"}), 0, "s1", "20Gi", "33"), admin: adminOf(claim("adm", []string{"gpu-5"}), 0), wantNode: "/dev/nvidia5"},
		{name: "MIG-mode GPU as a whole, no instance created", running: claim("run", []string{"gpu-0-mig-3g-40gb-4"}), admin: adminOf(claim("adm", []string{"gpu-0"}), 0), wantNode: "/dev/nvidia0"},
		{name: "MIG placement without a device", running: claim("run", []string{"gpu-1-mig-3g-40gb-4"}), admin: adminOf(claim("adm", []string{"gpu-1-mig-1g-10gb-0"}), 0),
			wantErr: "device gpu-1-mig-1g-10gb-0 of claim ns/claim-adm: admin access to a MIG placement without a MIG device: admin access never creates one (it is not a use of the device); ask for the parent GPU gpu-1 for its monitoring view"},
		{name: "admin beside shared devices in one claim", running: claim("run", []string{"gpu-6"}),
			admin:   adminOf(claim("adm", []string{"gpu-6", "gpu-7"}, timeSliced), 0),
			wantErr: "claim ns/claim-adm: devices gpu-6 have admin access and gpu-7 are shared (TimeSlicing): admin access gets no sharing, split the claim"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t)
			s := e.start()
			first, second := tt.running, tt.admin
			if tt.adminFirst {
				first, second = second, first
			}
			_, err := prep(s, first)
			require.NoError(t, err)
			migsBefore := len(e.migDevices())
			pidsBefore := len(e.daemonPIDs())
			devs, err := prep(s, second)
			if tt.wantErr != "" {
				require.EqualError(t, err, tt.wantErr)
				assert.Len(t, e.migDevices(), migsBefore)
				return
			}
			require.NoError(t, err, "admin access is no conflict")
			assert.Len(t, e.migDevices(), migsBefore, "admin access creates no MIG instance")
			assert.Len(t, e.daemonPIDs(), pidsBefore, "admin access starts no MPS server")
			if tt.adminFirst {
				devs, _ = preparedOf(t, s, "adm")
			}
			require.Len(t, devs, 1)
			assert.True(t, devs[0].AdminAccess)
			rec, ok, err := s.Record(context.Background(), "adm")
			require.NoError(t, err)
			require.True(t, ok)
			assert.Nil(t, rec.Sharing, "no sharing set up for admin access")

			spec := inject(t, e.cdiDir, devs[0].CDIDeviceIDs)
			var paths []string
			for _, n := range spec.Linux.Devices {
				paths = append(paths, n.Path)
			}
			assert.Contains(t, paths, tt.wantNode)
			for _, env := range spec.Process.Env {
				assert.NotContains(t, env, "CUDA_MPS_", "no limits for admin access")
			}

			// Unpreparing the admin claim leaves the running claim alone.
			_, err = s.Unprepare(context.Background(), "adm")
			require.NoError(t, err)
			_, ok = preparedOf(t, s, "run")
			assert.True(t, ok)
			assert.Len(t, e.migDevices(), migsBefore)
		})
	}
}
