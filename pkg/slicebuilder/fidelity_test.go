package slicebuilder

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// TestCountersAgreeWithHardwareRules walks every MIG layout reachable on one
// H100 and checks, at each step, that the published counters allow exactly
// the MIG devices the (simulated) hardware lets us create.
func TestCountersAgreeWithHardwareRules(t *testing.T) {
	ctx := context.Background()
	m, inv := machine(t, oneGPUMig, "n")
	gpu := inv.GPUs[0].UUID
	slices := build(t, inv, "n", Options{})
	var counters map[string]resourceapi.Counter
	var migs []resourceapi.Device
	for _, s := range slices {
		for _, cs := range s.Spec.SharedCounters {
			counters = cs.Counters
		}
		for _, d := range s.Spec.Devices {
			if strAttr(d, "type") == TypeMIG {
				migs = append(migs, d)
			}
		}
	}
	require.Len(t, migs, 25)

	fits := func(state []int) bool {
		used := map[string]resource.Quantity{}
		for _, i := range state {
			for name, c := range migs[i].ConsumesCounters[0].Counters {
				q := used[name]
				q.Add(c.Value)
				used[name] = q
			}
		}
		for name, q := range used {
			if q.Cmp(counters[name].Value) > 0 {
				return false
			}
		}
		return true
	}
	placement := func(d resourceapi.Device) nvdevice.MigCreateRequest {
		// Names end in the placement start; the profile is an attribute.
		start := int(d.Name[len(d.Name)-1] - '0')
		return nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: strAttr(d, "migProfile"), Start: start}
	}

	states := 0
	var walk func(state []int, from int)
	walk = func(state []int, from int) {
		states++
		for i := from; i < len(migs); i++ {
			next := append(append([]int(nil), state...), i)
			want := fits(next)
			dev, err := m.CreateMigDevice(ctx, placement(migs[i]))
			if err != nil && !errors.Is(err, nvdevice.ErrInsufficientResources) {
				t.Fatalf("unexpected error creating %s: %v", migs[i].Name, err)
			}
			if want != (err == nil) {
				t.Fatalf("after %v adding %s: counters say %v, hardware says %v (%v)", names(migs, state), migs[i].Name, want, err == nil, err)
			}
			if err != nil {
				continue
			}
			walk(next, i+1)
			require.NoError(t, m.DeleteMigDevice(ctx, nvdevice.MigDeviceRef{ParentUUID: gpu, GPUInstanceID: dev.GPUInstanceID, ComputeInstanceID: dev.ComputeInstanceID}))
		}
	}
	walk(nil, 0)
	t.Logf("checked %d MIG layouts", states)
	require.Greater(t, states, 100)
}

func names(devs []resourceapi.Device, idx []int) []string {
	var out []string
	for _, i := range idx {
		out = append(out, devs[i].Name)
	}
	return out
}
