package slicebuilder

import (
	"context"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

// machine builds a simulated machine: a built-in one by name, otherwise one
// described by the YAML spec given inline (sim.ParseSpec + sim.New).
func machine(t testing.TB, nameOrYAML, node string) (*sim.Machine, *nvdevice.Inventory) {
	t.Helper()
	var m *sim.Machine
	var err error
	if slices.Contains(sim.BuiltinMachines(), nameOrYAML) {
		m, err = sim.NewBuiltin(nameOrYAML, node)
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

// build runs Build and ResourceSlices, as the plugin and the CLI do.
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

// oneGPUMig is a machine with one H100 SXM5 in MIG mode.
const oneGPUMig = "name: one\ngpuCount: 1\nmigEnabled: all\n"
