package dashboard

import "sync"

// Source is what the server shows: the latest View and a channel closed
// once a newer one is published. A viewer's events wait on that channel,
// so that a thousand viewers cost the cluster nothing more than one.
type Source interface {
	Current() (*View, <-chan struct{})
}

// Publisher is a Source its owner publishes Views into; each Publish
// numbers the View with the next revision.
type Publisher struct {
	mu      sync.Mutex
	view    *View
	rev     uint64
	changed chan struct{}
}

// NewPublisher returns a Publisher whose first View is initial (numbered
// revision 1).
func NewPublisher(initial *View) *Publisher {
	p := &Publisher{changed: make(chan struct{})}
	p.Publish(initial)
	return p
}

// Publish makes v the current View: it sets v.Revision and wakes whoever
// waits. v must not be changed afterwards.
func (p *Publisher) Publish(v *View) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.rev++
	v.Revision = p.rev
	p.view = v
	close(p.changed)
	p.changed = make(chan struct{})
}

// Current implements Source.
func (p *Publisher) Current() (*View, <-chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.view, p.changed
}
