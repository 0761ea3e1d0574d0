package slicebuilder

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

func machine(t testing.TB, nameOrYAML, node string) (*sim.Machine, *nvdevice.Inventory) {
	t.Helper()
	var m *sim.Machine
	var err error
	if spec, perr := sim.LookupSpec(nameOrYAML); perr == nil {
		m, err = sim.New(spec, node)
	} else {
		spec, perr := sim.ParseSpec([]byte(nameOrYAML))
		require.NoError(t, perr)
		m, err = sim.New(spec, node)
	}
	require.NoError(t, err)
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	return m, inv
}

func build(t testing.TB, inv *nvdevice.Inventory, node string, opts Options) []resourceapi.ResourceSlice {
	t.Helper()
	res, err := Build(inv, node, opts)
	require.NoError(t, err)
	return ResourceSlices(res, node)
}

func allDevices(slices []resourceapi.ResourceSlice) []resourceapi.Device {
	var out []resourceapi.Device
	for _, s := range slices {
		out = append(out, s.Spec.Devices...)
	}
	return out
}

func devicesByName(slices []resourceapi.ResourceSlice) map[string]resourceapi.Device {
	out := map[string]resourceapi.Device{}
	for _, d := range allDevices(slices) {
		out[d.Name] = d
	}
	return out
}

func strAttr(d resourceapi.Device, name resourceapi.QualifiedName) string {
	if a, ok := d.Attributes[name]; ok && a.StringValue != nil {
		return *a.StringValue
	}
	return ""
}

const oneGPUMig = "name: one\ngpuCount: 1\nmigEnabled: all\n"
