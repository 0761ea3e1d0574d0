//go:build cgo && linux

package nvml

import (
	"context"
	"encoding/binary"
	"sync/atomic"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// recoveryFake extends a fake GPU with what the recovery checks read: its
// recovery action field, and whether it answers. The test changes them
// while the event loop reads them.
type recoveryFake struct {
	// action is the recovery action the driver reports; fieldRet is the
	// field's own return (NOT_SUPPORTED: a driver without the field).
	action   atomic.Int32
	fieldRet atomic.Int32
	// memRet is what reading the GPU's memory returns (GPU_IS_LOST).
	memRet atomic.Int32
}

func withRecovery(g *fakeGPU) *recoveryFake {
	r := &recoveryFake{}
	g.GetFieldValuesFunc = func(values []nvml.FieldValue) nvml.Return {
		for i := range values {
			if values[i].FieldId != nvml.FI_DEV_GET_GPU_RECOVERY_ACTION {
				values[i].NvmlReturn = uint32(nvml.ERROR_NOT_SUPPORTED)
				continue
			}
			values[i].NvmlReturn = uint32(r.fieldRet.Load())
			values[i].ValueType = uint32(nvml.VALUE_TYPE_UNSIGNED_INT)
			binary.NativeEndian.PutUint32(values[i].Value[:4], uint32(r.action.Load()))
		}
		return nvml.SUCCESS
	}
	g.GetMemoryInfoFunc = func() (nvml.Memory, nvml.Return) {
		if ret := nvml.Return(r.memRet.Load()); ret != nvml.SUCCESS {
			return nvml.Memory{}, ret
		}
		return nvml.Memory{Total: 81559 << 20}, nvml.SUCCESS
	}
	return r
}

func (r *recoveryFake) setAction(a nvml.DeviceGpuRecoveryAction) { r.action.Store(int32(a)) }
func (r *recoveryFake) unsupported()                             { r.fieldRet.Store(int32(nvml.ERROR_NOT_SUPPORTED)) }
func (r *recoveryFake) lose()                                    { r.memRet.Store(int32(nvml.ERROR_GPU_IS_LOST)) }
func (r *recoveryFake) answer()                                  { r.memRet.Store(int32(nvml.SUCCESS)) }

func xidEvent(uuid string, xid uint64, at time.Time) nvdevice.HealthEvent {
	return nvdevice.HealthEvent{Kind: nvdevice.HealthXID, GPUUUID: uuid, XID: xid, Time: at}
}

// TestRecoveryCheck drives the check with a clock of its own: one GPU, one
// fault, then a list of steps, each a change to the GPU and what the check
// at that time must say.
func TestRecoveryCheck(t *testing.T) {
	const quiet = time.Minute
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	type step struct {
		after  time.Duration // since the fault
		change func(r *recoveryFake)
		want   bool // recovered at this check
	}
	none := func(r *recoveryFake) { r.setAction(nvml.GPU_RECOVERY_ACTION_NONE) }
	for _, tc := range []struct {
		name  string
		fault nvdevice.HealthEvent
		setup func(r *recoveryFake)
		steps []step
	}{
		{name: "recovery action GPU_RESET keeps it unhealthy, NONE recovers it", fault: xidEvent("GPU-0", 95, t0),
			setup: func(r *recoveryFake) { r.setAction(nvml.GPU_RECOVERY_ACTION_GPU_RESET) },
			steps: []step{{after: quiet}, {after: time.Hour}, {after: time.Hour, change: none, want: true}}},
		{name: "the driver's NONE outweighs the XID table", fault: xidEvent("GPU-0", 48, t0),
			steps: []step{{after: quiet, want: true}}},
		{name: "not before the quiet period, even with NONE", fault: xidEvent("GPU-0", 94, t0),
			steps: []step{{after: quiet / 2}, {after: quiet - time.Second}, {after: quiet, want: true}}},
		{name: "drain P2P keeps it unhealthy", fault: xidEvent("GPU-0", 74, t0),
			setup: func(r *recoveryFake) { r.setAction(nvml.GPU_RECOVERY_ACTION_DRAIN_P2P) },
			steps: []step{{after: time.Hour}, {after: 2 * time.Hour, change: none, want: true}}},
		{name: "node reboot keeps it unhealthy", fault: xidEvent("GPU-0", 79, t0),
			setup: func(r *recoveryFake) { r.setAction(nvml.GPU_RECOVERY_ACTION_NODE_REBOOT) },
			steps: []step{{after: time.Hour}, {after: 24 * time.Hour}}},
		{name: "no field: an XID that needs no reset recovers once quiet", fault: xidEvent("GPU-0", 94, t0),
			setup: (*recoveryFake).unsupported,
			steps: []step{{after: quiet / 2}, {after: quiet, want: true}}},
		{name: "no field: a reset XID stays while the GPU just answers, recovers after it was gone", fault: xidEvent("GPU-0", 95, t0),
			setup: (*recoveryFake).unsupported,
			steps: []step{
				{after: quiet}, {after: time.Hour},
				{after: time.Hour + time.Second, change: (*recoveryFake).lose},
				{after: time.Hour + 2*time.Second, change: (*recoveryFake).answer, want: true},
			}},
		{name: "no field (an older driver's per-field answer): a reset XID stays", fault: xidEvent("GPU-0", 119, t0),
			setup: func(r *recoveryFake) { r.fieldRet.Store(int32(nvml.ERROR_INVALID_ARGUMENT)) },
			steps: []step{{after: time.Hour}}},
		{name: "no field: a reboot XID never recovers, not even after the GPU was gone", fault: xidEvent("GPU-0", 79, t0),
			setup: (*recoveryFake).unsupported,
			steps: []step{{after: time.Hour, change: (*recoveryFake).lose}, {after: 2 * time.Hour, change: (*recoveryFake).answer}}},
		{name: "a lost GPU that answers again recovers", fault: nvdevice.HealthEvent{Kind: nvdevice.HealthGPULost, GPUUUID: "GPU-0", Time: t0},
			setup: func(r *recoveryFake) { r.unsupported(); r.lose() },
			steps: []step{{after: quiet}, {after: time.Hour}, {after: time.Hour + time.Second, change: (*recoveryFake).answer, want: true}}},
		{name: "a lost GPU that answers again recovers (field: NONE)", fault: nvdevice.HealthEvent{Kind: nvdevice.HealthGPULost, GPUUUID: "GPU-0", Time: t0},
			setup: (*recoveryFake).lose,
			steps: []step{{after: time.Hour}, {after: time.Hour + time.Second, change: (*recoveryFake).answer, want: true}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gpus := board(1, nvml.DEVICE_MIG_DISABLE)
			r := withRecovery(gpus[0])
			if tc.setup != nil {
				tc.setup(r)
			}
			tr := newRecoveryTracker(recoveryPolicy{Interval: time.Second, Quiet: quiet})
			tr.track(tc.fault)
			lib := fakeLib(gpus)
			for i, s := range tc.steps {
				if s.change != nil {
					s.change(r)
				}
				got := tr.check(context.Background(), lib, t0.Add(s.after))
				if !s.want {
					require.Empty(t, got, "step %d (%s after the fault)", i, s.after)
					continue
				}
				require.Len(t, got, 1, "step %d (%s after the fault)", i, s.after)
				assert.Equal(t, nvdevice.HealthRecovered, got[0].Kind)
				assert.Equal(t, "GPU-0", got[0].GPUUUID)
				assert.NotEmpty(t, got[0].Message)
				assert.Empty(t, tr.check(context.Background(), lib, t0.Add(s.after+time.Hour)), "reported once, then forgotten")
			}
		})
	}
}

// A reset XID that comes after the GPU was gone needs a reset of its own:
// having been gone before it does not count.
func TestRecoveryCheckResetMustFollowTheXID(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	gpus := board(1, nvml.DEVICE_MIG_DISABLE)
	r := withRecovery(gpus[0])
	r.unsupported()
	lib := fakeLib(gpus)
	tr := newRecoveryTracker(recoveryPolicy{Interval: time.Second, Quiet: time.Minute})
	tr.track(nvdevice.HealthEvent{Kind: nvdevice.HealthGPULost, GPUUUID: "GPU-0", Time: t0})
	tr.track(xidEvent("GPU-0", 64, t0.Add(time.Second)))
	assert.Empty(t, tr.check(context.Background(), lib, t0.Add(time.Hour)))
	r.lose()
	assert.Empty(t, tr.check(context.Background(), lib, t0.Add(time.Hour+time.Second)))
	r.answer()
	got := tr.check(context.Background(), lib, t0.Add(time.Hour+2*time.Second))
	require.Len(t, got, 1)
	assert.Contains(t, got[0].Message, "XID 64")

	// The event loop leaves application XIDs to the default policy; one a
	// plugin's policy counts, handed in through TrackUnhealthy, is tracked.
	tr.track(xidEvent("GPU-0", 13, t0))
	assert.Contains(t, tr.gpus, "GPU-0")
}

// shortRecovery makes the event loop check every few milliseconds.
func shortRecovery(t *testing.T, quiet time.Duration) {
	t.Helper()
	saved := healthRecovery
	healthRecovery = recoveryPolicy{Interval: 5 * time.Millisecond, Quiet: quiet}
	t.Cleanup(func() { healthRecovery = saved })
}

// marker sends an application XID on gpu and asserts it is the next event:
// nothing was published before it.
func marker(t *testing.T, events *fakeEvents, w <-chan nvdevice.HealthEvent, gpu *fakeGPU) {
	t.Helper()
	events.ch <- waitResult{data: nvml.EventData{Device: gpu, EventType: nvml.EventTypeXidCriticalError, EventData: 13, GpuInstanceId: wholeGPU, ComputeInstanceId: wholeGPU}}
	ev := next(t, w)
	require.Equal(t, nvdevice.HealthXID, ev.Kind, "nothing before the marker, got %+v", ev)
	require.Equal(t, uint64(13), ev.XID, "nothing before the marker, got %+v", ev)
}

func TestWatchHealthPublishesARecoveryOnlyWhenTheDriverSaysNone(t *testing.T) {
	shortRecovery(t, 0)
	gpus := board(2, nvml.DEVICE_MIG_DISABLE)
	r := withRecovery(gpus[1])
	withRecovery(gpus[0])
	r.setAction(nvml.GPU_RECOVERY_ACTION_GPU_RESET)
	b, _, events := watchedBackend(t, gpus)
	defer b.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w, err := b.WatchHealth(ctx)
	require.NoError(t, err)

	events.ch <- waitResult{data: nvml.EventData{Device: gpus[1], EventType: nvml.EventTypeXidCriticalError, EventData: 95, GpuInstanceId: wholeGPU, ComputeInstanceId: wholeGPU}}
	assert.Equal(t, uint64(95), next(t, w).XID)
	time.Sleep(100 * time.Millisecond) // twenty checks
	marker(t, events, w, gpus[0])

	r.setAction(nvml.GPU_RECOVERY_ACTION_NONE) // the GPU was reset
	ev := next(t, w)
	assert.Equal(t, nvdevice.HealthRecovered, ev.Kind)
	assert.Equal(t, "GPU-1", ev.GPUUUID)
	time.Sleep(50 * time.Millisecond)
	marker(t, events, w, gpus[0]) // reported once
}

func TestWatchHealthALostGPUThatAnswersAgainRecovers(t *testing.T) {
	shortRecovery(t, 0)
	gpus := board(3, nvml.DEVICE_MIG_DISABLE)
	var r *recoveryFake
	for _, g := range gpus {
		r = withRecovery(g)
		r.unsupported()
	}
	r.lose() // GPU-2
	b, _, events := watchedBackend(t, gpus)
	defer b.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w, err := b.WatchHealth(ctx)
	require.NoError(t, err)

	events.ch <- waitResult{ret: nvml.ERROR_GPU_IS_LOST}
	ev := next(t, w)
	require.Equal(t, nvdevice.HealthGPULost, ev.Kind)
	require.Equal(t, "GPU-2", ev.GPUUUID)
	time.Sleep(50 * time.Millisecond)
	marker(t, events, w, gpus[0]) // still lost: no recovery

	r.answer()
	ev = next(t, w)
	assert.Equal(t, nvdevice.HealthRecovered, ev.Kind)
	assert.Equal(t, "GPU-2", ev.GPUUUID)

	r.lose()
	events.ch <- waitResult{ret: nvml.ERROR_GPU_IS_LOST}
	ev = next(t, w)
	assert.Equal(t, nvdevice.HealthGPULost, ev.Kind, "a recovered GPU that is lost again is reported again")
	assert.Equal(t, "GPU-2", ev.GPUUUID)
}

func TestTrackUnhealthy(t *testing.T) {
	shortRecovery(t, 0)
	gpus := board(2, nvml.DEVICE_MIG_DISABLE)
	withRecovery(gpus[0])
	r := withRecovery(gpus[1])
	r.setAction(nvml.GPU_RECOVERY_ACTION_GPU_RESET)
	b, _, events := watchedBackend(t, gpus)
	defer b.Close()
	remembered := xidEvent("GPU-1", 48, time.Now().Add(-time.Hour))
	require.Error(t, b.TrackUnhealthy(remembered), "the checks run in the event loop: WatchHealth first")

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w, err := b.WatchHealth(ctx)
	require.NoError(t, err)
	require.NoError(t, b.TrackUnhealthy(remembered))
	time.Sleep(50 * time.Millisecond)
	marker(t, events, w, gpus[0]) // the remembered fault is not published again, nor recovered

	r.setAction(nvml.GPU_RECOVERY_ACTION_NONE)
	ev := next(t, w)
	assert.Equal(t, nvdevice.HealthRecovered, ev.Kind)
	assert.Equal(t, "GPU-1", ev.GPUUUID)

	require.NoError(t, b.Close())
	assert.Error(t, b.TrackUnhealthy(remembered), "no event loop after Close")
}
