//go:build cgo && linux

package nvml

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

func TestTranslateEvent(t *testing.T) {
	gpus := board(1, nvml.DEVICE_MIG_ENABLE)
	gpus[0].addGI(nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4, nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE) // MIG-1: GI 1, CI 0
	dev := gpus[0]
	for _, tc := range []struct {
		name         string
		data         nvml.EventData
		want         bool
		wantMig      string
		wantXID      uint64
		wantCritical bool
	}{
		{name: "XID on the whole GPU", data: nvml.EventData{Device: dev, EventType: nvml.EventTypeXidCriticalError, EventData: 79, GpuInstanceId: wholeGPU, ComputeInstanceId: wholeGPU},
			want: true, wantXID: 79, wantCritical: true},
		{name: "XID on a MIG device", data: nvml.EventData{Device: dev, EventType: nvml.EventTypeXidCriticalError, EventData: 94, GpuInstanceId: 1, ComputeInstanceId: 0},
			want: true, wantXID: 94, wantMig: "MIG-1", wantCritical: true},
		{name: "XID on a GPU instance", data: nvml.EventData{Device: dev, EventType: nvml.EventTypeXidCriticalError, EventData: 48, GpuInstanceId: 1, ComputeInstanceId: wholeGPU},
			want: true, wantXID: 48, wantMig: "MIG-1", wantCritical: true},
		{name: "application XID", data: nvml.EventData{Device: dev, EventType: nvml.EventTypeXidCriticalError, EventData: 13, GpuInstanceId: wholeGPU, ComputeInstanceId: wholeGPU},
			want: true, wantXID: 13, wantCritical: false},
		{name: "not an XID event", data: nvml.EventData{Device: dev, EventType: nvml.EventTypeDoubleBitEccError}},
		{name: "no device", data: nvml.EventData{EventType: nvml.EventTypeXidCriticalError, EventData: 79}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ev, ok := translateEvent(tc.data)
			require.Equal(t, tc.want, ok)
			if !ok {
				return
			}
			assert.Equal(t, nvdevice.HealthXID, ev.Kind)
			assert.Equal(t, "GPU-0", ev.GPUUUID)
			assert.Equal(t, tc.wantMig, ev.MigUUID)
			assert.Equal(t, tc.wantXID, ev.XID)
			assert.Equal(t, tc.wantCritical, nvdevice.DefaultXIDPolicy.Critical(ev))
			assert.False(t, ev.Time.IsZero())
		})
	}
}

// fakeEvents is an NVML event set fed from a channel; a wait with nothing
// queued times out after its timeout, as NVML's does.
type fakeEvents struct {
	ch    chan waitResult
	mu    sync.Mutex
	order []string // "free", "shutdown" as they happen
}

type waitResult struct {
	data nvml.EventData
	ret  nvml.Return
}

func (f *fakeEvents) record(s string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.order = append(f.order, s)
}

func (f *fakeEvents) set() *mock.EventSet {
	return &mock.EventSet{
		WaitFunc: func(ms uint32) (nvml.EventData, nvml.Return) {
			select {
			case r := <-f.ch:
				return r.data, r.ret
			case <-time.After(time.Duration(ms) * time.Millisecond):
				return nvml.EventData{}, nvml.ERROR_TIMEOUT
			}
		},
		FreeFunc: func() nvml.Return { f.record("free"); return nvml.SUCCESS },
	}
}

func watchedBackend(t *testing.T, gpus []*fakeGPU) (*Backend, *mock.Interface, *fakeEvents) {
	t.Helper()
	ev := &fakeEvents{ch: make(chan waitResult, 16)}
	lib := fakeLib(gpus)
	lib.EventSetCreateFunc = func() (nvml.EventSet, nvml.Return) { return ev.set(), nvml.SUCCESS }
	lib.ShutdownFunc = func() nvml.Return { ev.record("shutdown"); return nvml.SUCCESS }
	b := testBackend(t, lib)
	b.eventWait = 20 * time.Millisecond
	return b, lib, ev
}

func next(t *testing.T, ch <-chan nvdevice.HealthEvent) nvdevice.HealthEvent {
	t.Helper()
	select {
	case ev, ok := <-ch:
		require.True(t, ok, "channel closed early")
		return ev
	case <-time.After(5 * time.Second):
		require.FailNow(t, "no health event")
	}
	return nvdevice.HealthEvent{}
}

func TestWatchHealthFansOut(t *testing.T) {
	gpus := board(2, nvml.DEVICE_MIG_DISABLE)
	b, lib, events := watchedBackend(t, gpus)
	ctx1, cancel1 := context.WithCancel(context.Background())
	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	w1, err := b.WatchHealth(ctx1)
	require.NoError(t, err)
	w2, err := b.WatchHealth(ctx2)
	require.NoError(t, err)
	assert.Len(t, lib.EventSetCreateCalls(), 1, "one event loop for every watcher")
	for _, g := range gpus {
		calls := g.RegisterEventsCalls()
		require.Len(t, calls, 1)
		assert.Equal(t, uint64(nvml.EventTypeXidCriticalError), calls[0].V)
	}

	events.ch <- waitResult{data: nvml.EventData{Device: gpus[1], EventType: nvml.EventTypeXidCriticalError, EventData: 79, GpuInstanceId: wholeGPU, ComputeInstanceId: wholeGPU}}
	for _, w := range []<-chan nvdevice.HealthEvent{w1, w2} {
		ev := next(t, w)
		assert.Equal(t, nvdevice.HealthXID, ev.Kind)
		assert.Equal(t, "GPU-1", ev.GPUUUID)
		assert.Equal(t, uint64(79), ev.XID)
	}

	cancel1()
	select {
	case _, ok := <-w1:
		assert.False(t, ok, "a watcher's channel closes when its context ends")
	case <-time.After(5 * time.Second):
		require.FailNow(t, "watcher channel not closed")
	}

	events.ch <- waitResult{data: nvml.EventData{Device: gpus[0], EventType: nvml.EventTypeXidCriticalError, EventData: 48, GpuInstanceId: wholeGPU, ComputeInstanceId: wholeGPU}}
	assert.Equal(t, uint64(48), next(t, w2).XID, "the other watcher goes on")

	require.NoError(t, b.Close())
	_, ok := <-w2
	assert.False(t, ok, "Close ends every watcher")
	events.mu.Lock()
	defer events.mu.Unlock()
	assert.Equal(t, []string{"free", "shutdown"}, events.order, "the event loop is done with NVML before NVML shuts down")
}

func TestWatchHealthReportsALostGPUOnce(t *testing.T) {
	gpus := board(3, nvml.DEVICE_MIG_DISABLE)
	b, _, events := watchedBackend(t, gpus)
	defer b.Close()
	gpus[2].GetMemoryInfoFunc = func() (nvml.Memory, nvml.Return) { return nvml.Memory{}, nvml.ERROR_GPU_IS_LOST }
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w, err := b.WatchHealth(ctx)
	require.NoError(t, err)

	for range 3 { // the driver keeps saying so
		events.ch <- waitResult{ret: nvml.ERROR_GPU_IS_LOST}
	}
	ev := next(t, w)
	assert.Equal(t, nvdevice.HealthGPULost, ev.Kind)
	assert.Equal(t, "GPU-2", ev.GPUUUID)
	assert.True(t, nvdevice.DefaultXIDPolicy.Critical(ev))

	events.ch <- waitResult{data: nvml.EventData{Device: gpus[0], EventType: nvml.EventTypeXidCriticalError, EventData: 31, GpuInstanceId: wholeGPU, ComputeInstanceId: wholeGPU}}
	ev = next(t, w)
	assert.Equal(t, nvdevice.HealthXID, ev.Kind, "the lost GPU was reported once, the next event is the XID")
	assert.Equal(t, "GPU-0", ev.GPUUUID)
}

func TestLostGPUs(t *testing.T) {
	for _, tc := range []struct {
		name     string
		lost     []bool // probe answers GPU_IS_LOST
		reported map[string]bool
		want     []string
	}{
		{name: "the probe finds it", lost: []bool{false, true, false}, reported: map[string]bool{}, want: []string{"GPU-1"}},
		{name: "no probe finds it: every GPU", lost: []bool{false, false}, reported: map[string]bool{}, want: []string{"GPU-0", "GPU-1"}},
		{name: "already reported", lost: []bool{false, true}, reported: map[string]bool{"GPU-1": true}, want: nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var watched []watchedGPU
			for i, gpu := range board(len(tc.lost), nvml.DEVICE_MIG_DISABLE) {
				if tc.lost[i] {
					gpu.GetMemoryInfoFunc = func() (nvml.Memory, nvml.Return) { return nvml.Memory{}, nvml.ERROR_GPU_IS_LOST }
				}
				uuid, _ := gpu.GetUUID()
				watched = append(watched, watchedGPU{dev: gpu, uuid: uuid})
			}
			var got []string
			for _, ev := range lostGPUs(watched, tc.reported) {
				assert.Equal(t, nvdevice.HealthGPULost, ev.Kind)
				got = append(got, ev.GPUUUID)
			}
			assert.Equal(t, tc.want, got)
			for _, u := range tc.want {
				assert.True(t, tc.reported[u], "%s is remembered as reported", u)
			}
		})
	}
}

func TestWatchHealthSkipsGPUsWithoutXIDEvents(t *testing.T) {
	gpus := board(2, nvml.DEVICE_MIG_DISABLE)
	gpus[0].GetSupportedEventTypesFunc = func() (uint64, nvml.Return) { return nvml.EventTypeDoubleBitEccError, nvml.SUCCESS }
	b, _, _ := watchedBackend(t, gpus)
	defer b.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, err := b.WatchHealth(ctx)
	require.NoError(t, err)
	assert.Empty(t, gpus[0].RegisterEventsCalls())
	assert.Len(t, gpus[1].RegisterEventsCalls(), 1)
}
