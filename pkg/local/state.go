package local

import (
	"fmt"
	"time"

	resourceapi "k8s.io/api/resource/v1"

	"github.com/gpudra/gpudra/pkg/plugin/checkpoint"
	"github.com/gpudra/gpudra/pkg/sharing"
)

// DefaultStateDir is where a machine's local allocations live.
const DefaultStateDir = "/var/lib/gpudra/local"

// stateFile and lockFile are in the state directory (store.go: the
// layout); stateFile is also each user's file in their directory.
const (
	stateFile = "state.json"
	lockFile  = "state.lock"
)

// Holder is the process an allocation or a wait belongs to: its pid, the
// kernel's start time of that pid, and the boot it ran in, so that a later
// process reusing the pid, in this boot or after a reboot (where start
// times begin again), is not taken for it. A zero PID is held until
// released.
type Holder struct {
	PID       int    `json:"pid,omitempty"`
	StartTime uint64 `json:"startTime,omitempty"`
	// BootID is /proc/sys/kernel/random/boot_id when the holder was
	// recorded; "" (a state written before it was recorded) is not
	// compared.
	BootID string `json:"bootID,omitempty"`
}

// Request is what a user asks for: the devices part of a ResourceClaim
// spec, as the cluster takes it, and how it waits.
type Request struct {
	// Name names the allocation; unique on the machine.
	Name string `json:"name"`
	// User is who asked (the login name); only they may release it.
	User     string                  `json:"user"`
	Devices  resourceapi.DeviceClaim `json:"devices"`
	Priority int32                   `json:"priority,omitempty"`
	// Duration is the declared run time (ShortestJobFirst), nil: unknown.
	Duration *time.Duration `json:"duration,omitempty"`
	// ReserveFor, when set, makes the allocation expire that long after
	// it is granted (reserve --for).
	ReserveFor *time.Duration `json:"reserveFor,omitempty"`
	Holder     Holder         `json:"holder"`
	// Share is "time-slicing" or "mps" for a request that shares its
	// devices with other requests of the same kind; "": exclusive.
	Share string `json:"share,omitempty"`
	// MPS are an MPS request's client limits.
	MPS *MPSLimits `json:"mps,omitempty"`

	// from is the file the entry was read from (fromLegacy, or the user
	// directory's name); "" for one this process made. A process records
	// changes only of its own entries and the legacy ones (writable).
	from string
}

// ShareTimeSlicing is the one kind of sharing local offers.
const ShareTimeSlicing = "time-slicing"

// Device is one allocated device.
type Device struct {
	// Name is the device's name in the node's pool (gpu-0, ...).
	Name string `json:"name"`
	// UUID is the GPU's or MIG device's UUID (CUDA_VISIBLE_DEVICES).
	UUID string `json:"uuid"`
	// NVLinkDomain is the device's NVLink domain, "" without one.
	NVLinkDomain string `json:"nvlinkDomain,omitempty"`
	// MIG is set on a MIG device that local created for the allocation
	// (and destroys when it ends).
	MIG *MigPlacement `json:"mig,omitempty"`
}

// Allocation is a request that holds devices.
type Allocation struct {
	Request
	Devices []Device `json:"allocated"`
	// Result is the allocator's result, which the next plans count as in
	// use.
	Result resourceapi.AllocationResult `json:"result"`
	Since  time.Time                    `json:"since"`
	// Expires, when set, releases the allocation then (reserve --for).
	Expires *time.Time `json:"expires,omitempty"`
	// MPSDir is the directory of the MPS control daemon an MPS
	// allocation's clients use.
	MPSDir string `json:"mpsDir,omitempty"`
}

// Waiter is a request that waits for devices.
type Waiter struct {
	Request
	QueuedAt time.Time `json:"queuedAt"`
	// Error is why granting it failed (a MIG device or an MPS daemon that
	// could not be made): the request has failed, is not tried again, and
	// stays until its requester has seen the error (Acquire withdraws it)
	// or its holder is gone.
	Error string `json:"error,omitempty"`
}

// State is everything in the state directory.
type State struct {
	Allocations []Allocation `json:"allocations,omitempty"`
	Waiters     []Waiter     `json:"waiters,omitempty"`
	// Drained are GPU UUIDs that take no new allocations.
	Drained []string `json:"drained,omitempty"`
	// Policy orders the waiters: FCFS (default), Priority, FairShare or
	// ShortestJobFirst.
	Policy string `json:"policy,omitempty"`
}

// CorruptStateError says the state file could not be read and was moved
// aside; the state starts empty.
type CorruptStateError struct {
	Path, Aside string
	Err         error
}

func (e *CorruptStateError) Error() string {
	return fmt.Sprintf("state %s was corrupt (%v): moved to %s, starting empty", e.Path, e.Err, e.Aside)
}

func (e *CorruptStateError) Unwrap() error { return e.Err }

// alive says whether the holder's process still runs (and is the same
// process): recorded in this boot (bootID, "" when unknown), and its pid's
// start time unchanged. A holder without a pid lives until released.
func (h Holder) alive(procRoot, bootID string) bool {
	if h.PID == 0 {
		return true
	}
	if h.BootID != "" && bootID != "" && h.BootID != bootID {
		return false
	}
	ps, err := sharing.ReadProcessStart(procRoot, h.PID)
	return err == nil && !ps.Zombie && ps.StartTime == h.StartTime
}

// HolderOf is the holder identity of a running process, in the boot that
// procRoot's sys/kernel/random/boot_id names (none recorded where it
// cannot be read).
func HolderOf(procRoot string, pid int) (Holder, error) {
	ps, err := sharing.ReadProcessStart(procRoot, pid)
	if err != nil {
		return Holder{}, fmt.Errorf("process %d: %w", pid, err)
	}
	boot, _ := checkpoint.BootID(procRoot)
	return Holder{PID: pid, StartTime: ps.StartTime, BootID: boot}, nil
}

// reap drops allocations and waiters whose process is gone, and
// allocations past their expiry; it returns what it dropped.
func (s *State) reap(procRoot, bootID string, now time.Time) (freed []Allocation, left []Waiter) {
	var keep []Allocation
	for _, a := range s.Allocations {
		if !a.Holder.alive(procRoot, bootID) || (a.Expires != nil && !now.Before(*a.Expires)) || a.incompleteMIG() {
			freed = append(freed, a)
			continue
		}
		keep = append(keep, a)
	}
	s.Allocations = keep
	var waiting []Waiter
	for _, w := range s.Waiters {
		if !w.Holder.alive(procRoot, bootID) {
			left = append(left, w)
			continue
		}
		waiting = append(waiting, w)
	}
	s.Waiters = waiting
	return freed, left
}

// incompleteMIG says a MIG device of the allocation was recorded but its
// creation never finished: the process granting it was killed. Every
// reader holds the lock, so no creation is under way when one looks. It
// is rolled back by placement; the request, still among the waiters, is
// granted again.
func (a Allocation) incompleteMIG() bool {
	for _, d := range a.Devices {
		if d.MIG != nil && d.MIG.UUID == "" {
			return true
		}
	}
	return false
}
