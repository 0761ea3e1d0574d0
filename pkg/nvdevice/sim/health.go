package sim

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// WatchHealth streams injected faults until ctx is done.
func (m *Machine) WatchHealth(ctx context.Context) (<-chan nvdevice.HealthEvent, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil, fmt.Errorf("simulated machine %q is closed", m.spec.Name)
	}
	return m.health.subscribe(ctx), nil
}

// InjectXID reports an XID error on a GPU, or on one MIG device of it when
// migUUID is set, as the driver would.
func (m *Machine) InjectXID(gpuUUID, migUUID string, xid uint64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, err := m.gpuLocked(gpuUUID); err != nil {
		return err
	}
	m.health.publish(nvdevice.HealthEvent{Kind: nvdevice.HealthXID, GPUUUID: gpuUUID, MigUUID: migUUID, XID: xid,
		Time: time.Now(), Message: fmt.Sprintf("simulated XID %d", xid)})
	return nil
}

// LoseGPU makes a GPU fall off the bus: it vanishes from the inventory, MIG
// operations on it fail with ErrGPULost, and watchers get a gpu-lost event.
func (m *Machine) LoseGPU(gpuUUID string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, err := m.gpuLocked(gpuUUID); err != nil {
		return err
	}
	m.lost[gpuUUID] = true
	m.health.publish(nvdevice.HealthEvent{Kind: nvdevice.HealthGPULost, GPUUUID: gpuUUID, Time: time.Now(),
		Message: "simulated GPU fell off the bus"})
	return nil
}

// RecoverGPU brings a lost GPU back (or clears an XID condition) and tells
// watchers the GPU is healthy again.
func (m *Machine) RecoverGPU(gpuUUID string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return fmt.Errorf("simulated machine %q is closed", m.spec.Name)
	}
	if _, err := m.inv.GPUByUUID(gpuUUID); err != nil {
		return err
	}
	delete(m.lost, gpuUUID)
	m.health.publish(nvdevice.HealthEvent{Kind: nvdevice.HealthRecovered, GPUUUID: gpuUUID, Time: time.Now(),
		Message: "simulated recovery"})
	return nil
}

// broadcaster fans events out to every watcher. Each watcher has its own
// unbounded queue so that a slow reader never blocks the machine or loses
// an event.
type broadcaster struct {
	mu   sync.Mutex
	subs map[*subscriber]struct{}
}

type subscriber struct {
	mu     sync.Mutex
	cond   *sync.Cond
	queue  []nvdevice.HealthEvent
	closed bool
}

func newBroadcaster() *broadcaster { return &broadcaster{subs: map[*subscriber]struct{}{}} }

func (b *broadcaster) subscribe(ctx context.Context) <-chan nvdevice.HealthEvent {
	s := &subscriber{}
	s.cond = sync.NewCond(&s.mu)
	b.mu.Lock()
	b.subs[s] = struct{}{}
	b.mu.Unlock()

	out := make(chan nvdevice.HealthEvent)
	go func() {
		<-ctx.Done()
		b.mu.Lock()
		delete(b.subs, s)
		b.mu.Unlock()
		s.close()
	}()
	go func() {
		defer close(out)
		for {
			s.mu.Lock()
			for len(s.queue) == 0 && !s.closed {
				s.cond.Wait()
			}
			if s.closed {
				s.mu.Unlock()
				return
			}
			ev := s.queue[0]
			s.queue = s.queue[1:]
			s.mu.Unlock()
			select {
			case out <- ev:
			case <-ctx.Done():
				return
			}
		}
	}()
	return out
}

func (s *subscriber) close() {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.cond.Broadcast()
}

func (b *broadcaster) publish(ev nvdevice.HealthEvent) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for s := range b.subs {
		s.mu.Lock()
		s.queue = append(s.queue, ev)
		s.mu.Unlock()
		s.cond.Signal()
	}
}

func (b *broadcaster) close() {
	b.mu.Lock()
	defer b.mu.Unlock()
	for s := range b.subs {
		s.close()
		delete(b.subs, s)
	}
}
