package realnode

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/gpudra/gpudra/devcluster/noderuntime"
)

// What the harness reads of a running node: its pods' logs, containerd's
// tasks, and its pod network.

// PodLogDir is the kubelet's podLogsDir: <namespace>_<pod>_<uid>/<container>/<n>.log.
func (n *Node) PodLogDir() string { return filepath.Join(n.Dir, "pod-logs") }

// ContainerLog is the end (lines lines) of the newest log of a pod's
// container, as the kubelet keeps it in its podLogsDir.
func (n *Node) ContainerLog(namespace, pod, container string, lines int) string {
	files, _ := filepath.Glob(filepath.Join(n.PodLogDir(), namespace+"_"+pod+"_*", container, "*.log"))
	if len(files) == 0 {
		return "no log"
	}
	sort.Slice(files, func(i, j int) bool {
		a, _ := os.Stat(files[i])
		b, _ := os.Stat(files[j])
		return a != nil && b != nil && a.ModTime().Before(b.ModTime())
	})
	// The newest log may be of a container just restarted: the one
	// before it says how the last one ended.
	out := tail(files[len(files)-1], lines)
	if len(files) > 1 {
		out = tail(files[len(files)-2], lines) + "\n" + out
	}
	return out
}

// tail is the last n lines of a file.
func tail(file string, n int) string {
	b, err := os.ReadFile(file)
	if err != nil {
		return err.Error()
	}
	return noderuntime.LastLines(string(b), n)
}

// PodNetworkClient is an HTTP client whose connections are made inside
// containerd's network namespace, where the pods' addresses are: what a
// Prometheus on the pod network would scrape.
func (n *Node) PodNetworkClient() *http.Client {
	netns := noderuntime.NetnsOf(n.containerd.Process.Pid)
	// No keep-alive: each scrape's connection is closed with it.
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true,
		DialContext: func(ctx context.Context, _, addr string) (net.Conn, error) {
			return noderuntime.DialInNetns(ctx, netns, addr)
		}}}
}

// TaskPIDs are the host PIDs of containerd's running tasks in the CRI
// plugin's namespace, by container ID (ctr tasks ls).
func (n *Node) TaskPIDs(ctx context.Context) (map[string]int, error) {
	out, err := exec.CommandContext(ctx, n.opts.Binaries.Ctr, "--address", n.ContainerdSocket(), "--namespace", "k8s.io", "tasks", "ls").Output()
	if err != nil {
		return nil, fmt.Errorf("real node %s: ctr tasks ls: %w", n.Name, err)
	}
	pids := map[string]int{}
	for _, line := range strings.Split(string(out), "\n")[1:] {
		f := strings.Fields(line)
		if len(f) < 3 || f[2] != "RUNNING" {
			continue
		}
		if pid, err := strconv.Atoi(f[1]); err == nil {
			pids[f[0]] = pid
		}
	}
	return pids, nil
}

// Netns is containerd's network namespace, where the pods' addresses are.
func (n *Node) Netns() string { return noderuntime.NetnsOf(n.containerd.Process.Pid) }
