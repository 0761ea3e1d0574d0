package sim

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestFailInventory(t *testing.T) {
	for _, tc := range []struct {
		name  string
		n     int
		reads int
		want  []bool // per read: fails
	}{
		{name: "none", n: 0, reads: 2, want: []bool{false, false}},
		{name: "once", n: 1, reads: 3, want: []bool{true, false, false}},
		{name: "twice", n: 2, reads: 3, want: []bool{true, true, false}},
		{name: "until cleared", n: -1, reads: 4, want: []bool{true, true, true, true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := NewBuiltin("dgx-h100", "n")
			require.NoError(t, err)
			m.FailInventory(tc.n)
			failed := 0
			for i := range tc.reads {
				inv, err := m.Inventory(context.Background())
				if tc.want[i] {
					require.ErrorIs(t, err, ErrInjectedRead, "read %d", i)
					failed++
					continue
				}
				require.NoError(t, err, "read %d", i)
				assert.Len(t, inv.GPUs, 8)
			}
			assert.Equal(t, failed, m.InventoryFailures())
			m.FailInventory(0)
			_, err = m.Inventory(context.Background())
			assert.NoError(t, err, "cleared")
		})
	}
}
