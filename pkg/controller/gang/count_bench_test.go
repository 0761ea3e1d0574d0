package gang

import (
	"context"
	"fmt"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"

	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// BenchmarkCountByClass1000MigNodes is the controller's per-class device
// count (every 15 s, for gpudra_class_devices) over 1,000 DGX H100 nodes in
// MIG mode (208 devices each) and the chart's two CEL classes: evaluating
// every class on every device each time, and with the matches remembered
// between counts (nothing changed since the last one).
func BenchmarkCountByClass1000MigNodes(b *testing.B) {
	ctx := context.Background()
	slices, classes := migFleet(b)
	for _, remembered := range []bool{false, true} {
		b.Run(fmt.Sprintf("remembered=%t", remembered), func(b *testing.B) {
			cache := cel.NewCache(10, cel.Features{})
			known := newClassMatches()
			if remembered {
				countByClass(ctx, cache, classes, slices, nil, sets.New[string](), known) // the first count evaluates
			}
			b.ResetTimer()
			for b.Loop() {
				k := known
				if !remembered {
					k = nil
				}
				countByClass(ctx, cache, classes, slices, nil, sets.New[string](), k)
			}
		})
	}
}

// BenchmarkClassCounter1000MigNodes is what the counts kept from events
// cost over the same 1,000 MIG-mode nodes: the informers' first sync (every
// slice evaluated once per class), then one claim allocating a 1g.10gb and
// released again (two events: the MIG device and its GPU's 25 others change
// state), a node moved to another pool (its 208 devices recounted), and the
// gauges' read. The nodes are in 10 pools (karpenter.sh/nodepool).
func BenchmarkClassCounter1000MigNodes(b *testing.B) {
	ctx := context.Background()
	slices, classes := migFleet(b)
	sync := func() *classCounter {
		c := newClassCounter(cel.NewCache(10, cel.Features{}), DefaultNodePoolLabels...)
		for _, cl := range classes {
			c.upsertClass(ctx, cl)
		}
		for n := range 1000 {
			c.upsertNode(poolNode(fmt.Sprintf("node-%04d", n), fmt.Sprintf("pool-%d", n%10)))
		}
		for _, s := range slices {
			c.upsertSlice(ctx, s)
		}
		return c
	}
	b.Run("first-sync", func(b *testing.B) {
		for b.Loop() {
			sync()
		}
	})
	c := sync()
	claim := allocatedClaim("c", "gpu-3-mig-1g-10gb-6")
	claim.Status.Allocation.Devices.Results[0].Pool = "node-0500"
	released := claim.DeepCopy()
	released.Status.Allocation = nil
	b.Run("claim-allocated-and-released", func(b *testing.B) {
		for b.Loop() {
			c.upsertClaim(claim)
			c.upsertClaim(released)
		}
	})
	b.Run("node-relabelled", func(b *testing.B) {
		for i := 0; b.Loop(); i++ {
			c.upsertNode(poolNode("node-0500", fmt.Sprintf("pool-%d", i%2)))
		}
	})
	c.upsertClaim(claim)
	if got := c.snapshot()["gpu.gpudra.dev"]; got.allocated != 1 {
		b.Fatalf("the GPU of the allocated MIG device counts as allocated: %+v", got)
	}
	b.Run("read", func(b *testing.B) {
		for b.Loop() {
			c.snapshotByPool()
		}
	})
}

// migFleet is 1,000 DGX H100 nodes in MIG mode with every placement
// published (208 devices each, as pkg/slicebuilder builds them), and the
// chart's two CEL classes.
func migFleet(b *testing.B) ([]*resourceapi.ResourceSlice, []*resourceapi.DeviceClass) {
	template := nodeSlices(b, "dgx-h100", "node-a", slicebuilder.Options{})
	var slices []*resourceapi.ResourceSlice
	for n := range 1000 {
		for i := range template {
			s := template[i].DeepCopy()
			s.UID, s.ResourceVersion = types.UID(fmt.Sprintf("n%d-%d", n, i)), "1"
			s.Spec.Pool.Name = fmt.Sprintf("node-%04d", n)
			s.Spec.NodeName = &s.Spec.Pool.Name
			slices = append(slices, s)
		}
	}
	return slices, []*resourceapi.DeviceClass{
		celClass("gpu.gpudra.dev", `device.driver == "gpu.gpudra.dev" && device.attributes["gpu.gpudra.dev"].type == "gpu"`),
		celClass("mig.gpudra.dev", `device.driver == "gpu.gpudra.dev" && device.attributes["gpu.gpudra.dev"].type == "mig"`),
	}
}
