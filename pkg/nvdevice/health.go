package nvdevice

import (
	"context"
	"sync"
)

// HealthBroadcaster fans health events out to every watcher (both backends
// use it). Each watcher has its own
// unbounded queue so that a slow reader never blocks the machine or loses
// an event.
type HealthBroadcaster struct {
	mu   sync.Mutex
	subs map[*subscriber]struct{}
}

type subscriber struct {
	mu     sync.Mutex
	cond   *sync.Cond
	queue  []HealthEvent
	closed bool
}

func NewHealthBroadcaster() *HealthBroadcaster {
	return &HealthBroadcaster{subs: map[*subscriber]struct{}{}}
}

func (b *HealthBroadcaster) Subscribe(ctx context.Context) <-chan HealthEvent {
	s := &subscriber{}
	s.cond = sync.NewCond(&s.mu)
	b.mu.Lock()
	b.subs[s] = struct{}{}
	b.mu.Unlock()

	out := make(chan HealthEvent)
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

func (b *HealthBroadcaster) Publish(ev HealthEvent) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for s := range b.subs {
		s.mu.Lock()
		s.queue = append(s.queue, ev)
		s.mu.Unlock()
		s.cond.Signal()
	}
}

func (b *HealthBroadcaster) Close() {
	b.mu.Lock()
	defer b.mu.Unlock()
	for s := range b.subs {
		s.close()
		delete(b.subs, s)
	}
}
