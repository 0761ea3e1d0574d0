// Package nodelock is the node-wide lock of gpudra's node state: the
// kubelet plugin's prepared claims (every plugin instance of a node) and
// gpudra local's allocations.
package nodelock

import (
	"context"
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"
)

// Lock serializes changes to the node's prepared state across every
// plugin instance of the node: during a rolling update the old and the new
// plugin pod run side by side and the kubelet may call either, and each
// instance starts with a sweep of what a kill left behind. The lock is an
// flock on a file in the plugin data directory, which both pods mount.
//
// flock belongs to an open file description, so two goroutines of one
// process holding the same descriptor would not exclude each other: the
// in-process mutex covers that.
type Lock struct {
	mu     sync.Mutex
	file   *os.File
	closed bool
}

// Open opens (creating it) the lock file at path, private to its owner.
func Open(path string) (*Lock, error) { return OpenMode(path, 0o600) }

// OpenMode is Open with the permissions a new lock file gets (gpudra
// local's: its group's users take the lock too).
func OpenMode(path string, mode os.FileMode) (*Lock, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, mode)
	if err != nil {
		return nil, fmt.Errorf("node state lock %s: %w", path, err)
	}
	return &Lock{file: f}, nil
}

// OpenReadOnly opens an existing lock file read-only (a flock needs no
// write access): the kubelet plugin takes gpudra local's lock through a
// read-only mount. A missing file is an error that wraps os.ErrNotExist.
func OpenReadOnly(path string) (*Lock, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("node state lock %s: %w", path, err)
	}
	return &Lock{file: f}, nil
}

// Lock waits for the node-wide lock until ctx ends. The wait polls a
// non-blocking flock: a blocking one cannot be cancelled.
func (l *Lock) Lock(ctx context.Context) error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return fmt.Errorf("node state lock %s: closed", l.file.Name())
	}
	for wait := 100 * time.Microsecond; ; wait = min(2*wait, 20*time.Millisecond) {
		err := syscall.Flock(int(l.file.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return nil
		}
		if err != syscall.EWOULDBLOCK && err != syscall.EINTR {
			l.mu.Unlock()
			return fmt.Errorf("lock node state %s: %w", l.file.Name(), err)
		}
		select {
		case <-ctx.Done():
			l.mu.Unlock()
			return fmt.Errorf("waiting for the node state lock %s (another instance holds it): %w", l.file.Name(), ctx.Err())
		case <-time.After(wait):
		}
	}
}

// Unlock releases the lock.
func (l *Lock) Unlock() {
	_ = syscall.Flock(int(l.file.Fd()), syscall.LOCK_UN)
	l.mu.Unlock()
}

// Close waits for a holder to finish; later Lock calls fail.
func (l *Lock) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil
	}
	l.closed = true
	return l.file.Close()
}
