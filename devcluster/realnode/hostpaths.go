package realnode

import (
	"errors"
	"os"
	"path/filepath"
)

// The machine's own directories a real node's kubelet writes to, whatever
// its --root-dir: its device manager's (its socket, the plugins' sockets,
// its checkpoint) and the container log links. What the node added there
// goes with it: a checkpoint left behind would make any gpudra plugin on
// this machine that reads the default path (DRA mode refuses to start
// while a device plugin holds GPUs) refuse to start.
var kubeletHostDirs = []string{KubeletDevicePluginDir, "/var/log/containers"}

// hostDirSnapshot is what a directory held before the node started.
type hostDirSnapshot struct {
	dir string
	// made lists the directory and the parents that did not exist.
	made   []string
	before map[string]bool
}

func snapshotHostDir(dir string) hostDirSnapshot {
	s := hostDirSnapshot{dir: dir, before: map[string]bool{}}
	for d := dir; d != "/" && d != "."; d = filepath.Dir(d) {
		if _, err := os.Stat(d); errors.Is(err, os.ErrNotExist) {
			s.made = append(s.made, d)
		}
	}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		s.before[e.Name()] = true
	}
	return s
}

// restore removes what the node added: the entries that were not there,
// then the directories it made, deepest first, if empty.
func (s hostDirSnapshot) restore() {
	entries, _ := os.ReadDir(s.dir)
	for _, e := range entries {
		if !s.before[e.Name()] {
			_ = os.Remove(filepath.Join(s.dir, e.Name()))
		}
	}
	for _, d := range s.made {
		_ = os.Remove(d) // only if empty
	}
}
