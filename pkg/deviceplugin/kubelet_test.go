package deviceplugin

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// fakeKubelet is the kubelet's side of registration on a real unix socket:
// it records every registration, as the device manager would act on it.
type fakeKubelet struct {
	pluginapi.UnimplementedRegistrationServer
	socket string
	srv    *grpc.Server
	regs   chan *pluginapi.RegisterRequest
}

func startKubelet(t *testing.T, dir string) *fakeKubelet {
	t.Helper()
	k := &fakeKubelet{socket: filepath.Join(dir, "kubelet.sock"), regs: make(chan *pluginapi.RegisterRequest, 16)}
	lis, err := net.Listen("unix", k.socket)
	require.NoError(t, err)
	k.srv = grpc.NewServer()
	pluginapi.RegisterRegistrationServer(k.srv, k)
	go func() { _ = k.srv.Serve(lis) }()
	t.Cleanup(k.stop)
	return k
}

func (k *fakeKubelet) Register(_ context.Context, r *pluginapi.RegisterRequest) (*pluginapi.Empty, error) {
	k.regs <- r
	return &pluginapi.Empty{}, nil
}

// stop is what a kubelet going away leaves: no listener, no socket.
func (k *fakeKubelet) stop() {
	k.srv.Stop()
	_ = os.Remove(k.socket)
}

func (k *fakeKubelet) waitRegistration(t *testing.T) *pluginapi.RegisterRequest {
	t.Helper()
	select {
	case r := <-k.regs:
		return r
	case <-time.After(10 * time.Second):
		require.FailNow(t, "no registration arrived")
		return nil
	}
}

// dialPlugin connects to a registered endpoint as the device manager does.
func dialPlugin(t *testing.T, dir, endpoint string) pluginapi.DevicePluginClient {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, endpoint), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return pluginapi.NewDevicePluginClient(conn)
}

// runPlugin starts a plugin for resource r in dir, waits for its
// registration and returns a client of it.
func runPlugin(t *testing.T, dir string, k *fakeKubelet, opts Options) (*Plugin, pluginapi.DevicePluginClient) {
	t.Helper()
	opts.PluginDir = dir
	opts.PollInterval = 20 * time.Millisecond
	p, err := New(opts)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	reg := k.waitRegistration(t)
	require.Equal(t, opts.Resource.Name, reg.ResourceName)
	return p, dialPlugin(t, dir, reg.Endpoint)
}

// recv reads the next device list: ID -> health.
func recv(t *testing.T, s grpc.ServerStreamingClient[pluginapi.ListAndWatchResponse]) map[string]string {
	t.Helper()
	type result struct {
		r   *pluginapi.ListAndWatchResponse
		err error
	}
	ch := make(chan result, 1)
	go func() {
		r, err := s.Recv()
		ch <- result{r, err}
	}()
	select {
	case res := <-ch:
		require.NoError(t, res.err)
		out := map[string]string{}
		for _, d := range res.r.Devices {
			out[d.ID] = d.Health
		}
		return out
	case <-time.After(10 * time.Second):
		require.FailNow(t, "no device list arrived")
		return nil
	}
}
