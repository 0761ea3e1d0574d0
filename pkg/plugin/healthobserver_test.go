package plugin

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// recordingObserver keeps what the health watch told it.
type recordingObserver struct {
	mu        sync.Mutex
	xids      []uint64
	unhealthy []string
	calls     int // SetUnhealthy calls
}

func (o *recordingObserver) XID(_ string, xid uint64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.xids = append(o.xids, xid)
}

func (o *recordingObserver) SetUnhealthy(uuids []string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.unhealthy, o.calls = slices.Clone(uuids), o.calls+1
}

func (o *recordingObserver) get() ([]uint64, []string, int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return slices.Clone(o.xids), slices.Clone(o.unhealthy), o.calls
}

func TestHealthWatchFeedsTheObserver(t *testing.T) {
	e := newEnv(t)
	obs := &recordingObserver{}
	d := &Driver{state: e.start(), backend: e.machine, pool: pool, healthObs: obs}
	d.publish = func(context.Context) error { return nil }
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	d.startRepublishing(ctx)
	require.NoError(t, d.watchHealth(ctx))
	_, unhealthy, calls := obs.get()
	assert.Equal(t, 1, calls, "told the unhealthy GPUs at the watch's start")
	assert.Empty(t, unhealthy)
	bad := inventory(t, e.machine).GPUs[1].UUID
	for _, step := range []struct {
		name          string
		act           func() error
		wantXIDs      []uint64
		wantUnhealthy []string
	}{
		{"an application XID is counted, the GPU stays healthy", func() error { return e.machine.InjectXID(bad, "", 13) }, []uint64{13}, nil},
		{"a critical XID is counted and makes the GPU unhealthy", func() error { return e.machine.InjectXID(bad, "", 95) }, []uint64{13, 95}, []string{bad}},
		{"a reset makes it healthy again", func() error { return e.machine.ResetGPU(bad) }, []uint64{13, 95}, nil},
	} {
		require.NoError(t, step.act(), step.name)
		require.Eventually(t, func() bool {
			xids, unhealthy, _ := obs.get()
			return slices.Equal(step.wantXIDs, xids) && slices.Equal(step.wantUnhealthy, unhealthy)
		}, 5*time.Second, 5*time.Millisecond, step.name)
	}
}
