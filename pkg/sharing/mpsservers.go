package sharing

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/gpudra/gpudra/pkg/mpsserver"
)

// MPSServer is one MPS control daemon and the devices it serves: one GPU
// (or MIG device) for every MPS claim on it, or the device set of a claim
// that spans several. NVIDIA documents one MPS control daemon per GPU, so
// claims sharing a GPU share its server; each claim's limits are set in its
// clients' environment.
type MPSServer struct {
	// Key names the server: derived from its devices, the same in every
	// plugin instance and release.
	Key string
	// Devices are the UUIDs the server serves, sorted.
	Devices []string
	// Dir is the server's directory on the host (mpsserver's layout).
	Dir string
}

// MPSServerFor is the server of a set of devices under root (the plugin's
// sharing/mps directory).
func MPSServerFor(root string, uuids []string) MPSServer {
	devs := slices.Clone(uuids)
	slices.Sort(devs)
	devs = slices.Compact(devs)
	sum := sha256.Sum256([]byte(strings.Join(devs, ",")))
	key := "mps-" + hex.EncodeToString(sum[:6])
	return MPSServer{Key: key, Devices: devs, Dir: filepath.Join(root, key)}
}

// Config is how the server's own process runs it.
func (s MPSServer) Config() mpsserver.Config {
	return mpsserver.Config{Dir: s.Dir, Devices: s.Devices}
}

// shortLinks is where ClientEnv makes its short links to pipe directories
// whose own path is too long; a variable for tests.
var shortLinks = filepath.Join(os.TempDir(), "gpudra-mps")

// ClientEnv is the environment of a control daemon or control client that
// this process runs for the server: Config().Env(), with the pipe directory
// reached through a short symbolic link (shortLinks/<key>) when its own path
// is too long for the daemon's sockets (mpsserver.CheckPipeDir: a kubelet
// directory deep in the file system). The length limit is the path given
// to bind and connect; the link's target can be as long as it likes.
func (s MPSServer) ClientEnv() ([]string, error) {
	env := s.Config().Env()
	pipe := s.PipeDir()
	if mpsserver.CheckPipeDir(pipe) == nil {
		return env, nil
	}
	link := filepath.Join(shortLinks, s.Key)
	if err := mpsserver.CheckPipeDir(link); err != nil {
		return nil, fmt.Errorf("MPS server %s: %w; and the short link %s is too long too", s.Key, mpsserver.CheckPipeDir(pipe), link)
	}
	if target, err := os.Readlink(link); err != nil || target != pipe {
		if err := os.MkdirAll(shortLinks, 0o755); err != nil {
			return nil, fmt.Errorf("MPS server %s: short link to its pipe directory: %w", s.Key, err)
		}
		_ = os.Remove(link)
		if err := os.Symlink(pipe, link); err != nil {
			return nil, fmt.Errorf("MPS server %s: short link to its pipe directory: %w", s.Key, err)
		}
	}
	for i, e := range env {
		if strings.HasPrefix(e, "CUDA_MPS_PIPE_DIRECTORY=") {
			env[i] = "CUDA_MPS_PIPE_DIRECTORY=" + link
		}
	}
	return env, nil
}

// PipeDir is the daemon's pipe directory, mounted into every client.
func (s MPSServer) PipeDir() string { return filepath.Join(s.Dir, mpsserver.PipeSubdir) }

// ShmDir is the /dev/shm shared by the server and its clients.
func (s MPSServer) ShmDir() string { return filepath.Join(s.Dir, mpsserver.ShmSubdir) }

// MPSServers start and stop MPS servers on this node: as pods of their own
// (PodServers, what the chart runs: they outlive the plugin's container),
// or as processes of the plugin (ProcessServers: without Kubernetes, and
// in tests).
type MPSServers interface {
	// Ensure starts the server unless it exists; started says whether it
	// had to. It does not wait for the daemon to answer.
	Ensure(ctx context.Context, s MPSServer) (started bool, err error)
	// Stop stops the server and waits until it is gone.
	Stop(ctx context.Context, s MPSServer) error
	// List returns the servers that exist on this node.
	List(ctx context.Context) ([]MPSServer, error)
	// SharedShm says whether the server's /dev/shm is ShmDir, to be
	// mounted at /dev/shm in its clients.
	SharedShm() bool
	// Describe names where the server runs, for messages.
	Describe(s MPSServer) string
}
