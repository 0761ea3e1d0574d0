// Package local shares one machine's GPUs between people and processes
// without Kubernetes (gpudra local, docs/local.md): the same GPU model,
// the scheduler's own structured allocator over the slices the kubelet
// plugin would publish, the queue policies of the gang controller, and the
// plugin's node lock and crash-safe writer for its state. What it hands
// out is a convention (CUDA_VISIBLE_DEVICES), not isolation. The state is
// one group-writable directory in which each user's allocations are in a
// directory only they can write (store.go); every command acts with its
// own user's rights (docs/local.md, "Who may do what").
package local

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"time"

	"golang.org/x/sys/unix"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/allocator"
	"github.com/gpudra/gpudra/pkg/controller/queue"
	"github.com/gpudra/gpudra/pkg/nodelock"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/plugin/checkpoint"
	"github.com/gpudra/gpudra/pkg/sharing"
)

// DefaultPoll is how often a waiter looks again: a holder that died is
// freed, and the queue goes on, within one poll.
const DefaultPoll = 200 * time.Millisecond

// Config says where the state is and what the machine has.
type Config struct {
	StateDir string
	Machine  *Machine
	// ProcRoot is /proc, where holders are checked.
	ProcRoot string
	// Poll is how often Acquire looks again (DefaultPoll when zero).
	Poll time.Duration
	// Now is the clock (time.Now when nil).
	Now func() time.Time
	// MIG creates and destroys the MIG devices a plan chooses (the
	// machine built with createMIG); nil: none is created.
	MIG nvdevice.MigManager
	// Closer, when set, is called by Close (the backend behind MIG).
	Closer func() error
	// MPS runs the MPS control daemons of MPS allocations (one per GPU,
	// under the state directory); nil: MPS requests are refused.
	MPS *sharing.ProcessServers
	// BootID is this boot's /proc/sys/kernel/random/boot_id: a holder
	// recorded in another boot is gone. Empty: read from ProcRoot.
	BootID string
	// PluginDataDir, when set, is the kubelet plugin's state: every change
	// is refused, under the node lock, while the plugin has marked it
	// (CheckNoPlugin, ClaimForPlugin).
	PluginDataDir string
}

// Local is one machine's local allocations.
type Local struct {
	cfg  Config
	lock *nodelock.Lock
}

// Open opens the state directory, creating it. Its permissions decide who
// may allocate: whoever can write it, each in a directory of their own.
func Open(cfg Config) (*Local, error) {
	if cfg.ProcRoot == "" {
		cfg.ProcRoot = "/proc"
	}
	if cfg.Poll == 0 {
		cfg.Poll = DefaultPoll
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.BootID == "" {
		// Unreadable: holders are told apart by pid and start time only.
		cfg.BootID, _ = checkpoint.BootID(cfg.ProcRoot)
	}
	if err := os.MkdirAll(cfg.StateDir, 0o775); err != nil {
		return nil, fmt.Errorf("state directory: %w", err)
	}
	if unix.Access(cfg.StateDir, unix.W_OK) != nil {
		return nil, fmt.Errorf("state directory %s: not writable by you: its owner and group decide who may allocate GPUs on this machine (ask to be added to its group)", cfg.StateDir)
	}
	lockPath := filepath.Join(cfg.StateDir, lockFile)
	if err := createGroupFile(lockPath); err != nil {
		return nil, err
	}
	lock, err := nodelock.OpenMode(lockPath, 0o664)
	if err != nil {
		return nil, err
	}
	return &Local{cfg: cfg, lock: lock}, nil
}

// createGroupFile creates the empty file at path, unless it exists,
// readable and writable by its group whatever the umask: made aside with
// its mode, then linked into place, so that another user's first command
// never finds it before its chmod (a plain create-then-chmod leaves it
// 0644 for that instant).
func createGroupFile(path string) error {
	if _, err := os.Stat(path); !errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+"-*")
	if err != nil {
		return fmt.Errorf("create %s: %w", path, err)
	}
	defer os.Remove(tmp.Name())
	err = tmp.Chmod(0o664)
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		// Another command's link won the race: its file is as good.
		if err = os.Link(tmp.Name(), path); errors.Is(err, fs.ErrExist) {
			err = nil
		}
	}
	if err != nil {
		return fmt.Errorf("create %s: %w", path, err)
	}
	return nil
}

// Close releases the lock file (and the backend, Config.Closer).
func (l *Local) Close() error {
	err := l.lock.Close()
	if l.cfg.Closer != nil {
		err = errors.Join(err, l.cfg.Closer())
	}
	return err
}

// mutate is update for a change, whose caller needs only the error.
func (l *Local) mutate(ctx context.Context, fn func(s *State) error) error {
	_, err := l.update(ctx, fn)
	return err
}

// update runs fn on the state under the node lock, after freeing what dead
// holders left and before a queue round, then writes the state if it
// changed, and returns it.
func (l *Local) update(ctx context.Context, fn func(s *State) error) (*State, error) {
	if err := l.lock.Lock(ctx); err != nil {
		return nil, err
	}
	defer l.lock.Unlock()
	// The kubelet plugin marks the machine, then checks this state, under
	// this same lock (ClaimForPlugin): checked here, under the lock, the
	// two never both pass.
	if l.cfg.PluginDataDir != "" {
		if err := CheckNoPlugin(l.cfg.PluginDataDir); err != nil {
			return nil, err
		}
	}
	if testHookLocalChecked != nil {
		testHookLocalChecked()
	}
	logger := klog.FromContext(ctx)
	now := l.cfg.Now()
	s, skipped, err := loadState(l.cfg.StateDir, now)
	var corrupt *CorruptStateError
	if errors.As(err, &corrupt) {
		logger.Error(err, "Local state rebuilt")
	} else if err != nil {
		return nil, err
	}
	for _, e := range skipped {
		logger.Error(e, "A state file of gpudra local skipped")
	}
	// Waiters poll every 200 ms: the file is written (two fsyncs) only
	// when something changed, not on every look.
	loaded, err := json.Marshal(s)
	if err != nil {
		return nil, err
	}
	adopted := s.adoptLegacy()
	before := slices.Clone(s.Allocations)
	freed, left := s.reap(l.cfg.ProcRoot, l.cfg.BootID, now)
	for _, a := range freed {
		logger.Info("Freed the allocation of a holder that is gone or expired", "name", a.Name, "user", a.User, "pid", a.Holder.PID)
	}
	for _, w := range left {
		logger.V(2).Info("Dropped the request of a waiter that is gone", "name", w.Name, "pid", w.Holder.PID)
	}
	if fn != nil {
		if err := fn(s); err != nil {
			return nil, err
		}
	}
	// What ended (released, expired, its holder gone) gives back the MIG
	// devices local created for it, by placement (also one recorded but
	// not finished when a kill came), before the round may plan them
	// again, and stops its GPU's MPS daemon when no MPS client is left:
	// first recorded as ended, so that a kill now leaves at worst an
	// instance nobody holds, which the next plan may hand out as it is, or
	// a daemon the next MPS client of the GPU adopts.
	// Only this user's ended allocations: another user's dead holder is
	// only ignored (its record is not this process's to remove), and what
	// it left is theirs to clean up, or taken over as it is.
	var ended []Allocation
	for _, a := range before {
		if writable(a.Request) && !slices.ContainsFunc(s.Allocations, func(x Allocation) bool { return x.Name == a.Name }) {
			ended = append(ended, a)
		}
	}
	if len(ended) > 0 {
		if err := saveState(l.cfg.StateDir, s); err != nil {
			return nil, err
		}
		for _, a := range ended {
			l.destroyMIG(ctx, a, s.Allocations)
			l.stopMPS(ctx, a, s.Allocations)
		}
	}
	l.round(ctx, s, now)
	after, err := json.Marshal(s)
	if err != nil {
		return nil, err
	}
	if corrupt != nil || adopted || !bytes.Equal(loaded, after) {
		if err := saveState(l.cfg.StateDir, s); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// destroyMIG deletes the MIG devices local created for a, but those a
// live allocation holds (another user's command took over an instance a's
// dead holder left before a's owner cleaned up); one already gone is no
// error.
func (l *Local) destroyMIG(ctx context.Context, a Allocation, live []Allocation) {
	if l.cfg.MIG == nil {
		return
	}
	for _, d := range a.Devices {
		if d.MIG == nil || (d.MIG.UUID != "" && slices.ContainsFunc(live, func(x Allocation) bool {
			return x.Name != a.Name && slices.ContainsFunc(x.Devices, func(xd Device) bool { return xd.UUID == d.MIG.UUID })
		})) {
			continue
		}
		err := l.cfg.MIG.DeleteMigPlacement(ctx, nvdevice.MigPlacementRef{ParentUUID: d.MIG.ParentUUID, Profile: d.MIG.Profile, Start: d.MIG.Start, UUID: d.MIG.UUID})
		if err != nil && !errors.Is(err, nvdevice.ErrNotFound) {
			klog.FromContext(ctx).Error(err, "Destroy a MIG device local created", "allocation", a.Name, "parent", d.MIG.ParentUUID, "profile", d.MIG.Profile, "start", d.MIG.Start)
		}
	}
}

// createMIG creates the MIG devices of a new allocation (recorded in the
// state before, so that a kill leaves a placement to roll back); on a
// failure it destroys what it created.
func (l *Local) createMIG(ctx context.Context, a *Allocation) error {
	for i := range a.Devices {
		d := &a.Devices[i]
		if d.MIG == nil {
			continue
		}
		if l.cfg.MIG == nil {
			return fmt.Errorf("device %s does not exist and this machine creates no MIG device", d.Name)
		}
		dev, err := l.cfg.MIG.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: d.MIG.ParentUUID, Profile: d.MIG.Profile, Start: d.MIG.Start})
		if err != nil {
			l.destroyMIG(ctx, *a, nil)
			return fmt.Errorf("create MIG device %s (%s at %d on %s): %w", d.Name, d.MIG.Profile, d.MIG.Start, d.MIG.ParentUUID, err)
		}
		d.MIG.UUID, d.UUID = dev.UUID, dev.UUID
	}
	return nil
}

// round grants waiters in the policy's order: each one that fits now gets
// its devices, ones that do not fit are passed over (a smaller request
// behind a large one may start first).
func (l *Local) round(ctx context.Context, s *State, now time.Time) {
	if len(s.Waiters) == 0 {
		return
	}
	// held are the grants of other users' waiters: only their own
	// commands may record them (within a poll), but the round holds their
	// devices for them, so that no one behind them in the queue gets in
	// first.
	var held []Allocation
	for _, w := range l.order(s, now) {
		a, err := l.cfg.Machine.plan(ctx, w.Request, append(slices.Clone(s.Allocations), held...), s.Drained)
		if err != nil {
			var notFit *allocator.NotFitError
			if !errors.As(err, &notFit) {
				klog.FromContext(ctx).Error(err, "Plan a waiting request", "name", w.Name)
			}
			continue
		}
		if !writable(w.Request) {
			held = append(held, a)
			continue
		}
		a.Since = now
		if w.ReserveFor != nil {
			exp := now.Add(*w.ReserveFor)
			a.Expires = &exp
		}
		if slices.ContainsFunc(a.Devices, func(d Device) bool { return d.MIG != nil }) {
			// Recorded first: a kill during creation leaves the placement
			// to roll back, not an instance nobody knows.
			intent := append(slices.Clone(s.Allocations), a)
			if err := saveState(l.cfg.StateDir, &State{Allocations: intent, Waiters: s.Waiters, Drained: s.Drained, Policy: s.Policy}); err != nil {
				klog.FromContext(ctx).Error(err, "Record a MIG creation", "name", w.Name)
				continue
			}
			if err := l.createMIG(ctx, &a); err != nil {
				s.fail(ctx, w.Name, err)
				continue
			}
		}
		if err := l.startMPS(ctx, &a); err != nil {
			s.fail(ctx, w.Name, err)
			l.destroyMIG(ctx, a, nil)
			continue
		}
		s.Allocations = append(s.Allocations, a)
		s.Waiters = slices.DeleteFunc(s.Waiters, func(x Waiter) bool { return x.Name == w.Name })
	}
}

// fail records that granting the named waiter failed: the request fails
// with err, seen by its requester (Poll, Acquire) and by ps, and is not
// tried again, whoever's command ran the round.
func (s *State) fail(ctx context.Context, name string, err error) {
	klog.FromContext(ctx).Error(err, "Granting a waiting request failed: the request fails", "name", name)
	for i := range s.Waiters {
		if s.Waiters[i].Name == name {
			s.Waiters[i].Error = err.Error()
		}
	}
}

// GrantFailedError says granting a request failed; the request is no
// longer waiting.
type GrantFailedError struct {
	Name, Err string
}

func (e *GrantFailedError) Error() string {
	return fmt.Sprintf("request %s failed: granting it failed: %s", e.Name, e.Err)
}

// order is the waiters in the machine's policy order, failed ones left
// out; users stand in for namespaces (FairShare shares between users).
func (l *Local) order(s *State, now time.Time) []Waiter {
	policy := queue.Policy{Name: v1alpha1.QueuePolicy(s.Policy), AgingPerMinute: 1, DefaultShare: 1}
	if policy.Name == "" {
		policy.Name = v1alpha1.FCFS
	}
	held := map[string]int64{}
	for _, a := range s.Allocations {
		held[a.User] += int64(len(a.Devices))
	}
	byKey := map[string]Waiter{}
	items := make([]queue.Item, 0, len(s.Waiters))
	for _, w := range s.Waiters {
		if w.Error != "" {
			continue
		}
		byKey[w.Name] = w
		items = append(items, queue.Item{Key: w.Name, Namespace: w.User, Priority: w.Priority, QueuedAt: w.QueuedAt,
			Duration: w.Duration, Devices: requestedDevices(w.Request)})
	}
	var out []Waiter
	for _, it := range queue.Order(policy, items, now, held) {
		out = append(out, byKey[it.Key])
	}
	return out
}

// requestedDevices is the number of devices a request asks for (its
// first choice for a prioritized list).
func requestedDevices(r Request) int64 { return DevicesAsked(r.Devices.Requests) }

// DevicesAsked is how many devices a claim's requests ask for, counting a
// prioritized list's first choice, as gpudra local counts them.
func DevicesAsked(reqs []resourceapi.DeviceRequest) int64 {
	var n int64
	for _, req := range reqs {
		switch {
		case req.Exactly != nil:
			n += max(req.Exactly.Count, 1)
		case len(req.FirstAvailable) > 0:
			n += max(req.FirstAvailable[0].Count, 1)
		}
	}
	return n
}

// Policies are the queue policies a machine may order waiters by.
var Policies = []string{string(v1alpha1.FCFS), string(v1alpha1.Priority), string(v1alpha1.FairShare), string(v1alpha1.ShortestJobFirst)}

// SetPolicy sets the machine's queue policy.
func (l *Local) SetPolicy(ctx context.Context, policy string) error {
	if !slices.Contains(Policies, policy) {
		return fmt.Errorf("policy %q: want one of %v", policy, Policies)
	}
	return l.mutate(ctx, func(s *State) error { s.Policy = policy; return nil })
}

// Enqueue adds r to the waiters; the next round (this one included) may
// grant it. A name in use, or a request the empty machine could never
// meet, is refused.
func (l *Local) Enqueue(ctx context.Context, r Request) error {
	if r.Name == "" {
		return errors.New("a request needs a name")
	}
	if r.Share == ShareMPS {
		if l.cfg.MPS == nil {
			return fmt.Errorf("request %s: MPS needs nvidia-cuda-mps-control, and this machine was opened without it", r.Name)
		}
		if n := requestedDevices(r); n != 1 {
			return fmt.Errorf("request %s: MPS locally serves one GPU (or MIG device) per request, one daemon per GPU; this one asks for %d", r.Name, n)
		}
	}
	if err := l.cfg.Machine.Fits(ctx, r); err != nil {
		return fmt.Errorf("request %s can never be met on this machine: %w", r.Name, err)
	}
	return l.mutate(ctx, func(s *State) error {
		if s.find(r.Name) {
			return fmt.Errorf("the name %s is in use: release it, or choose another (--name)", r.Name)
		}
		s.Waiters = append(s.Waiters, Waiter{Request: r, QueuedAt: l.cfg.Now()})
		return nil
	})
}

func (s *State) find(name string) bool {
	return slices.ContainsFunc(s.Allocations, func(a Allocation) bool { return a.Name == name }) ||
		slices.ContainsFunc(s.Waiters, func(w Waiter) bool { return w.Name == name })
}

// Status is where a request stands.
type Status struct {
	// Allocation is set once it holds devices.
	Allocation *Allocation
	// Position is its place among the waiters (1: next), 0 when it holds
	// devices or is gone.
	Position int
}

// Poll runs a round and says where the named request stands; an error
// if it is neither waiting nor allocated (its holder was found dead, or
// someone released it).
func (l *Local) Poll(ctx context.Context, name string) (Status, error) {
	var st Status
	s, err := l.update(ctx, nil)
	if err != nil {
		return st, err
	}
	for i := range s.Allocations {
		if s.Allocations[i].Name == name {
			st.Allocation = &s.Allocations[i]
			return st, nil
		}
	}
	for _, w := range s.Waiters {
		if w.Name == name && w.Error != "" {
			return st, &GrantFailedError{Name: name, Err: w.Error}
		}
	}
	for i, w := range l.order(s, l.cfg.Now()) {
		if w.Name == name {
			st.Position = i + 1
			return st, nil
		}
	}
	return st, fmt.Errorf("request %s is no longer waiting nor allocated", name)
}

// Acquire enqueues r and waits until it holds devices; progress gets the
// queue position while it waits. If ctx ends first, r leaves the queue. A
// grant that fails (GrantFailedError) fails it, and withdraws it.
func (l *Local) Acquire(ctx context.Context, r Request, progress func(position int)) (Allocation, error) {
	if err := l.Enqueue(ctx, r); err != nil {
		return Allocation{}, err
	}
	last := -1
	for {
		st, err := l.Poll(ctx, r.Name)
		if err == nil && st.Allocation != nil {
			return *st.Allocation, nil
		}
		var failed *GrantFailedError
		if errors.As(err, &failed) {
			_ = l.Release(context.WithoutCancel(ctx), r.Name, r.User)
			return Allocation{}, err
		}
		if err == nil && st.Position != last && progress != nil {
			progress(st.Position)
			last = st.Position
		}
		if err != nil && ctx.Err() == nil {
			return Allocation{}, err
		}
		select {
		case <-ctx.Done():
			// Leave the queue (or give back what was granted meanwhile).
			_ = l.Release(context.WithoutCancel(ctx), r.Name, r.User)
			return Allocation{}, ctx.Err()
		case <-time.After(l.cfg.Poll):
		}
	}
}

// Release frees the named allocation, or withdraws the named waiter. Only
// its user may.
func (l *Local) Release(ctx context.Context, name, user string) error {
	return l.mutate(ctx, func(s *State) error {
		for _, a := range s.Allocations {
			if a.Name == name && a.User != user {
				return fmt.Errorf("%s is %s's allocation: only they may release it", name, a.User)
			}
		}
		for _, w := range s.Waiters {
			if w.Name == name && w.User != user {
				return fmt.Errorf("%s is %s's request: only they may withdraw it", name, w.User)
			}
		}
		if !s.find(name) {
			return fmt.Errorf("no allocation or request named %s", name)
		}
		for _, a := range s.Allocations {
			if a.Name == name && !writable(a.Request) {
				return fmt.Errorf("%s is recorded in another user's file (%s): only they may change it", name, a.from)
			}
		}
		for _, w := range s.Waiters {
			if w.Name == name && !writable(w.Request) {
				return fmt.Errorf("%s is recorded in another user's file (%s): only they may change it", name, w.from)
			}
		}
		s.Allocations = slices.DeleteFunc(s.Allocations, func(a Allocation) bool { return a.Name == name })
		s.Waiters = slices.DeleteFunc(s.Waiters, func(w Waiter) bool { return w.Name == name })
		return nil
	})
}

// Drain stops (on) or resumes new allocations on a GPU, by UUID; holders
// keep what they have.
func (l *Local) Drain(ctx context.Context, uuid string, on bool) error {
	if !l.cfg.Machine.hasGPU(uuid) {
		return fmt.Errorf("no GPU %s on this machine", uuid)
	}
	return l.mutate(ctx, func(s *State) error {
		s.Drained = slices.DeleteFunc(s.Drained, func(d string) bool { return d == uuid })
		if on {
			s.Drained = append(s.Drained, uuid)
		}
		return nil
	})
}

// State is the machine's state after freeing what dead holders left and a
// queue round.
func (l *Local) State(ctx context.Context) (*State, error) { return l.update(ctx, nil) }

// Order is the waiters in the order they would be granted.
func (l *Local) Order(s *State) []Waiter { return l.order(s, l.cfg.Now()) }

// Capacity is the machine's number of whole GPUs.
func (l *Local) Capacity() int { return l.cfg.Machine.Capacity() }
