package sharing

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/mpsserver"
)

// TestClientEnvShortensLongPipeDirectories: the control daemon exits at once,
// status 1 and without a word, when its sockets do not fit in a unix socket
// path (seen on an H200 under gpu-smoke's devcluster, whose kubelet
// directory is deep). A control daemon or client this process runs reaches
// a pipe directory that is too long through a short link to it; a short one
// is used as it is.
func TestClientEnvShortensLongPipeDirectories(t *testing.T) {
	links := t.TempDir()
	old := shortLinks
	shortLinks = links
	t.Cleanup(func() { shortLinks = old })

	short := MPSServerFor("/var/lib/kubelet/plugins/gpu.gpudra.dev/sharing/mps", []string{"GPU-a"})
	env, err := short.ClientEnv()
	require.NoError(t, err)
	assert.Equal(t, short.Config().Env(), env, "the default kubelet directory fits")

	deep := filepath.Join(t.TempDir(), strings.Repeat("d", 60), "plugins/gpu.gpudra.dev/sharing/mps")
	long := MPSServerFor(deep, []string{"GPU-a"})
	require.Error(t, mpsserver.CheckPipeDir(long.PipeDir()), "too long for the daemon's sockets")
	env, err = long.ClientEnv()
	require.NoError(t, err)
	link := filepath.Join(links, long.Key)
	assert.Contains(t, env, "CUDA_MPS_PIPE_DIRECTORY="+link)
	target, err := os.Readlink(link)
	require.NoError(t, err)
	assert.Equal(t, long.PipeDir(), target)
	require.NoError(t, mpsserver.CheckPipeDir(link))

	// Again, and after the link went stale: the same link, to the right place.
	require.NoError(t, os.Remove(link))
	require.NoError(t, os.Symlink("/elsewhere", link))
	_, err = long.ClientEnv()
	require.NoError(t, err)
	target, err = os.Readlink(link)
	require.NoError(t, err)
	assert.Equal(t, long.PipeDir(), target)
}
