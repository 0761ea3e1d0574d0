package podnetwork

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestPodNetwork: a server on the pod network is on no interface of the
// machine and cannot be reached from it, but a CONNECT through the egress
// proxy, as kube-apiserver sends it, reaches it; the egress selector
// configuration names the proxy's socket.
func TestPodNetwork(t *testing.T) {
	if os.Geteuid() != 0 {
		if os.Getenv("GPUDRA_REQUIRE_REAL_NODE") == "1" {
			t.Fatal("the pod network needs root")
		}
		t.Skip("the pod network needs root")
	}
	ctx := context.Background()
	dir := t.TempDir()
	n, err := Start(ctx, dir)
	require.NoError(t, err)
	t.Cleanup(n.Stop)

	l, err := n.Listen()
	require.NoError(t, err)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "from the pod network") }),
		ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { _ = srv.Close() })
	addr := l.Addr().String()
	assert.True(t, strings.HasPrefix(addr, Address+":"), addr)

	addrs, err := net.InterfaceAddrs()
	require.NoError(t, err)
	for _, a := range addrs {
		assert.NotContains(t, a.String(), Address, "the pod address is on no interface of the machine")
	}
	_, err = net.DialTimeout("tcp", addr, time.Second)
	assert.Error(t, err, "the machine's own namespace does not reach the pod network")

	c, err := net.Dial("unix", filepath.Join(dir, "egress.sock"))
	require.NoError(t, err)
	defer c.Close()
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", addr)
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: pod\r\nConnection: close\r\n\r\n")
	resp, err = http.ReadResponse(br, nil)
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	assert.Equal(t, "from the pod network", string(body))

	// The namespace outlives its holder: this process holds it too.
	require.NoError(t, n.holder.Process.Kill())
	<-n.done
	c2, err := n.Dial(ctx, addr)
	require.NoError(t, err, "the pod network without its holder")
	_ = c2.Close()

	cfg, err := os.ReadFile(filepath.Join(dir, "egress-selector.yaml"))
	require.NoError(t, err)
	assert.Contains(t, string(cfg), "udsName: "+filepath.Join(dir, "egress.sock"))
	assert.Equal(t, []string{"--egress-selector-config-file=" + filepath.Join(dir, "egress-selector.yaml")}, n.APIServerFlags())
}
