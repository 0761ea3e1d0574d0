package sim

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// TestHostCapMinorsMatchTheFile: the simulator's Host gives, without a
// file, the minors a real node's backend reads from the mig-minors file
// WriteMigMinors writes; and neither knows a GPU or an instance the driver
// would not list.
func TestHostCapMinorsMatchTheFile(t *testing.T) {
	m, err := NewBuiltin("dgx-h100", "node-a")
	require.NoError(t, err)
	host, err := m.Host(context.Background())
	require.NoError(t, err)
	path := filepath.Join(t.TempDir(), "mig-minors")
	var buf bytes.Buffer
	require.NoError(t, WriteMigMinors(&buf, m.Spec().GPUCount))
	require.NoError(t, os.WriteFile(path, buf.Bytes(), 0o600))
	fromFile := nvdevice.MigMinorsFromFile(path)

	seen := map[int]string{}
	for gpu := -1; gpu <= m.Spec().GPUCount; gpu++ {
		for gi := -1; gi <= migGIs; gi++ {
			for ci := -1; ci <= migCIs; ci++ {
				at := fmt.Sprintf("gpu%d/gi%d/ci%d", gpu, gi, ci)
				giHost, ciHost, errHost := host.CapMinors(gpu, gi, ci)
				giFile, ciFile, errFile := fromFile(gpu, gi, ci)
				if errFile != nil {
					require.ErrorIs(t, errHost, nvdevice.ErrNotFound, at)
					continue
				}
				require.NoError(t, errHost, at)
				require.Equal(t, [2]int{giFile, ciFile}, [2]int{giHost, ciHost}, at)
				if prev, dup := seen[ciHost]; dup {
					t.Fatalf("%s: compute-instance minor %d is also %s's", at, ciHost, prev)
				}
				seen[ciHost] = at
			}
		}
	}
	assert.Len(t, seen, m.Spec().GPUCount*migGIs*migCIs, "every GPU and instance the file lists has its own minor")
}

func TestWriteMigMinorsLayout(t *testing.T) {
	var buf bytes.Buffer
	require.NoError(t, WriteMigMinors(&buf, 2))
	minors, err := nvdevice.ParseMigMinors(&buf)
	require.NoError(t, err)
	assert.Len(t, minors, 2+2*minorsPerGPU)
	for key, want := range map[string]int{
		"config": 1, "monitor": 2,
		"gpu0/gi0/access": 3, "gpu0/gi0/ci0/access": 4, "gpu0/gi0/ci7/access": 11,
		"gpu0/gi1/access": 12, "gpu0/gi14/ci7/access": 137,
		"gpu1/gi0/access": 138, "gpu1/gi14/ci7/access": 272,
	} {
		assert.Equal(t, want, minors[key], key)
	}
}
