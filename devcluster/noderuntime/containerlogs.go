package noderuntime

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"

	v1 "k8s.io/api/core/v1"
)

// ContainerLog is a container's log file and the link to it, where the
// kubelet keeps them (below a node's /var/log): the file in
// pods/<namespace>_<pod>_<uid>/<container>/0.log, the link
// containers/<pod>_<namespace>_<container>-<container id>.log. The link
// is how node agents (log shippers, and gpudra's telemetry attribution,
// pkg/telemetry) tell a container ID's pod, namespace and container
// without the API server. The file stays empty: the container's output
// is in its bundle.
type ContainerLog struct {
	// PodDir is the pod's directory, File the container's log in it,
	// Link the container's link to File.
	PodDir, File, Link string
}

// ContainerLogPaths are the log paths of a container with this ID, below
// logRoot (a node's /var/log).
func ContainerLogPaths(logRoot string, pod *v1.Pod, container, id string) ContainerLog {
	podDir := filepath.Join(logRoot, "pods", fmt.Sprintf("%s_%s_%s", pod.Namespace, pod.Name, pod.UID))
	return ContainerLog{
		PodDir: podDir,
		File:   filepath.Join(podDir, container, "0.log"),
		Link:   filepath.Join(logRoot, "containers", fmt.Sprintf("%s_%s_%s-%s.log", pod.Name, pod.Namespace, container, id)),
	}
}

// Create makes the log file (empty) and the link to it; a link of an
// earlier try is replaced.
func (l ContainerLog) Create() error {
	for _, d := range []string{filepath.Dir(l.File), filepath.Dir(l.Link)} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("container log: %w", err)
		}
	}
	f, err := os.OpenFile(l.File, os.O_CREATE|os.O_WRONLY, 0o640)
	if err != nil {
		return fmt.Errorf("container log: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("container log: %w", err)
	}
	if err := os.Remove(l.Link); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("container log link: %w", err)
	}
	if err := os.Symlink(l.File, l.Link); err != nil {
		return fmt.Errorf("container log link: %w", err)
	}
	return nil
}

// Remove deletes the link and the file, and the container's and the
// pod's directories once empty (another container's log keeps the pod's);
// what is gone already is no error.
func (l ContainerLog) Remove() error {
	var errs []error
	for _, p := range []string{l.Link, l.File} {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	// Not RemoveAll: rmdir fails on a directory still in use, which is
	// what should stay.
	for _, d := range []string{filepath.Dir(l.File), l.PodDir} {
		if err := os.Remove(d); err != nil && !errors.Is(err, os.ErrNotExist) && !isNotEmpty(err) {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("container log: %w", err)
	}
	return nil
}

func isNotEmpty(err error) bool {
	return errors.Is(err, syscall.ENOTEMPTY) || errors.Is(err, syscall.EEXIST)
}
