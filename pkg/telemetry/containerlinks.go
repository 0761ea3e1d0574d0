package telemetry

import (
	"fmt"
	"os"
	"strings"
)

// The kubelet names each container it runs in its log directory
// (/var/log/containers): a symlink "<pod>_<namespace>_<container>-<id>.log"
// for every container instance whose log it keeps, the ID being the
// runtime's (what the container's cgroup is named after). That is the
// node's own record of which container ID is which pod's container, kept by
// the kubelet and read without an API server. Only the names are read: the
// links point into /var/log/pods, which is neither followed nor mounted.
// Pod names, namespaces and container names hold no "_" (DNS names), so the
// name splits in three without doubt; the container's name then tells where
// its ID starts.

// containerLinks are the links of one log directory.
type containerLinks struct {
	// OK says whether the directory could be read: without it no container
	// ID resolves.
	OK bool
	// rests are, per namespace and pod, the "<container>-<id>" part of
	// each link.
	rests map[podKey][]string
	// ids are every possible ID suffix ("-<id>.log") of every link: an ID
	// that is none of them has no link at all.
	ids map[string]bool
}

type podKey struct{ Namespace, Pod string }

// parseContainerLinks indexes the names of a log directory's entries;
// names of another shape are passed over.
func parseContainerLinks(names []string) containerLinks {
	l := containerLinks{OK: true, rests: map[podKey][]string{}, ids: map[string]bool{}}
	for _, n := range names {
		base, ok := strings.CutSuffix(n, ".log")
		if !ok {
			continue
		}
		parts := strings.Split(base, "_")
		if len(parts) != 3 || parts[0] == "" || parts[1] == "" {
			continue
		}
		rest := parts[2]
		k := podKey{Namespace: parts[1], Pod: parts[0]}
		l.rests[k] = append(l.rests[k], rest)
		for i := range len(rest) {
			if rest[i] == '-' && i+1 < len(rest) {
				l.ids[rest[i+1:]] = true
			}
		}
	}
	return l
}

// readContainerLinks lists dir's link names.
func readContainerLinks(dir string) (containerLinks, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return containerLinks{}, fmt.Errorf("list the kubelet's container log links in %s: %w", dir, err)
	}
	names := make([]string, 0, len(entries))
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return parseContainerLinks(names), nil
}

// has says whether c has a link with the ID id.
func (l containerLinks) has(c containerKey, id string) bool {
	for _, rest := range l.rests[podKey{Namespace: c.Namespace, Pod: c.Pod}] {
		if rest == c.Container+"-"+id {
			return true
		}
	}
	return false
}

// known says whether any link carries the ID id.
func (l containerLinks) known(id string) bool { return l.ids[id] }
