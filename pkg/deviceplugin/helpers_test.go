package deviceplugin

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

// builtin is a built-in simulated machine and its inventory.
func builtin(t *testing.T, machine string) (*sim.Machine, *nvdevice.Inventory) {
	t.Helper()
	m, err := sim.NewBuiltin(machine, "node-a")
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Close() })
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	return m, inv
}

// migMachine has GPU 0 whole and GPU 1 in MIG mode with MIG devices
// configured on it: two 1g.10gb and one 3g.40gb.
func migMachine(t *testing.T) (*sim.Machine, *nvdevice.Inventory) {
	t.Helper()
	m, err := sim.New(sim.MachineSpec{Name: "mixed", GPUModel: sim.ModelH100SXM5, GPUCount: 2, NVLink: sim.NVLinkNVSwitch,
		MigEnabled: sim.MigEnabledSpec{Indexes: []int{1}},
		MigDevices: []sim.MigDeviceSpec{{GPU: 1, Profile: "1g.10gb", Start: 0}, {GPU: 1, Profile: "1g.10gb", Start: 1}, {GPU: 1, Profile: "3g.40gb", Start: 4}},
	}, "node-a")
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Close() })
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	return m, inv
}

// twoDomains is the dgx-h100-nomig board with its GPUs 4-7 moved onto
// NVSwitches of their own, so that the GPU model derives two NVLink
// domains of four GPUs each (as on two boards without a shared fabric).
func twoDomains(t *testing.T) *nvdevice.Inventory {
	t.Helper()
	_, inv := builtin(t, "dgx-h100-nomig")
	for i := 4; i < 8; i++ {
		for j := range inv.GPUs[i].NVLink.Links {
			l := &inv.GPUs[i].NVLink.Links[j]
			l.RemoteBusID = fmt.Sprintf("0000:f%d:00.0", j%4)
		}
	}
	nvdevice.AssignNVLinkDomains(inv.GPUs, nil)
	require.NotEqual(t, inv.GPUs[0].NVLink.Domain, inv.GPUs[4].NVLink.Domain)
	require.Equal(t, inv.GPUs[0].NVLink.Domain, inv.GPUs[3].NVLink.Domain)
	require.Equal(t, inv.GPUs[4].NVLink.Domain, inv.GPUs[7].NVLink.Domain)
	return inv
}

func resourceNamed(t *testing.T, rs []Resource, name string) Resource {
	t.Helper()
	for _, r := range rs {
		if r.Name == name {
			return r
		}
	}
	require.Failf(t, "resource missing", "%s not in %v", name, names(rs))
	return Resource{}
}

func names(rs []Resource) []string {
	var out []string
	for _, r := range rs {
		out = append(out, r.Name)
	}
	return out
}

func ids(devs []Device) []string {
	var out []string
	for _, d := range devs {
		out = append(out, d.ID)
	}
	return out
}
