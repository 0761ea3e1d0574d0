package sim

import (
	"context"
	"testing"
)

// BenchmarkInventoryDGXH100 is the cost of one snapshot of a simulated DGX H100.
func BenchmarkInventoryDGXH100(b *testing.B) {
	m, err := NewBuiltin("dgx-h100", "node-a")
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := m.Inventory(context.Background()); err != nil {
			b.Fatal(err)
		}
	}
}
