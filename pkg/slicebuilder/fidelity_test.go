package slicebuilder

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

// fidelityPlacement is one published MIG placement with what it asks of the
// hardware and of the counters.
type fidelityPlacement struct {
	name     string
	req      nvdevice.MigCreateRequest
	consumes map[string]int64
}

// TestCountersAgreeWithSimulator walks every MIG layout reachable on one
// H100 (depth first, adding placements in slice order only, so that each
// set of MIG devices is visited once) and checks at each step that the
// published counters accept a further MIG device exactly when the simulated
// hardware lets us create it.
func TestCountersAgreeWithSimulator(t *testing.T) {
	tests := []struct {
		name string
		spec string
		// wantStates is the number of layouts (sets of coexisting MIG
		// devices, the empty one included) the walk must reach.
		wantStates int
	}{
		{"h100-sxm5", "name: one-sxm5\ngpuModel: h100-sxm5\ngpuCount: 1\nmigEnabled: all\n", 2319},
		{"h100-pcie", "name: one-pcie\ngpuModel: h100-pcie\ngpuCount: 1\nmigEnabled: all\n", 2319},
		// Someone else's MIG devices: their slices and engines are taken
		// out of the counters (a foreign +me holds the only OFA engine).
		{"foreign 1g.10gb+me at 6", "name: f1\ngpuCount: 1\nmigEnabled: all\nmigDevices: [{gpu: 0, profile: 1g.10gb+me, start: 6}]\n", 0},
		{"foreign 3g.40gb at 4", "name: f2\ngpuCount: 1\nmigEnabled: all\nmigDevices: [{gpu: 0, profile: 3g.40gb, start: 4}]\n", 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			spec, err := sim.ParseSpec([]byte(tc.spec))
			require.NoError(t, err)
			m, err := sim.New(spec, "node-a")
			require.NoError(t, err)
			inv, err := m.Inventory(context.Background())
			require.NoError(t, err)
			require.Len(t, inv.GPUs, 1)

			capacity, placements := fidelityModel(t, inv, build(t, inv, "node-a", Options{}))
			if len(inv.GPUs[0].MIG.Devices) == 0 {
				require.Len(t, placements, 25, "every MIG placement of an H100 is published")
			}

			states, checks := walkLayouts(t, m, capacity, placements)
			t.Logf("%s: %d MIG layouts visited, %d create decisions compared", tc.name, states, checks)
			if tc.wantStates > 0 {
				assert.Equal(t, tc.wantStates, states)
			} else {
				assert.Greater(t, states, 1)
			}
		})
	}
}

// fidelityModel reads the one counter set and the MIG placements (devices
// without a uuid: those that do not exist yet) of a one-GPU pool, and maps
// each back to the create request it stands for.
func fidelityModel(t *testing.T, inv *nvdevice.Inventory, slices []resourceapi.ResourceSlice) (map[string]int64, []fidelityPlacement) {
	t.Helper()
	g := &inv.GPUs[0]
	// Device name -> create request, from the GPU's own profile table.
	byName := map[string]nvdevice.MigCreateRequest{}
	for _, p := range g.MIG.Profiles {
		for _, pl := range p.Placements {
			label := strings.NewReplacer(".", "-", "+", "-").Replace(p.Name)
			byName[fmt.Sprintf("gpu-%d-mig-%s-%d", g.Minor, label, pl.Start)] = nvdevice.MigCreateRequest{ParentUUID: g.UUID, Profile: p.Name, Start: pl.Start}
		}
	}

	capacity := map[string]int64{}
	var sets []string
	var placements []fidelityPlacement
	for _, s := range slices {
		for _, cs := range s.Spec.SharedCounters {
			sets = append(sets, cs.Name)
			for name, c := range cs.Counters {
				capacity[name] = c.Value.Value()
			}
		}
		for _, d := range s.Spec.Devices {
			if strAttr(d, "type") != TypeMIG || strAttr(d, "uuid") != "" {
				continue // not a MIG placement, or one that exists already
			}
			req, ok := byName[d.Name]
			require.True(t, ok, "MIG device %s is no placement of the GPU", d.Name)
			require.Equal(t, req.Profile, strAttr(d, "migProfile"), d.Name)
			require.Len(t, d.ConsumesCounters, 1, d.Name)
			consumes := map[string]int64{}
			for name, c := range d.ConsumesCounters[0].Counters {
				consumes[name] = c.Value.Value()
			}
			placements = append(placements, fidelityPlacement{name: d.Name, req: req, consumes: consumes})
		}
	}
	require.Len(t, sets, 1, "one counter set per GPU")
	return capacity, placements
}

// walkLayouts is the depth-first search. It returns the number of layouts
// visited and the number of create decisions compared.
func walkLayouts(t *testing.T, m *sim.Machine, capacity map[string]int64, placements []fidelityPlacement) (states, checks int) {
	t.Helper()
	ctx := context.Background()
	used := map[string]int64{}
	fits := func(p fidelityPlacement) bool {
		for name, v := range p.consumes {
			if used[name]+v > capacity[name] {
				return false
			}
		}
		return true
	}
	add := func(p fidelityPlacement, sign int64) {
		for name, v := range p.consumes {
			used[name] += sign * v
		}
	}

	var layout []string
	var walk func(from int) bool
	walk = func(from int) bool {
		states++
		for i := from; i < len(placements); i++ {
			p := placements[i]
			countersSay := fits(p)
			dev, err := m.CreateMigDevice(ctx, p.req)
			checks++
			if err != nil && !errors.Is(err, nvdevice.ErrInsufficientResources) {
				t.Errorf("layout %v, creating %s: unexpected error %v", layout, p.name, err)
				return false
			}
			if countersSay != (err == nil) {
				t.Errorf("layout %v, adding %s: counters say %v, the hardware says %v (%v)", layout, p.name, countersSay, err == nil, err)
				return false
			}
			if err != nil {
				continue
			}
			add(p, 1)
			layout = append(layout, p.name)
			ok := walk(i + 1)
			layout = layout[:len(layout)-1]
			add(p, -1)
			if err := m.DeleteMigDevice(ctx, nvdevice.MigDeviceRef{
				ParentUUID: p.req.ParentUUID, GPUInstanceID: dev.GPUInstanceID, ComputeInstanceID: dev.ComputeInstanceID, UUID: dev.UUID,
			}); err != nil {
				t.Errorf("delete %s: %v", p.name, err)
				return false
			}
			if !ok {
				return false
			}
		}
		return true
	}
	walk(0)
	return states, checks
}
