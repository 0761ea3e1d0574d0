package local

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
	"github.com/gpudra/gpudra/pkg/mpsserver"
	"github.com/gpudra/gpudra/pkg/sharing"
)

// ShareMPS shares a GPU between MPS clients of one control daemon.
const ShareMPS = "mps"

// MPSLimits are an MPS client's limits, set in its environment.
type MPSLimits struct {
	ThreadPercentage int32 `json:"threadPercentage,omitempty"`
	PinnedMiB        int64 `json:"pinnedMiB,omitempty"`
}

// SharingOf reads the sharing a claim's devices ask for from its opaque
// GpuConfig (gpu.gpudra.dev), as the kubelet plugin does: "" (Exclusive),
// time-slicing or mps with its limits.
func SharingOf(dc resourceapi.DeviceClaim) (string, *MPSLimits, error) {
	share, limits := "", (*MPSLimits)(nil)
	for i, c := range dc.Config {
		if c.Opaque == nil || c.Opaque.Driver != "gpu.gpudra.dev" {
			continue
		}
		cfg, err := gpuapi.Decode(c.Opaque.Parameters.Raw)
		if err != nil {
			return "", nil, fmt.Errorf("devices.config[%d].opaque.parameters: %w", i, err)
		}
		if cfg.Sharing == nil {
			continue
		}
		switch cfg.Sharing.Strategy {
		case gpuapi.TimeSlicing:
			share = ShareTimeSlicing
		case gpuapi.MPS:
			share, limits = ShareMPS, &MPSLimits{}
			if m := cfg.Sharing.MPS; m != nil {
				if m.ActiveThreadPercentage != nil {
					limits.ThreadPercentage = *m.ActiveThreadPercentage
				}
				if m.PinnedMemoryLimit != nil {
					limits.PinnedMiB = (m.PinnedMemoryLimit.Value() + (1 << 20) - 1) >> 20
				}
			}
		default:
			share, limits = "", nil
		}
	}
	return share, limits, nil
}

// sharesWith says whether an allocation's devices are free for r: both
// share the same way.
func sharesWith(r Request, a Allocation) bool {
	return r.Share != "" && r.Share == a.Share
}

// startMPS starts (or finds) the MPS control daemon of an MPS allocation's
// GPU: one per GPU, for every MPS client of it.
func (l *Local) startMPS(ctx context.Context, a *Allocation) error {
	if a.Share != ShareMPS {
		return nil
	}
	if l.cfg.MPS == nil {
		return errors.New("this machine runs no MPS control daemon (no --mps-control-binary)")
	}
	server := l.mpsServer(a.Devices[0].UUID)
	if err := groupDirs(filepath.Dir(server.Dir), server.Dir, server.PipeDir(), filepath.Join(server.Dir, mpsserver.LogSubdir)); err != nil {
		return fmt.Errorf("MPS server for %s: %w", a.Devices[0].UUID, err)
	}
	// The daemon runs as whoever's command starts it, for every group
	// member's clients: what it creates (its pipes, its log) is
	// group-writable, and so are the files recorded beside it, which the
	// next group member to start a daemon there rewrites. The umask is the
	// process's: gpudra local is one command per process.
	old := unix.Umask(0o002)
	started, err := l.cfg.MPS.Ensure(ctx, server)
	unix.Umask(old)
	if err != nil {
		return fmt.Errorf("MPS server for %s: %w", a.Devices[0].UUID, err)
	}
	if started {
		groupFiles(server.Dir)
	}
	// Its clients start at once: wait until it answers, as the kubelet
	// plugin does before it hands a claim to a container.
	var last error
	err = wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 10*time.Second, true, func(ctx context.Context) (bool, error) {
		last = l.cfg.MPS.Control.Command(ctx, server.Config().Env(), "get_server_list")
		return last == nil, nil
	})
	if err != nil {
		return fmt.Errorf("MPS server for %s does not answer: %w", a.Devices[0].UUID, errors.Join(err, last))
	}
	a.MPSDir = server.Dir
	return nil
}

// groupDirs creates the directories, each in the one before, group-writable
// and setgid (as the state directory is), whatever the umask: every group
// member's command writes and removes in them. One that exists is made so
// by its owner; anyone else finds it as its owner left it, and fails on it
// with its own error.
func groupDirs(dirs ...string) error {
	const mode = 0o775 | os.ModeSetgid
	for _, d := range dirs {
		err := os.Mkdir(d, mode)
		if err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
		if err == nil {
			// The group of the directory above (the state directory's),
			// also where that one is not setgid: the creator is in it.
			if up, err := os.Stat(filepath.Dir(d)); err == nil {
				_ = os.Chown(d, -1, int(up.Sys().(*syscall.Stat_t).Gid))
			}
		}
		fi, err := os.Stat(d)
		if err != nil {
			return err
		}
		if fi.Mode()&mode != mode {
			if err := os.Chmod(d, fi.Mode().Perm()|mode); err != nil {
				return fmt.Errorf("%s is not group-writable (mode %v) and cannot be made so: %w", d, fi.Mode(), err)
			}
		}
	}
	return nil
}

// groupFiles makes the files directly in dir group-writable (those of
// this process's user).
func groupFiles(dir string) {
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if e.Type().IsRegular() {
			_ = os.Chmod(filepath.Join(dir, e.Name()), 0o664)
		}
	}
}

func (l *Local) mpsServer(uuid string) sharing.MPSServer {
	return sharing.MPSServerFor(filepath.Join(l.cfg.StateDir, "mps"), []string{uuid})
}

// stopMPS stops the daemon of an ended MPS allocation's GPU when no MPS
// allocation is left on it.
func (l *Local) stopMPS(ctx context.Context, ended Allocation, left []Allocation) {
	if ended.Share != ShareMPS || ended.MPSDir == "" || l.cfg.MPS == nil {
		return
	}
	if slices.ContainsFunc(left, func(a Allocation) bool { return a.MPSDir == ended.MPSDir }) {
		return
	}
	server := l.mpsServer(ended.Devices[0].UUID)
	if err := l.cfg.MPS.Stop(ctx, server); err != nil {
		klog.FromContext(ctx).Error(err, "Stop the MPS control daemon", "gpu", ended.Devices[0].UUID)
		return
	}
	_ = os.RemoveAll(server.Dir)
}

// mpsEnv is an MPS client's environment: its daemon's pipe directory and
// its limits.
func mpsEnv(a Allocation) []string {
	if a.MPSDir == "" {
		return nil
	}
	s := sharing.MPSServer{Dir: a.MPSDir}
	env := []string{"CUDA_MPS_PIPE_DIRECTORY=" + s.PipeDir()}
	if m := a.MPS; m != nil {
		if m.ThreadPercentage > 0 {
			env = append(env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="+strconv.Itoa(int(m.ThreadPercentage)))
		}
		if m.PinnedMiB > 0 {
			env = append(env, fmt.Sprintf("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=%dM", m.PinnedMiB))
		}
	}
	return env
}
