//go:build cgo && linux

package nvml

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"sort"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	waitpkg "k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

const (
	// defaultEventWait bounds each wait on the event set, so the loop (and
	// Close, which waits for it) notices cancellation within that time.
	defaultEventWait = 2 * time.Second
	// errorBackoff is the first pause after a wait that failed (a lost GPU
	// makes every wait fail at once); it doubles while waits keep failing,
	// up to maxErrorBackoff, and starts again after one that works.
	errorBackoff    = time.Second
	maxErrorBackoff = 30 * time.Second
	// wholeGPU in an event's instance ids means the event is not about one
	// MIG device.
	wholeGPU = 0xFFFFFFFF
)

// watchedGPU is a GPU registered with the event set.
type watchedGPU struct {
	dev  nvml.Device
	uuid string
}

// WatchHealth streams XID errors, lost GPUs and recoveries. The first
// watcher starts the one NVML event loop, which runs until Close; every
// watcher gets every event, and its channel is closed when its ctx ends.
// The loop also checks the GPUs it reported unhealthy (and those handed to
// TrackUnhealthy) and reports each recovered when it can be trusted again
// (see recovered).
func (b *Backend) WatchHealth(ctx context.Context) (<-chan nvdevice.HealthEvent, error) {
	err := b.locked(func() error {
		if b.stopLoop != nil {
			return nil
		}
		set, gpus, err := b.registerEvents(ctx)
		if err != nil {
			return err
		}
		loopCtx, cancel := context.WithCancel(klog.NewContext(context.Background(), klog.FromContext(ctx)))
		b.stopLoop, b.loopDone = cancel, make(chan struct{})
		tracker := newRecoveryTracker(healthRecovery)
		b.tracker = tracker
		go b.eventLoop(loopCtx, set, gpus, tracker, b.loopDone)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("watch GPU health: %w", err)
	}
	return b.health.Subscribe(ctx), nil
}

// registerEvents creates an event set with every GPU's XID errors in it.
// GPUs that cannot report them are logged and left out.
func (b *Backend) registerEvents(ctx context.Context) (nvml.EventSet, []watchedGPU, error) {
	logger := klog.FromContext(ctx)
	set, ret := b.lib.EventSetCreate()
	if err := check(ret, "create NVML event set"); err != nil {
		return nil, nil, err
	}
	fail := func(err error) (nvml.EventSet, []watchedGPU, error) {
		set.Free()
		return nil, nil, err
	}
	count, ret := b.lib.DeviceGetCount()
	if err := check(ret, "count GPUs"); err != nil {
		return fail(err)
	}
	var gpus []watchedGPU
	for i := range count {
		dev, ret := b.lib.DeviceGetHandleByIndex(i)
		if ret == nvml.ERROR_GPU_IS_LOST {
			logger.Error(check(ret, "get GPU %d", i), "GPU is lost, its health is not watched", "index", i)
			continue
		}
		if err := check(ret, "get handle of GPU %d", i); err != nil {
			return fail(err)
		}
		uuid, ret := dev.GetUUID()
		if err := check(ret, "read UUID of GPU %d", i); err != nil {
			return fail(err)
		}
		supported, ret := dev.GetSupportedEventTypes()
		if ret == nvml.SUCCESS && supported&nvml.EventTypeXidCriticalError != 0 {
			ret = dev.RegisterEvents(nvml.EventTypeXidCriticalError, set)
		} else if ret == nvml.SUCCESS {
			ret = nvml.ERROR_NOT_SUPPORTED
		}
		if absent(ret, "nvmlDeviceRegisterEvents") {
			logger.Info("GPU does not report XID events, its health is not watched", "index", i, "uuid", uuid)
			continue
		}
		if err := check(ret, "register XID events of GPU %d (%s)", i, uuid); err != nil {
			return fail(err)
		}
		gpus = append(gpus, watchedGPU{dev: dev, uuid: uuid})
	}
	return set, gpus, nil
}

// eventLoop waits for events until ctx ends, and checks the unhealthy GPUs
// every policy interval. It is the only place the event set is used, and
// frees it before closing done; every NVML call of the recovery checks
// happens here too, so that Close (which waits for done) never shuts NVML
// down under one.
func (b *Backend) eventLoop(ctx context.Context, set nvml.EventSet, gpus []watchedGPU, tracker *recoveryTracker, done chan<- struct{}) {
	defer close(done)
	defer set.Free()
	logger := klog.FromContext(ctx)
	wait := b.eventWait
	if wait <= 0 {
		wait = defaultEventWait
	}
	wait = min(wait, tracker.policy.Interval)
	// The pause after a failed wait grows while waits keep failing, so
	// that a driver in trouble is not asked in a tight loop, yet never
	// outgrows the recovery checks' interval, which run in this loop too.
	first := min(errorBackoff, wait)
	initial := waitpkg.Backoff{Duration: first, Factor: 2, Jitter: 0.1, Steps: math.MaxInt32,
		Cap: max(first, min(maxErrorBackoff, tracker.policy.Interval))}
	backoff := initial
	lost := map[string]bool{}
	lastCheck := time.Now()
	for ctx.Err() == nil {
		data, ret := set.Wait(uint32(max(1, wait.Milliseconds())))
		switch ret {
		case nvml.SUCCESS:
			backoff = initial
			if ev, ok := translateEvent(data); ok {
				logger.Info("GPU health event", "kind", ev.Kind, "gpu", ev.GPUUUID, "mig", ev.MigUUID, "xid", ev.XID)
				b.health.Publish(ev)
				b.healthEvents.Add(1) // the inventory snapshot is read again
				if nvdevice.DefaultXIDPolicy.Critical(ev) {
					tracker.track(ev)
				}
			}
		case nvml.ERROR_TIMEOUT:
			backoff = initial
		case nvml.ERROR_GPU_IS_LOST:
			for _, ev := range lostGPUs(gpus, lost) {
				logger.Error(nvdevice.ErrGPULost, "GPU health event", "kind", ev.Kind, "gpu", ev.GPUUUID)
				b.health.Publish(ev)
				b.healthEvents.Add(1)
				tracker.track(ev)
			}
			pause(ctx, backoff.Step())
		default:
			logger.Error(check(ret, "wait for NVML events"), "Health watch error")
			pause(ctx, backoff.Step())
		}
		if now := time.Now(); now.Sub(lastCheck) >= tracker.policy.Interval && ctx.Err() == nil {
			lastCheck = now
			for _, ev := range tracker.check(ctx, b.lib, now) {
				logger.Info("GPU health event", "kind", ev.Kind, "gpu", ev.GPUUUID, "message", ev.Message)
				delete(lost, ev.GPUUUID) // it may be reported lost again
				b.health.Publish(ev)
				b.healthEvents.Add(1)
			}
		}
	}
}

// pause waits for d, or less if ctx ends first.
func pause(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// lostGPUs finds the GPUs that fell off the bus when a wait says one did
// (the wait does not say which): those whose probe answers GPU_IS_LOST. If
// no probe does, every GPU not yet reported is, as NVIDIA's device plugin
// does, since a GPU the driver has lost must not stay schedulable. Each GPU
// is reported once.
func lostGPUs(gpus []watchedGPU, reported map[string]bool) []nvdevice.HealthEvent {
	now := time.Now()
	var out []nvdevice.HealthEvent
	add := func(g watchedGPU) {
		reported[g.uuid] = true
		out = append(out, nvdevice.HealthEvent{Kind: nvdevice.HealthGPULost, GPUUUID: g.uuid, Time: now, Message: "GPU is lost (NVML_ERROR_GPU_IS_LOST)"})
	}
	var unknown []watchedGPU
	probed := false
	for _, g := range gpus {
		if reported[g.uuid] {
			continue
		}
		if _, ret := g.dev.GetMemoryInfo(); ret == nvml.ERROR_GPU_IS_LOST {
			add(g)
			probed = true
			continue
		}
		unknown = append(unknown, g)
	}
	if !probed && len(reported) == 0 {
		for _, g := range unknown {
			add(g)
		}
	}
	return out
}

// translateEvent turns one NVML XID event into a health event. An event about
// one MIG device (its GPU instance id set) carries that device's UUID.
func translateEvent(data nvml.EventData) (nvdevice.HealthEvent, bool) {
	if data.EventType != nvml.EventTypeXidCriticalError || data.Device == nil {
		return nvdevice.HealthEvent{}, false
	}
	uuid, ret := data.Device.GetUUID()
	if ret != nvml.SUCCESS {
		return nvdevice.HealthEvent{}, false
	}
	ev := nvdevice.HealthEvent{Kind: nvdevice.HealthXID, GPUUUID: uuid, XID: data.EventData, Time: time.Now(),
		Message: fmt.Sprintf("XID %d", data.EventData)}
	if data.GpuInstanceId != wholeGPU {
		ev.MigUUID = migUUIDOf(data.Device, int(data.GpuInstanceId), data.ComputeInstanceId)
		ev.Message = fmt.Sprintf("XID %d on GPU instance %d", data.EventData, data.GpuInstanceId)
		if data.ComputeInstanceId != wholeGPU {
			ev.Message += fmt.Sprintf(" compute instance %d", data.ComputeInstanceId)
		}
	}
	return ev, true
}

// migUUIDOf finds the MIG device of a GPU instance (and compute instance,
// unless the event covers the whole GPU instance); "" when there is none.
func migUUIDOf(dev nvml.Device, gi int, ci uint32) string {
	uuids, err := migUUIDs(dev)
	if err != nil {
		return ""
	}
	if ci != wholeGPU {
		return uuids[[2]int{gi, int(ci)}]
	}
	found, lowest := "", -1
	for k, uuid := range uuids { // the GPU instance's first compute instance
		if k[0] == gi && (lowest < 0 || k[1] < lowest) {
			found, lowest = uuid, k[1]
		}
	}
	return found
}

// recoveryPolicy is how unhealthy GPUs are checked.
type recoveryPolicy struct {
	// Interval between two checks of the unhealthy GPUs.
	Interval time.Duration
	// Quiet is how long after its last critical event a GPU must have been
	// quiet before it is healthy again.
	Quiet time.Duration
}

// healthRecovery is the policy WatchHealth starts the loop with (tests
// shorten it). It belongs in Backend, next to eventWait; it is here while
// backend.go is being changed by others.
var healthRecovery = recoveryPolicy{Interval: nvdevice.DefaultRecoveryCheckInterval, Quiet: nvdevice.DefaultRecoveryQuietPeriod}

// TrackUnhealthy has the event loop check a GPU a restarted plugin still
// remembers as unhealthy, or one that an XID the plugin's policy counts
// (and the default ignores) made unhealthy: the caller's policy decided,
// so any event but a recovery is tracked. It needs WatchHealth first: the
// checks run in the event loop.
func (b *Backend) TrackUnhealthy(ev nvdevice.HealthEvent) error {
	if ev.Kind == nvdevice.HealthRecovered {
		return nil
	}
	b.mu.Lock()
	t, closed := b.tracker, b.closed
	b.mu.Unlock()
	if t == nil || closed {
		return fmt.Errorf("track the health of GPU %s: the backend does not watch GPU health (call WatchHealth first)", ev.GPUUUID)
	}
	t.track(ev)
	return nil
}

var _ nvdevice.UnhealthyTracker = (*Backend)(nil)

// recoveryTracker keeps the unhealthy GPUs and checks them.
type recoveryTracker struct {
	policy recoveryPolicy
	mu     sync.Mutex
	gpus   map[string]*unhealthyGPU
}

// unhealthyGPU is what is known of an unhealthy GPU since it last was
// healthy.
type unhealthyGPU struct {
	// last is the time of its last critical event.
	last time.Time
	// need is the most demanding recovery of its events, cause the event
	// that needs it.
	need  nvdevice.Recovery
	cause nvdevice.HealthEvent
	// gone: the GPU was seen lost or missing since the last event that
	// needs a reset.
	gone bool
}

func newRecoveryTracker(p recoveryPolicy) *recoveryTracker {
	if p.Interval <= 0 {
		p.Interval = nvdevice.DefaultRecoveryCheckInterval
	}
	if p.Quiet < 0 {
		p.Quiet = 0
	}
	return &recoveryTracker{policy: p, gpus: map[string]*unhealthyGPU{}}
}

// track records an event that made a GPU unhealthy; callers decide which
// do (the event loop by nvdevice.DefaultXIDPolicy, TrackUnhealthy by the
// plugin's policy).
func (t *recoveryTracker) track(ev nvdevice.HealthEvent) {
	at := ev.Time
	if at.IsZero() {
		at = time.Now()
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	g := t.gpus[ev.GPUUUID]
	if g == nil {
		g = &unhealthyGPU{cause: ev}
		t.gpus[ev.GPUUUID] = g
	}
	if at.After(g.last) {
		g.last = at
	}
	need := ev.Recovery()
	if need >= g.need {
		g.need, g.cause = need, ev
	}
	switch {
	case need.NeedsReset():
		g.gone = false // only a reset after this event counts
	case ev.Kind == nvdevice.HealthGPULost:
		g.gone = true
	}
}

// check checks every unhealthy GPU and returns a HealthRecovered event for
// each that can be trusted again, forgetting it.
func (t *recoveryTracker) check(ctx context.Context, lib nvml.Interface, now time.Time) []nvdevice.HealthEvent {
	logger := klog.FromContext(ctx)
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []nvdevice.HealthEvent
	for uuid, g := range t.gpus {
		ok, why := t.recovered(lib, uuid, g, now)
		if !ok {
			logger.V(4).Info("Unhealthy GPU has not recovered", "gpu", uuid, "cause", g.cause.Message, "reason", why)
			continue
		}
		delete(t.gpus, uuid)
		out = append(out, nvdevice.HealthEvent{Kind: nvdevice.HealthRecovered, GPUUUID: uuid, Time: now, Message: why})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].GPUUUID < out[j].GPUUUID })
	return out
}

// recovered decides whether an unhealthy GPU can be trusted again, and
// says why (or why not). All of these must hold:
//
//   - The GPU answers: its handle is found by UUID (a fresh handle, as a
//     reset invalidates the old one) and its memory can be read. A GPU that
//     is lost (GPU_IS_LOST) or missing (NOT_FOUND) is remembered as gone.
//   - It has been quiet: no critical event for the quiet period. A fault
//     that repeats keeps the GPU out, and the driver has time to set the
//     recovery action after the XID (it reports XID 154 when it does).
//   - Where the driver reports the GPU's recovery action
//     (FI_DEV_GET_GPU_RECOVERY_ACTION, R550 and later), it is NONE: the
//     driver's own word that the GPU can take new work (NVIDIA's GPU memory
//     error management guide, "Error Recovery and Response Flags"). Reset,
//     reboot, drain P2P, drain and reset and IMEX-domain recovery all keep
//     the GPU unhealthy, whatever the XID was.
//   - Where it does not (NOT_SUPPORTED: an older driver), the XID decides
//     (nvdevice.XIDRecovery). A fault that needs no reset recovers. One
//     that needs a GPU reset recovers only once the GPU was seen gone
//     after it and answers again: the driver reinitialises a GPU that
//     comes back, while a GPU that merely answers may still be in the
//     faulty state. A reset quicker than the check interval is not seen,
//     and the GPU then stays unhealthy until the node reboots (the plugin
//     forgets health at a new boot id): wrongly unhealthy is the safe
//     side. One that needs a node reboot never recovers within this boot.
func (t *recoveryTracker) recovered(lib nvml.Interface, uuid string, g *unhealthyGPU, now time.Time) (bool, string) {
	dev, err := probe(lib, uuid)
	if err != nil {
		if errors.Is(err, nvdevice.ErrGPULost) || errors.Is(err, nvdevice.ErrNotFound) {
			g.gone = true
		}
		return false, fmt.Sprintf("GPU does not answer: %v", err)
	}
	if quiet := now.Sub(g.last); quiet < t.policy.Quiet {
		return false, fmt.Sprintf("last critical event %s ago, less than the quiet period %s", quiet.Round(time.Second), t.policy.Quiet)
	}
	action, supported, err := recoveryAction(dev)
	if err != nil {
		if errors.Is(err, nvdevice.ErrGPULost) {
			g.gone = true
		}
		return false, err.Error()
	}
	if supported {
		if action != nvml.GPU_RECOVERY_ACTION_NONE {
			return false, fmt.Sprintf("the driver's recovery action for the GPU is %s", recoveryActionName(action))
		}
		return true, fmt.Sprintf("GPU answers, the driver's recovery action is none, and it has been quiet for %s", t.policy.Quiet)
	}
	switch g.need {
	case nvdevice.RecoverWhenAnswering:
		return true, fmt.Sprintf("GPU answers and has been quiet for %s", t.policy.Quiet)
	case nvdevice.RecoverGPUReset:
		if g.gone {
			return true, fmt.Sprintf("GPU was gone after XID %d and answers again: it was reset", g.cause.XID)
		}
		return false, fmt.Sprintf("XID %d needs a GPU reset, and none was seen (the driver does not report the recovery action)", g.cause.XID)
	default:
		return false, fmt.Sprintf("XID %d needs a node reboot", g.cause.XID)
	}
}

// probe finds a GPU by UUID and reads its memory: an error wrapping
// nvdevice.ErrGPULost or ErrNotFound when it is gone.
func probe(lib nvml.Interface, uuid string) (nvml.Device, error) {
	dev, ret := lib.DeviceGetHandleByUUID(uuid)
	if err := check(ret, "get handle of GPU %s", uuid); err != nil {
		return nil, err
	}
	if _, ret := dev.GetMemoryInfo(); ret != nvml.SUCCESS {
		return nil, check(ret, "read memory of GPU %s", uuid)
	}
	return dev, nil
}

// recoveryAction reads the GPU's recovery action; supported is false when
// the driver does not report it.
func recoveryAction(dev nvml.Device) (action nvml.DeviceGpuRecoveryAction, supported bool, err error) {
	values := []nvml.FieldValue{{FieldId: nvml.FI_DEV_GET_GPU_RECOVERY_ACTION}}
	switch ret := dev.GetFieldValues(values); ret {
	case nvml.SUCCESS:
	case nvml.ERROR_NOT_SUPPORTED, nvml.ERROR_FUNCTION_NOT_FOUND:
		return 0, false, nil
	default:
		return 0, false, check(ret, "read the GPU's recovery action")
	}
	v := values[0]
	switch ret := nvml.Return(v.NvmlReturn); ret {
	case nvml.SUCCESS:
	case nvml.ERROR_NOT_SUPPORTED, nvml.ERROR_INVALID_ARGUMENT: // a driver that predates the field
		return 0, false, nil
	default:
		return 0, false, check(ret, "read the GPU's recovery action")
	}
	var n uint64
	switch nvml.ValueType(v.ValueType) {
	case nvml.VALUE_TYPE_UNSIGNED_INT, nvml.VALUE_TYPE_SIGNED_INT:
		n = uint64(binary.NativeEndian.Uint32(v.Value[:4]))
	case nvml.VALUE_TYPE_UNSIGNED_LONG, nvml.VALUE_TYPE_UNSIGNED_LONG_LONG, nvml.VALUE_TYPE_SIGNED_LONG_LONG:
		n = binary.NativeEndian.Uint64(v.Value[:])
	default:
		return 0, false, fmt.Errorf("read the GPU's recovery action: unexpected value type %d", v.ValueType)
	}
	return nvml.DeviceGpuRecoveryAction(n), true, nil
}

func recoveryActionName(a nvml.DeviceGpuRecoveryAction) string {
	switch a {
	case nvml.GPU_RECOVERY_ACTION_NONE:
		return "none"
	case nvml.GPU_RECOVERY_ACTION_GPU_RESET:
		return "GPU reset"
	case nvml.GPU_RECOVERY_ACTION_NODE_REBOOT:
		return "node reboot"
	case nvml.GPU_RECOVERY_ACTION_DRAIN_P2P:
		return "drain P2P"
	case nvml.GPU_RECOVERY_ACTION_DRAIN_AND_RESET:
		return "drain and reset"
	case nvml.GPU_RECOVERY_ACTION_RECOVER_IMEX_DOMAIN:
		return "recover IMEX domain"
	}
	return fmt.Sprintf("unknown (%d)", int32(a))
}
