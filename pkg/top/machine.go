package top

import (
	"cmp"
	"os"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/gpudra/gpudra/pkg/local"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/telemetry"
)

// FromMachine is the snapshot of one telemetry read of this machine:
// samples from the backend (nvdevice.TelemetryReader), state gpudra
// local's (nil: not read, or none), userOf the owner of a PID ("" when it
// cannot be told).
func FromMachine(samples []nvdevice.TelemetrySample, node, source string, state *local.State, userOf func(pid int) string, at time.Time) *Snapshot {
	s := &Snapshot{Node: node, Source: source, At: at}
	for i := range samples {
		t := &samples[i]
		d := Device{Name: telemetry.DeviceName(t), UUID: t.UUID, GPU: t.ParentUUID, Profile: t.MigProfile, Model: t.ProductName,
			Utilization: reading(t.GPUUtilization), SMActive: reading(t.SMActive),
			MemoryUsedBytes: reading(t.FramebufferUsedBytes), MemoryTotalBytes: reading(t.FramebufferTotalBytes),
			PowerWatts: reading(t.PowerWatts), TemperatureC: reading(t.TemperatureCelsius), ProcessesRead: t.ProcessesRead}
		for _, p := range t.Processes {
			proc := Process{PID: p.PID, MemoryBytes: reading(p.UsedMemoryBytes), SMUtilization: reading(p.SMUtilization)}
			if userOf != nil {
				proc.User = userOf(p.PID)
			}
			d.Processes = append(d.Processes, proc)
		}
		slices.SortFunc(d.Processes, func(a, b Process) int { return cmp.Compare(a.PID, b.PID) })
		s.Devices = append(s.Devices, d)
	}
	slices.SortFunc(s.Devices, compareDevices)
	var unread []string
	for _, d := range s.Devices {
		if !d.ProcessesRead {
			unread = append(unread, d.Name)
		}
	}
	if len(unread) > 0 {
		s.Notes = append(s.Notes, "processes not readable on "+strings.Join(unread, ", "))
	}
	if state != nil {
		attachLocal(s, state)
	}
	return s
}

// attachLocal marks each device with the local allocations that hold it
// (by UUID), and a GPU as not free while one of its MIG devices is held.
func attachLocal(s *Snapshot, state *local.State) {
	byUUID := map[string][]Holder{}
	for _, a := range state.Allocations {
		for _, d := range a.Devices {
			byUUID[d.UUID] = append(byUUID[d.UUID], Holder{Local: a.Name, User: a.User, PID: a.Holder.PID})
		}
	}
	heldGPUs := map[string]bool{}
	for _, d := range s.Devices {
		if d.GPU != "" && len(byUUID[d.UUID]) > 0 {
			heldGPUs[d.GPU] = true
		}
	}
	for i := range s.Devices {
		d := &s.Devices[i]
		d.Holders = byUUID[d.UUID]
		free := len(d.Holders) == 0 && !heldGPUs[d.UUID]
		d.Free = &free
	}
	for _, w := range state.Waiters {
		s.Waiting = append(s.Waiting, LocalWaiter{Name: w.Name, User: w.User, QueuedAt: w.QueuedAt, Error: w.Error})
	}
}

func reading(r nvdevice.Reading) *float64 {
	if !r.Supported {
		return nil
	}
	return ptr(r.Value)
}

// ReadLocalState reads gpudra local's state without its lock and
// without changing it (top only looks: the holders it would clean up stay
// for gpudra local to clean): local.ReadState. nil, nil: local was never
// used here; a state with an error: some file could not be read.
func ReadLocalState(stateDir string) (*local.State, error) { return local.ReadState(stateDir) }

// ProcUser returns the owner of procRoot/<pid> (the process's real user),
// by name where the user database knows it, else the numeric ID; "" when
// the entry cannot be read (the process ended, or another PID namespace).
func ProcUser(procRoot string) func(pid int) string {
	names := map[uint32]string{}
	return func(pid int) string {
		fi, err := os.Stat(filepath.Join(procRoot, strconv.Itoa(pid)))
		if err != nil {
			return ""
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return ""
		}
		if n, ok := names[st.Uid]; ok {
			return n
		}
		n := strconv.FormatUint(uint64(st.Uid), 10)
		if u, err := user.LookupId(n); err == nil {
			n = u.Username
		}
		names[st.Uid] = n
		return n
	}
}
