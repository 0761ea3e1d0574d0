package controlplane

import (
	"bufio"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// nobody is the uid (and gid) of the other local user the test plays.
const nobody = 65534

// TestStartEtcdListensOnlyOnAPrivateSocket: etcd takes no credentials,
// so whoever reaches it owns the cluster. It listens on no TCP port, only
// on unix sockets in a directory of mode 0700, which another user cannot
// connect through while etcd's own user can.
func TestStartEtcdListensOnlyOnAPrivateSocket(t *testing.T) {
	// The cluster's directory is open to everyone, so that only the
	// socket directory's mode stands between another user and etcd.
	dir, err := os.MkdirTemp("", "dc")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o755))

	// With no umask the sockets themselves are open to everyone (mode
	// 0777): the directory alone keeps other users out, whatever the
	// umask of whoever runs devcluster.
	umask := syscall.Umask(0)
	before := tcpListeners(t)
	e, clientURL, err := StartEtcd(dir)
	syscall.Umask(umask)
	require.NoError(t, err)
	t.Cleanup(e.Close)

	assert.Empty(t, newKeys(tcpListeners(t), before), "TCP ports etcd listens on (socket inodes)")
	for _, l := range e.Clients {
		assert.Equal(t, "unix", l.Addr().Network(), "client listener %s", l.Addr())
	}
	for _, p := range e.Peers {
		assert.Equal(t, "unix", p.Addr().Network(), "peer listener %s", p.Addr())
	}
	u, err := url.Parse(clientURL)
	require.NoError(t, err)
	require.Equal(t, "unix", u.Scheme, "client URL %s", clientURL)
	socket := u.Path
	sockets, err := os.Stat(filepath.Dir(socket))
	require.NoError(t, err)
	assert.Equal(t, os.ModeDir|0o700, sockets.Mode(), "mode of %s", filepath.Dir(socket))
	for _, name := range []string{"client", "peer"} {
		st, err := os.Stat(filepath.Join(filepath.Dir(socket), name))
		if assert.NoError(t, err) {
			assert.Equal(t, os.ModeSocket, st.Mode().Type(), name)
		}
	}

	if os.Geteuid() != 0 {
		t.Skip("connecting as another user (uid 65534) needs root, to switch to it")
	}
	health := healthBinary(t)
	out, err := exec.Command(health, socket).CombinedOutput()
	require.NoError(t, err, "as root: %s", out)
	assert.Contains(t, string(out), `"health":"true"`, "as root")

	cmd := exec.Command(health, socket)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
	out, err = cmd.CombinedOutput()
	require.Error(t, err, "uid %d reached etcd: %s", nobody, out)
	assert.Contains(t, string(out), "permission denied", "uid %d", nobody)
}

// TestStartEtcdRefusesASocketPathTooLong: a unix socket's path holds 107
// bytes; a directory that makes it longer is named in the error.
func TestStartEtcdRefusesASocketPathTooLong(t *testing.T) {
	dir := filepath.Join(t.TempDir(), strings.Repeat("d", 100))
	_, _, err := StartEtcd(dir)
	require.Error(t, err)
	assert.Contains(t, err.Error(), dir)
	assert.Contains(t, err.Error(), "over the 107 a unix socket allows")
}

// healthBinary builds testdata/etcdhealth where another user can run it.
func healthBinary(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "etcdhealth")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o755))
	bin := filepath.Join(dir, "etcdhealth")
	cmd := exec.Command("go", "build", "-o", bin, "./testdata/etcdhealth")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "build etcdhealth: %s", out)
	return bin
}

// tcpListeners are the inodes of this process's sockets that listen on
// TCP (IPv4 or IPv6): other processes' listeners, which tests running in
// parallel open, are not among them.
func tcpListeners(t *testing.T) map[string]bool {
	t.Helper()
	own := map[string]bool{}
	fds, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	for _, fd := range fds {
		target, err := os.Readlink(filepath.Join("/proc/self/fd", fd.Name()))
		if inode, ok := strings.CutPrefix(target, "socket:["); err == nil && ok {
			own[strings.TrimSuffix(inode, "]")] = true
		}
	}
	listening := map[string]bool{}
	for _, table := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		f, err := os.Open(table)
		if os.IsNotExist(err) {
			continue
		}
		require.NoError(t, err)
		s := bufio.NewScanner(f)
		s.Scan() // the header
		for s.Scan() {
			// sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode
			fields := strings.Fields(s.Text())
			const listen = "0A"
			if len(fields) > 9 && fields[3] == listen && own[fields[9]] {
				listening[fields[9]] = true
			}
		}
		require.NoError(t, s.Err())
		f.Close()
	}
	return listening
}

func newKeys(now, before map[string]bool) []string {
	var added []string
	for k := range now {
		if !before[k] {
			added = append(added, k)
		}
	}
	return added
}
