package sim

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

func next(t *testing.T, ch <-chan nvdevice.HealthEvent) nvdevice.HealthEvent {
	t.Helper()
	select {
	case ev, ok := <-ch:
		require.True(t, ok, "channel closed")
		return ev
	case <-time.After(5 * time.Second):
		t.Fatal("no health event")
		return nvdevice.HealthEvent{}
	}
}

func TestHealthFaults(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	m, err := NewBuiltin("dgx-h100", "n")
	require.NoError(t, err)
	gpu := inventory(t, m).GPUs[2].UUID

	w1, err := m.WatchHealth(ctx)
	require.NoError(t, err)
	w2, err := m.WatchHealth(ctx)
	require.NoError(t, err)

	require.NoError(t, m.InjectXID(gpu, "", 79))
	require.NoError(t, m.InjectXID(gpu, "", 13))
	for _, w := range []<-chan nvdevice.HealthEvent{w1, w2} {
		ev := next(t, w)
		assert.Equal(t, nvdevice.HealthXID, ev.Kind)
		assert.Equal(t, uint64(79), ev.XID)
		assert.True(t, ev.Critical(), "XID 79 (fallen off the bus) is critical")
		ev = next(t, w)
		assert.False(t, ev.Critical(), "XID 13 is an application error")
	}

	require.NoError(t, m.LoseGPU(gpu))
	ev := next(t, w1)
	assert.Equal(t, nvdevice.HealthGPULost, ev.Kind)
	assert.True(t, ev.Critical())
	inv := inventory(t, m)
	assert.Len(t, inv.GPUs, 7, "a lost GPU vanishes from the inventory")
	_, err = m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: gpu, Profile: "1g.10gb", Start: 0})
	require.ErrorIs(t, err, nvdevice.ErrGPULost)

	require.NoError(t, m.RecoverGPU(gpu))
	assert.Equal(t, nvdevice.HealthRecovered, next(t, w1).Kind)
	assert.Len(t, inventory(t, m).GPUs, 8)

	cancel()
	require.Eventually(t, func() bool {
		_, ok := <-w2
		for ok {
			_, ok = <-w2
		}
		return true
	}, 5*time.Second, 10*time.Millisecond, "channel closes when ctx ends")
}
