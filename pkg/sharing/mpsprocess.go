package sharing

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/mpsserver"
)

// ProcessServers run MPS servers as processes of the plugin, in their own
// session, adopted after a restart of the plugin process by their
// recorded identity. In a container they die with it: the chart uses
// PodServers. This is for gpudra without Kubernetes, and for tests.
type ProcessServers struct {
	// Root holds the servers' directories.
	Root    string
	Control MPSControl
	// ProcRoot is where process identities are read; empty: /proc.
	ProcRoot string
}

// serverFile records a server's devices in its directory, so that List
// finds it again.
const serverFile = "server.json"

func (p *ProcessServers) procRoot() string {
	if p.ProcRoot == "" {
		return "/proc"
	}
	return p.ProcRoot
}

func (p *ProcessServers) SharedShm() bool { return false }

func (p *ProcessServers) Describe(s MPSServer) string {
	return "process with pid file " + pidFile(s.Dir)
}

func (p *ProcessServers) Ensure(ctx context.Context, s MPSServer) (bool, error) {
	if _, ok := p.running(ctx, s.Dir); ok {
		return false, nil
	}
	for _, d := range []string{mpsserver.PipeSubdir, mpsserver.LogSubdir} {
		if err := os.MkdirAll(filepath.Join(s.Dir, d), 0o755); err != nil {
			return false, err
		}
	}
	b, err := json.Marshal(s.Devices)
	if err != nil {
		return false, err
	}
	if err := os.WriteFile(filepath.Join(s.Dir, serverFile), b, 0o644); err != nil {
		return false, err
	}
	env, err := s.ClientEnv()
	if err != nil {
		return false, err
	}
	pid, err := p.Control.Start(env)
	if err != nil {
		return false, fmt.Errorf("start the MPS control daemon: %w", err)
	}
	id, err := readProcIdentity(p.procRoot(), pid)
	if err == nil {
		err = writeIdentity(s.Dir, id)
	}
	if err != nil {
		_ = p.Control.Kill(pid) // just started by this process: still ours
		return false, fmt.Errorf("record the MPS daemon's identity: %w", err)
	}
	klog.FromContext(ctx).Info("MPS control daemon started", "server", s.Key, "devices", s.Devices, "pid", pid)
	return true, nil
}

// Stop asks the daemon to quit, then kills it if it does not. A pid that
// names another process now is left alone.
func (p *ProcessServers) Stop(ctx context.Context, s MPSServer) error {
	id, ok := p.running(ctx, s.Dir)
	if !ok {
		return nil
	}
	env, err := s.ClientEnv()
	if err == nil {
		qctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err = p.Control.Command(qctx, env, "quit")
		cancel()
	}
	// A daemon that did not take the command (not up yet, or hung) is not
	// waited for; one that did gets 5 s to exit.
	if err == nil {
		_ = wait.PollUntilContextTimeout(ctx, 20*time.Millisecond, 5*time.Second, true, func(context.Context) (bool, error) {
			return !p.Control.Alive(id.PID), nil
		})
	}
	if p.Control.Alive(id.PID) && id.check(p.procRoot()) == nil {
		klog.FromContext(ctx).Info("MPS daemon did not quit; killing it", "pid", id.PID)
		return p.Control.Kill(id.PID)
	}
	return nil
}

// List reads the servers' directories. A directory without a server file
// (an earlier release's per-claim daemon) is listed without devices, so
// that it is stopped and removed.
func (p *ProcessServers) List(context.Context) ([]MPSServer, error) {
	entries, err := os.ReadDir(p.Root)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []MPSServer
	for _, e := range entries {
		s := MPSServer{Key: e.Name(), Dir: filepath.Join(p.Root, e.Name())}
		if b, err := os.ReadFile(filepath.Join(s.Dir, serverFile)); err == nil {
			_ = json.Unmarshal(b, &s.Devices)
		}
		out = append(out, s)
	}
	return out, nil
}

// running reads the daemon's recorded identity and checks that the
// process is still that daemon. A pid file that names another process now
// (recycled, or another PID namespace's) is not trusted.
func (p *ProcessServers) running(ctx context.Context, dir string) (procIdentity, bool) {
	if p.Control == nil {
		return procIdentity{}, false
	}
	id, err := verifyIdentity(p.procRoot(), dir)
	if err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			klog.FromContext(ctx).Info("Recorded MPS daemon is not running", "dir", dir, "reason", err.Error())
		}
		return procIdentity{}, false
	}
	if !p.Control.Alive(id.PID) {
		return procIdentity{}, false
	}
	return id, true
}
