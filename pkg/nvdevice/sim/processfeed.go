package sim

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"k8s.io/klog/v2"
)

// ProcessFeedFile, in a simulated driver root, lists the processes that
// run on the machine's devices when the machine lives in another process
// than the one that starts them: devcluster's real node, where the
// plugin's container holds the machine and containerd runs the workloads'
// containers, writes it for each container that declares a load (the
// host PIDs of their processes, which the plugin reads /proc of). The
// machine reads it again before each telemetry sample when it has
// changed; what it listed before and no longer does is taken off. A
// machine with no simulated driver root has none.
const ProcessFeedFile = "sim-processes.json"

// FedProcess is one line of the feed: a process on a GPU or MIG device.
type FedProcess struct {
	Device      string  `json:"device"`
	PID         int     `json:"pid"`
	SMShare     float64 `json:"smShare"`
	MemoryBytes uint64  `json:"memoryBytes"`
}

// WriteProcessFeed writes the feed into a simulated driver root
// atomically (a reader never sees half of it).
func WriteProcessFeed(driverRoot string, procs []FedProcess) error {
	data, err := json.Marshal(procs)
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(driverRoot, "."+ProcessFeedFile+".*")
	if err != nil {
		return err
	}
	if _, err := tmp.Write(data); err != nil {
		_ = tmp.Close()
		_ = os.Remove(tmp.Name())
		return err
	}
	if err := tmp.Chmod(0o644); err != nil {
		_ = tmp.Close()
		_ = os.Remove(tmp.Name())
		return err
	}
	if err := tmp.Close(); err != nil {
		_ = os.Remove(tmp.Name())
		return err
	}
	return os.Rename(tmp.Name(), filepath.Join(driverRoot, ProcessFeedFile))
}

// processFeed is what the machine last read of its feed.
type processFeed struct {
	// read serializes readers: the feed's PIDs are ended and started as
	// one step.
	read sync.Mutex
	// file is the feed file last looked at (WriteProcessFeed renames a
	// new file in, so os.SameFile tells a new feed apart), nil if none.
	file os.FileInfo
	pids map[int]bool
}

// readProcessFeed applies the feed if it changed since the last read. The
// caller does not hold m.mu. A feed that cannot be read or parsed is
// logged once and leaves the processes as they were.
func (m *Machine) readProcessFeed() {
	m.feed.read.Lock()
	defer m.feed.read.Unlock()
	m.mu.Lock()
	root := m.driverRoot
	m.mu.Unlock()
	if root == "" {
		return
	}
	file := filepath.Join(root, ProcessFeedFile)
	st, err := os.Stat(file)
	switch {
	case errors.Is(err, os.ErrNotExist):
		st = nil
	case err != nil:
		klog.Background().Error(err, "Simulated machine: the process feed is unreadable", "file", file)
		return
	}
	last := m.feed.file
	if (st == nil && last == nil) || (st != nil && last != nil && os.SameFile(st, last) && st.ModTime().Equal(last.ModTime()) && st.Size() == last.Size()) {
		return
	}
	// Looked at: a broken feed is logged once, not at every sample.
	m.feed.file = st
	var procs []FedProcess
	if st != nil {
		data, err := os.ReadFile(file)
		if err == nil {
			err = json.Unmarshal(data, &procs)
		}
		if err != nil {
			klog.Background().Error(err, "Simulated machine: the process feed is unreadable; its processes are left as they were", "file", file)
			return
		}
	}
	for pid := range m.feed.pids {
		m.EndProcess(pid)
	}
	pids := map[int]bool{}
	for _, p := range procs {
		if err := m.StartProcess(p.Device, p.PID, p.SMShare, p.MemoryBytes); err != nil {
			klog.Background().Error(fmt.Errorf("%s: %w", file, err), "Simulated machine: a fed process is left out")
			continue
		}
		pids[p.PID] = true
	}
	m.feed.pids = pids
}
