package realnode

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/gpudra/gpudra/pkg/probe"
)

// ErrNoReport says a container's log holds no probe report yet.
var ErrNoReport = errors.New("no probe report in the container's log yet")

// ProbeReport is what the probe in a container of the pod reported from
// inside: its first report in the container's current log, which the
// kubelet keeps under PodLogDir in the CRI log format (time, stream, P for
// a partial line or F for a full one, text). The probe image's container
// writes it once it starts; ErrNoReport until then.
func (n *Node) ProbeReport(namespace, pod, uid, container string) (*probe.Report, error) {
	dir := filepath.Join(n.PodLogDir(), namespace+"_"+pod+"_"+uid, container)
	files, _ := filepath.Glob(filepath.Join(dir, "*.log"))
	if len(files) == 0 {
		return nil, fmt.Errorf("container %s of pod %s/%s: %w (no log in %s)", container, namespace, pod, ErrNoReport, dir)
	}
	newest := files[0]
	for _, f := range files[1:] {
		a, errA := os.Stat(f)
		b, errB := os.Stat(newest)
		if errA == nil && errB == nil && a.ModTime().After(b.ModTime()) {
			newest = f
		}
	}
	f, err := os.Open(newest)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	r, err := firstReport(f)
	if err != nil {
		return nil, fmt.Errorf("container %s of pod %s/%s, %s: %w", container, namespace, pod, newest, err)
	}
	return r, nil
}

// firstReport finds the first stdout line of a CRI log that is a probe
// report.
func firstReport(f *os.File) (*probe.Report, error) {
	var line strings.Builder
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64*1024), 4*1024*1024)
	for sc.Scan() {
		parts := strings.SplitN(sc.Text(), " ", 4)
		if len(parts) < 4 || parts[1] != "stdout" {
			continue
		}
		line.WriteString(parts[3])
		if parts[2] != "F" {
			continue
		}
		var r probe.Report
		if json.Unmarshal([]byte(line.String()), &r) == nil && r.PID != 0 {
			return &r, nil
		}
		line.Reset()
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	return nil, ErrNoReport
}
