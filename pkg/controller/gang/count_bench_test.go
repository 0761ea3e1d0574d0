package gang

import (
	"context"
	"fmt"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"

	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// BenchmarkCountByClass1000MigNodes is the controller's per-class device
// count (every 15 s, for gpudra_class_devices) over 1,000 DGX H100 nodes in
// MIG mode (208 devices each) and the chart's two CEL classes: evaluating
// every class on every device each time, and with the matches remembered
// between counts (nothing changed since the last one).
func BenchmarkCountByClass1000MigNodes(b *testing.B) {
	ctx := context.Background()
	m, err := sim.NewBuiltin("dgx-h100", "node-a")
	if err != nil {
		b.Fatal(err)
	}
	inv, err := m.Inventory(ctx)
	if err != nil {
		b.Fatal(err)
	}
	res, err := slicebuilder.Build(inv, "node-a", slicebuilder.Options{})
	if err != nil {
		b.Fatal(err)
	}
	template := slicebuilder.ResourceSlices(res, "node-a")
	var slices []*resourceapi.ResourceSlice
	for n := range 1000 {
		for i := range template {
			s := template[i].DeepCopy()
			s.UID, s.ResourceVersion = types.UID(fmt.Sprintf("n%d-%d", n, i)), "1"
			s.Spec.Pool.Name = fmt.Sprintf("node-%04d", n)
			slices = append(slices, s)
		}
	}
	class := func(name, typ string) *resourceapi.DeviceClass {
		return &resourceapi.DeviceClass{ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID(name), ResourceVersion: "1"}, Spec: resourceapi.DeviceClassSpec{
			Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
				Expression: fmt.Sprintf(`device.driver == "gpu.gpudra.dev" && device.attributes["gpu.gpudra.dev"].type == %q`, typ)}}}}}
	}
	classes := []*resourceapi.DeviceClass{class("gpu.gpudra.dev", "gpu"), class("mig.gpudra.dev", "mig")}
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
