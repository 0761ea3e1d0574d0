package cloud

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"

	"github.com/gpudra/gpudra/devcluster/cloudapi"
)

// TestNodeOptions: a machine request becomes the node its machine runs as
// (the type's simulated machine in the MIG mode asked for, its policy, the
// provider ID, the labels a cloud's kubelet adds); bad requests are refused
// naming the field.
func TestNodeOptions(t *testing.T) {
	opts, err := nodeOptions(cloudapi.MachineRequest{Name: "m-1", InstanceType: "p5e.48xlarge",
		Configuration: cloudapi.Configuration{MIGMode: true, MIGDevices: "profiles=1g.18gb"}, Labels: map[string]string{"team": "a"},
		Taints: []cloudapi.Taint{{Key: "karpenter.sh/unregistered", Effect: "NoExecute"}}})
	require.NoError(t, err)
	assert.Equal(t, "hgx-h200", opts.Machine)
	assert.Equal(t, "devcluster://m-1", opts.ProviderID)
	assert.Equal(t, map[string]string{"team": "a", v1.LabelInstanceTypeStable: "p5e.48xlarge", v1.LabelTopologyZone: cloudapi.Zone}, opts.Labels)
	assert.Equal(t, []v1.Taint{{Key: "karpenter.sh/unregistered", Effect: v1.TaintEffectNoExecute}}, opts.Taints)
	require.NotNil(t, opts.MigDevices)

	for _, tt := range []struct {
		req  cloudapi.MachineRequest
		want string
	}{
		{cloudapi.MachineRequest{InstanceType: "p5.48xlarge"}, "machine request: name is empty"},
		{cloudapi.MachineRequest{Name: "m", InstanceType: "p4d.24xlarge"}, `machine request m: instanceType: unknown machine type "p4d.24xlarge"`},
		{cloudapi.MachineRequest{Name: "m", InstanceType: "p5.48xlarge", Configuration: cloudapi.Configuration{MIGDevices: "some"}}, "machine request m: configuration.migDevices:"},
		{cloudapi.MachineRequest{Name: "m", InstanceType: "p5.48xlarge", Taints: []cloudapi.Taint{{Key: "k", Effect: "Never"}}}, `machine request m: taints[0].effect: "Never"`},
	} {
		_, err := nodeOptions(tt.req)
		require.Error(t, err)
		assert.Contains(t, err.Error(), tt.want)
	}
}

// TestInstanceTypes: the cloud sells its cloud types only, each with a
// fresh node's templates under the configuration, and prices that make an
// H100 machine cheaper than an H200 one.
func TestInstanceTypes(t *testing.T) {
	types, err := InstanceTypes(context.Background(), cloudapi.Configuration{})
	require.NoError(t, err)
	price := map[string]float64{}
	for _, it := range types {
		price[it.Name] = it.PricePerHour
		var tmpl struct {
			InstanceType           string            `json:"instanceType"`
			ResourceSliceTemplates []json.RawMessage `json:"resourceSliceTemplates"`
		}
		require.NoError(t, json.Unmarshal(it.Templates, &tmpl))
		assert.Equal(t, it.Name, tmpl.InstanceType)
		assert.NotEmpty(t, tmpl.ResourceSliceTemplates, it.Name)
	}
	assert.NotContains(t, price, "dgx-h100", "the simulator's own machines are not on sale")
	assert.Less(t, price["p5.48xlarge"], price["p5e.48xlarge"])
	_, err = InstanceTypes(context.Background(), cloudapi.Configuration{MIGDevices: "bogus"})
	require.ErrorContains(t, err, "migDevices:")
}
