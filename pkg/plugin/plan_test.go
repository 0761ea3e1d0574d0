package plugin

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/runtime"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

func TestPlanConfigMatching(t *testing.T) {
	e := newEnv(t)
	inv, err := e.machine.Inventory(context.Background())
	require.NoError(t, err)
	bad := `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"Nope"}}`
	opaque := func(requests []string, raw string) resourceapi.DeviceAllocationConfiguration {
		return resourceapi.DeviceAllocationConfiguration{Source: resourceapi.AllocationConfigSourceClaim, Requests: requests,
			DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{
				Driver: slicebuilder.DriverName, Parameters: runtime.RawExtension{Raw: []byte(raw)}}}}
	}
	tests := []struct {
		name    string
		request string // the result's request, "gpu/full" for a firstAvailable subrequest
		config  resourceapi.DeviceAllocationConfiguration
		wantErr string
	}{
		{"config for the parent request reaches a subrequest", "gpu/full", opaque([]string{"gpu"}, bad), `sharing.strategy: Unsupported value: "Nope"`},
		{"config for the subrequest", "gpu/full", opaque([]string{"gpu/full"}, bad), `sharing.strategy: Unsupported value: "Nope"`},
		{"config for another subrequest does not apply", "gpu/full", opaque([]string{"gpu/mig"}, bad), ""},
		{"config for every request", "gpu", opaque(nil, bad), `sharing.strategy: Unsupported value: "Nope"`},
		{"another driver's config is ignored", "gpu", func() resourceapi.DeviceAllocationConfiguration {
			c := opaque(nil, `not even json`)
			c.Opaque.Driver = "other.example.com"
			return c
		}(), ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := claim("u", []string{"gpu-0"})
			c.Status.Allocation.Devices.Results[0].Request = tc.request
			c.Status.Allocation.Devices.Config = []resourceapi.DeviceAllocationConfiguration{tc.config}
			plan, err := Plan(c, pool, inv, nil)
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			require.Len(t, plan, 1)
			assert.Equal(t, gpuapi.Exclusive, plan[0].Config.Sharing.Strategy)
		})
	}
}

func TestPlanSkipsOtherDriversAndPools(t *testing.T) {
	e := newEnv(t)
	inv, _ := e.machine.Inventory(context.Background())
	c := claim("u", []string{"gpu-0"})
	c.Status.Allocation.Devices.Results = append(c.Status.Allocation.Devices.Results,
		resourceapi.DeviceRequestAllocationResult{Request: "nic", Driver: "net.example.com", Pool: pool, Device: "eth0"},
		resourceapi.DeviceRequestAllocationResult{Request: "gpu", Driver: slicebuilder.DriverName, Pool: "node-b", Device: "gpu-1"})
	plan, err := Plan(c, pool, inv, nil)
	require.NoError(t, err)
	require.Len(t, plan, 1)
	assert.Equal(t, "gpu-0", plan[0].Device)

	c.Status.Allocation = nil
	_, err = Plan(c, pool, inv, nil)
	require.EqualError(t, err, "claim ns/claim-u is not allocated")
}
