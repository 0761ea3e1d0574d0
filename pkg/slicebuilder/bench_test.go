package slicebuilder

import "testing"

// BenchmarkBuildDGXH100 is the cost of one republish of a DGX H100 node's
// slices (208 devices, 8 counter sets), which the plugin pays on every
// inventory or health change.
func BenchmarkBuildDGXH100(b *testing.B) {
	_, inv := machine(b, "dgx-h100", "node-a")
	b.ReportAllocs()
	for b.Loop() {
		res, err := Build(inv, "node-a", Options{})
		if err != nil {
			b.Fatal(err)
		}
		_ = ResourceSlices(res, "node-a")
	}
}
