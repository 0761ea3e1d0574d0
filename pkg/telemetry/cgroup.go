package telemetry

import (
	"strings"
)

// A GPU process is mapped to its container through what the kernel says of
// it: its cgroup. Every container runtime the kubelet drives names the
// container's cgroup after the container's ID, in one of a few shapes,
// under the kubelet's "kubepods" hierarchy:
//
//	systemd driver:  .../kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope
//	                 .../crio-<id>.scope, .../docker-<id>.scope (cri-dockerd)
//	crun (CRI-O):    .../crio-<id>.scope/container (the process one level down)
//	cgroupfs driver: /kubepods/<qos>/pod<uid>/<id> (or /kubepods/pod<uid>/<id>)
//
// on cgroup v1 (one line per hierarchy), v2 ("0::<path>") or both (hybrid
// hosts), and, read from a container with a cgroup namespace of its own,
// relative to it ("/../../kubepods.slice/..."). The parser tries every
// element of every line and leaves the choice to the kubelet's log links
// (containerlinks.go): an ID only counts when a link of a container that
// holds the device carries it.

// scopePrefixes start a systemd scope named after a container ID.
var scopePrefixes = []string{"cri-containerd-", "crio-", "docker-"}

// cgroupInfo is what a process's /proc/<pid>/cgroup says of its container.
type cgroupInfo struct {
	// IDs are the container IDs that the cgroup paths name, in the order
	// found, without duplicates.
	IDs []string
	// InKubepods says that a path is under the kubelet's hierarchy: a
	// process there without an ID is a pod's whose runtime the parser does
	// not know, never a host process.
	InKubepods bool
}

// parseCgroup reads the container IDs in the contents of a /proc/<pid>/cgroup
// file.
func parseCgroup(data string) cgroupInfo {
	var info cgroupInfo
	add := func(id string) {
		if id == "" {
			return
		}
		for _, have := range info.IDs {
			if have == id {
				return
			}
		}
		info.IDs = append(info.IDs, id)
	}
	for line := range strings.SplitSeq(data, "\n") {
		// hierarchy-ID:controllers:path; the path may hold colons.
		parts := strings.SplitN(strings.TrimSpace(line), ":", 3)
		if len(parts) != 3 {
			continue
		}
		elems := strings.Split(parts[2], "/")
		for i, e := range elems {
			if strings.HasPrefix(e, "kubepods") {
				info.InKubepods = true
			}
			if id, ok := scopeID(e); ok {
				add(id)
				continue
			}
			// cgroupfs: the element after the pod's is the container's.
			if isCgroupfsPod(e) && i+1 < len(elems) {
				if next := elems[i+1]; !strings.HasSuffix(next, ".scope") && !strings.HasSuffix(next, ".slice") {
					add(next)
				}
				continue
			}
			if isHexID(e) {
				add(e)
			}
		}
	}
	return info
}

// scopeID is the container ID of a runtime's systemd scope, e.g.
// "cri-containerd-<id>.scope". CRI-O's conmon scope ("crio-conmon-<id>")
// is the monitor's, not the container's.
func scopeID(e string) (string, bool) {
	rest, ok := strings.CutSuffix(e, ".scope")
	if !ok || strings.HasPrefix(rest, "crio-conmon-") {
		return "", false
	}
	for _, p := range scopePrefixes {
		if id, ok := strings.CutPrefix(rest, p); ok && id != "" {
			return id, true
		}
	}
	return "", false
}

// isCgroupfsPod says whether a path element is a pod's cgroup under the
// cgroupfs driver: "pod" and the pod's UID.
func isCgroupfsPod(e string) bool {
	uid, ok := strings.CutPrefix(e, "pod")
	return ok && len(uid) == 36 && strings.Count(uid, "-") == 4
}

// isHexID says whether a path element is a bare 64-digit hex container ID
// (containerd's, CRI-O's and Docker's, wherever a runtime nests it).
func isHexID(e string) bool {
	if len(e) != 64 {
		return false
	}
	for _, r := range e {
		if (r < '0' || r > '9') && (r < 'a' || r > 'f') {
			return false
		}
	}
	return true
}
