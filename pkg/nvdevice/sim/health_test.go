package sim

import (
	"context"
	"errors"
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

	require.NoError(t, m.InjectXID(gpu, "", 94))
	require.NoError(t, m.InjectXID(gpu, "", 13))
	for _, w := range []<-chan nvdevice.HealthEvent{w1, w2} {
		ev := next(t, w)
		assert.Equal(t, nvdevice.HealthXID, ev.Kind)
		assert.Equal(t, uint64(94), ev.XID)
		assert.True(t, nvdevice.DefaultXIDPolicy.Critical(ev), "XID 94 (contained ECC error) is critical")
		ev = next(t, w)
		assert.False(t, nvdevice.DefaultXIDPolicy.Critical(ev), "XID 13 is an application error")
	}

	require.NoError(t, m.LoseGPU(gpu))
	ev := next(t, w1)
	assert.Equal(t, nvdevice.HealthGPULost, ev.Kind)
	assert.True(t, nvdevice.DefaultXIDPolicy.Critical(ev))
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

// quiet says nothing was published on w before a marker: an application
// XID injected now must be the next event.
func quiet(t *testing.T, m *Machine, w <-chan nvdevice.HealthEvent, gpu string) {
	t.Helper()
	require.NoError(t, m.InjectXID(gpu, "", 13))
	ev := next(t, w)
	require.Equal(t, nvdevice.HealthXID, ev.Kind, "nothing before the marker, got %+v", ev)
	require.Equal(t, uint64(13), ev.XID, "nothing before the marker, got %+v", ev)
}

func TestRecoveryFollowsWhatTheXIDNeeds(t *testing.T) {
	for _, tc := range []struct {
		name string
		// fault makes the GPU unhealthy with events events.
		fault  func(m *Machine, gpu string) error
		events int
		// recoverErr and resetErr are what RecoverGPU and ResetGPU say
		// right after the fault (nil: the GPU recovers there).
		recoverErr, resetErr error
		// quietRecovers: the GPU recovers by itself after the quiet period.
		quietRecovers bool
	}{
		{name: "XID 95 (uncontained ECC) needs a reset", fault: func(m *Machine, g string) error { return m.InjectXID(g, "", 95) },
			events: 1, recoverErr: ErrResetRequired},
		{name: "XID 48 (double-bit ECC) needs a reset", fault: func(m *Machine, g string) error { return m.InjectXID(g, "", 48) },
			events: 1, recoverErr: ErrResetRequired},
		{name: "XID 79 (fallen off the bus) needs a reboot", fault: func(m *Machine, g string) error { return m.InjectXID(g, "", 79) },
			events: 1, recoverErr: ErrRebootRequired, resetErr: ErrRebootRequired},
		{name: "XID 94 (contained ECC) clears once quiet", fault: func(m *Machine, g string) error { return m.InjectXID(g, "", 94) },
			events: 1, quietRecovers: true},
		{name: "a reset XID outweighs a later one that needs none", fault: func(m *Machine, g string) error {
			return errors.Join(m.InjectXID(g, "", 119), m.InjectXID(g, "", 94))
		}, events: 2, recoverErr: ErrResetRequired},
		{name: "a lost GPU that had a reset XID comes back reinitialised", fault: func(m *Machine, g string) error {
			return errors.Join(m.InjectXID(g, "", 48), m.LoseGPU(g))
		}, events: 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			m, err := NewBuiltin("dgx-h100", "n")
			require.NoError(t, err)
			m.SetRecoveryQuietPeriod(50 * time.Millisecond)
			gpu := inventory(t, m).GPUs[3].UUID
			w, err := m.WatchHealth(ctx)
			require.NoError(t, err)
			require.NoError(t, tc.fault(m, gpu))
			for range tc.events {
				require.NotEqual(t, nvdevice.HealthRecovered, next(t, w).Kind)
			}

			if tc.quietRecovers {
				start := time.Now()
				ev := next(t, w)
				assert.Equal(t, nvdevice.HealthRecovered, ev.Kind)
				assert.GreaterOrEqual(t, time.Since(start), 40*time.Millisecond, "not before the quiet period")
				return
			}
			time.Sleep(150 * time.Millisecond) // three quiet periods
			if tc.recoverErr == nil {
				require.NoError(t, m.RecoverGPU(gpu))
				assert.Equal(t, nvdevice.HealthRecovered, next(t, w).Kind)
				return
			}
			quiet(t, m, w, gpu) // no recovery while waiting
			require.ErrorIs(t, m.RecoverGPU(gpu), tc.recoverErr)
			quiet(t, m, w, gpu) // none from a refused RecoverGPU either
			if tc.resetErr != nil {
				require.ErrorIs(t, m.ResetGPU(gpu), tc.resetErr)
				quiet(t, m, w, gpu)
				return
			}
			require.NoError(t, m.ResetGPU(gpu))
			ev := next(t, w)
			assert.Equal(t, nvdevice.HealthRecovered, ev.Kind)
			assert.Equal(t, gpu, ev.GPUUUID)
			require.NoError(t, m.RecoverGPU(gpu), "nothing left to refuse after the reset")
		})
	}
}

func TestALaterFaultPostponesTheQuietRecovery(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	m, err := NewBuiltin("dgx-h100", "n")
	require.NoError(t, err)
	m.SetRecoveryQuietPeriod(200 * time.Millisecond)
	gpu := inventory(t, m).GPUs[0].UUID
	w, err := m.WatchHealth(ctx)
	require.NoError(t, err)
	require.NoError(t, m.InjectXID(gpu, "", 94))
	next(t, w)
	time.Sleep(120 * time.Millisecond)
	second := time.Now()
	require.NoError(t, m.InjectXID(gpu, "", 92))
	next(t, w)
	ev := next(t, w)
	assert.Equal(t, nvdevice.HealthRecovered, ev.Kind)
	assert.GreaterOrEqual(t, time.Since(second), 190*time.Millisecond, "the quiet period counts from the last fault")
}

func TestResetOfAHealthyGPUPublishesNothing(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	m, err := NewBuiltin("dgx-h100", "n")
	require.NoError(t, err)
	gpu := inventory(t, m).GPUs[0].UUID
	w, err := m.WatchHealth(ctx)
	require.NoError(t, err)
	require.NoError(t, m.ResetGPU(gpu))
	quiet(t, m, w, gpu)
	require.Error(t, m.ResetGPU("GPU-nope"))
}

// A plugin that restarts hands the machine the faults it remembers: they
// still need what they needed.
func TestTrackUnhealthy(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	m, err := NewBuiltin("dgx-h100", "n")
	require.NoError(t, err)
	m.SetRecoveryQuietPeriod(50 * time.Millisecond)
	inv := inventory(t, m)
	reset, lost, app := inv.GPUs[1].UUID, inv.GPUs[2].UUID, inv.GPUs[3].UUID
	w, err := m.WatchHealth(ctx)
	require.NoError(t, err)
	require.NoError(t, m.TrackUnhealthy(nvdevice.HealthEvent{Kind: nvdevice.HealthXID, GPUUUID: reset, XID: 95, Time: time.Now().Add(-time.Hour)}))
	require.NoError(t, m.TrackUnhealthy(nvdevice.HealthEvent{Kind: nvdevice.HealthXID, GPUUUID: reset, XID: 13}), "needs less than the XID 95 it has")
	require.NoError(t, m.TrackUnhealthy(nvdevice.HealthEvent{Kind: nvdevice.HealthGPULost, GPUUUID: lost, Time: time.Now()}))
	// An XID the default policy ignores, counted by the plugin's: tracked
	// like any fault that needs no reset.
	require.NoError(t, m.TrackUnhealthy(nvdevice.HealthEvent{Kind: nvdevice.HealthXID, GPUUUID: app, XID: 13, Time: time.Now()}))
	require.NoError(t, m.TrackUnhealthy(nvdevice.HealthEvent{Kind: nvdevice.HealthRecovered, GPUUUID: reset}), "a recovery is no fault: ignored")
	require.Error(t, m.TrackUnhealthy(nvdevice.HealthEvent{Kind: nvdevice.HealthXID, GPUUUID: "GPU-nope", XID: 48}))

	recovered := map[string]bool{}
	for range 2 {
		ev := next(t, w)
		assert.Equal(t, nvdevice.HealthRecovered, ev.Kind, "it answers: it recovers after the quiet period, nothing is published again")
		recovered[ev.GPUUUID] = true
	}
	assert.Equal(t, map[string]bool{lost: true, app: true}, recovered)
	require.ErrorIs(t, m.RecoverGPU(reset), ErrResetRequired)
	require.NoError(t, m.ResetGPU(reset))
	ev := next(t, w)
	assert.Equal(t, nvdevice.HealthRecovered, ev.Kind)
	assert.Equal(t, reset, ev.GPUUUID)
}
