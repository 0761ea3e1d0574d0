package sim

import (
	"context"
	"testing"
)

// BenchmarkInventoryDGXH100 is the cost of one read of a simulated DGX
// H100: a copy of every GPU for the caller (Inventory), and the shared
// snapshot a prepare reads (InventorySnapshot, issue 50).
func BenchmarkInventoryDGXH100(b *testing.B) {
	for name, read := range map[string]func(*Machine) error{
		"copy":     func(m *Machine) error { _, err := m.Inventory(context.Background()); return err },
		"snapshot": func(m *Machine) error { _, err := m.InventorySnapshot(context.Background()); return err },
	} {
		b.Run(name, func(b *testing.B) {
			m, err := NewBuiltin("dgx-h100", "node-a")
			if err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			for b.Loop() {
				if err := read(m); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
