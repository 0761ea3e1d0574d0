package noderuntime

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"syscall"
	"time"
)

// On a real node a container is a PID namespace: when it stops, every
// process it started goes, even daemons that setsid or double-fork. The
// devcluster runs its "containers" (plugin instances, process pods) inside
// the test process, so it marks instead: every process a container starts
// carries ContainerMarkerEnv=<container id> in its environment, which
// every descendant inherits, and KillContainerProcesses finds them all by
// /proc/<pid>/environ.

// ContainerMarkerEnv is the environment variable that tells which
// devcluster container started a process.
const ContainerMarkerEnv = "GPUDRA_DEVCLUSTER_CONTAINER"

// ContainerMarker is the environment entry of the container with this id:
// a process pod's UID, or a plugin instance's ContainerID (nodeagent.PluginInstance).
func ContainerMarker(id string) string { return ContainerMarkerEnv + "=" + id }

// killRounds bounds the scans of KillContainerProcesses: a process may
// fork between a scan and its kill.
const (
	killRounds    = 50
	killRoundWait = 100 * time.Millisecond
)

// KillContainerProcesses SIGKILLs every process on the machine whose
// environment carries the marker of container id, and scans again until
// none is left: what a container's end does to its PID namespace. It
// returns how many processes it killed; processes it cannot read (another
// user's) are skipped. Zombies (killed children not yet waited for by the
// test) have an empty environ and do not count as left.
func KillContainerProcesses(id string) (int, error) {
	if id == "" {
		return 0, errors.New("kill container processes: empty container id")
	}
	killed := map[int]bool{}
	// Done after two empty scans in a row: a process between two execs
	// reads with an empty environment for a moment, and one scan may miss it.
	empty := 0
	for round := 0; round < killRounds; round++ {
		pids, err := ContainerProcesses(id)
		if err != nil {
			return len(killed), err
		}
		if len(pids) == 0 {
			if empty++; empty == 2 {
				return len(killed), nil
			}
			time.Sleep(killRoundWait)
			continue
		}
		empty = 0
		for _, pid := range pids {
			if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
				return len(killed), fmt.Errorf("kill process %d of container %s: %w", pid, id, err)
			}
			killed[pid] = true
		}
		time.Sleep(killRoundWait)
	}
	pids, _ := ContainerProcesses(id)
	return len(killed), fmt.Errorf("container %s: processes %v still alive after %d rounds of SIGKILL", id, pids, killRounds)
}

// ContainerProcesses lists the processes whose environment holds exactly
// the marker of container id (see ContainerMarker), this process excepted.
func ContainerProcesses(id string) ([]int, error) {
	marker := []byte(ContainerMarker(id))
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, fmt.Errorf("list processes: %w", err)
	}
	self := os.Getpid()
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		environ, err := os.ReadFile("/proc/" + e.Name() + "/environ")
		if err != nil {
			continue // gone, or not ours to read
		}
		for _, entry := range bytes.Split(environ, []byte{0}) {
			if bytes.Equal(entry, marker) {
				pids = append(pids, pid)
				break
			}
		}
	}
	return pids, nil
}
