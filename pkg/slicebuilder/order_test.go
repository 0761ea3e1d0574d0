package slicebuilder

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestDeviceOrder pins the order kube-scheduler's allocator meets a node's
// devices in (allocatorOrder): it evaluates CEL on every device it meets
// before the first that fits, so the order sets the cost of every pod on
// every node it filters.
func TestDeviceOrder(t *testing.T) {
	// An all-balanced DGX H100 under the existing policy (issue 50's default
	// mix): two 1g.10gb, a 2g.20gb and a 3g.40gb on each GPU.
	layout := "name: balanced\ngpuCount: 8\nnvlink: nvswitch\nmigEnabled: all\nmigDevices:\n"
	for g := range 8 {
		for _, d := range []string{"profile: 1g.10gb, start: 0", "profile: 1g.10gb, start: 1", "profile: 2g.20gb, start: 2", "profile: 3g.40gb, start: 4"} {
			layout += fmt.Sprintf("- {gpu: %d, %s}\n", g, d)
		}
	}
	_, balanced := machine(t, layout, "node-a")
	_, dgx := machine(t, "dgx-h100", "node-a")

	t.Run("existing MIG devices, GPU by GPU", func(t *testing.T) {
		devices := allDevices(build(t, balanced, "node-a", Options{Mig: MigPolicy{Existing: true}}))
		require.Len(t, devices, 32)
		var gpus []string
		for _, d := range devices {
			gpus = append(gpus, strings.SplitN(d.Name, "-mig-", 2)[0])
		}
		for i := 1; i < len(gpus); i++ {
			assert.LessOrEqual(t, gpus[i-1], gpus[i], "device %d (%s) of an earlier GPU after one of a later", i, devices[i].Name)
		}
		// A claim for any profile meets at most the three other devices
		// of the first GPU before one of its own: grouped by profile, a
		// 3g.40gb claim met 24 (issue 50).
		first := map[string]int{}
		for i, d := range devices {
			p := *d.Attributes["migProfile"].StringValue
			if _, seen := first[p]; !seen {
				first[p] = i
			}
		}
		assert.Equal(t, map[string]int{"1g.10gb": 0, "2g.20gb": 2, "3g.40gb": 3}, first)
	})

	t.Run("placements drawn from counters, grouped by profile", func(t *testing.T) {
		devices := allDevices(build(t, dgx, "node-a", Options{}))
		// Whole GPUs first, then each profile's placements across GPUs:
		// a profile once left is never met again.
		var profiles []string
		for i, d := range devices {
			a := d.Attributes["migProfile"]
			if a.StringValue == nil {
				assert.Empty(t, profiles, "whole GPU %s after MIG placements", d.Name)
				continue
			}
			assert.Len(t, d.ConsumesCounters, 1, "device %d (%s) draws on its GPU's counters", i, d.Name)
			if len(profiles) == 0 || profiles[len(profiles)-1] != *a.StringValue {
				assert.NotContains(t, profiles, *a.StringValue, "profile %s met again at device %d", *a.StringValue, i)
				profiles = append(profiles, *a.StringValue)
			}
		}
		assert.Greater(t, len(profiles), 3)
	})
}
