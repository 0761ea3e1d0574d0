package plugin

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	v1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// testKubelet plays the kubelet's part: it finds the plugin through the
// registry directory and calls the DRA service on the socket it names.
type testKubelet struct {
	dra drapb.DRAPluginClient
}

func dial(t testing.TB, socket string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	return conn
}

func registerPlugin(t testing.TB, registry string) *testKubelet {
	t.Helper()
	reg := registerapi.NewRegistrationClient(dial(t, filepath.Join(registry, slicebuilder.DriverName+"-reg.sock")))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	info, err := reg.GetInfo(ctx, &registerapi.InfoRequest{})
	require.NoError(t, err)
	assert.Equal(t, registerapi.DRAPlugin, info.Type)
	assert.Equal(t, slicebuilder.DriverName, info.Name)
	_, err = reg.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: true})
	require.NoError(t, err)
	return &testKubelet{dra: drapb.NewDRAPluginClient(dial(t, info.Endpoint))}
}

// startPlugin starts the real plugin over e's node with the given claims in
// a fake API, and registers it with a test kubelet.
func startPlugin(t testing.TB, e *env, claims ...*resourceapi.ResourceClaim) (*testKubelet, *fake.Clientset) {
	k, c, _ := startPluginWithMetrics(t, e, nil, claims...)
	return k, c
}

func startPluginWithMetrics(t testing.TB, e *env, metrics *Metrics, claims ...*resourceapi.ResourceClaim) (*testKubelet, *fake.Clientset, *Plugin) {
	t.Helper()
	return startPluginWith(t, e, func(cfg *Config) { cfg.Metrics = metrics }, claims...)
}

// startPluginWith is startPlugin with the plugin's Config changed by
// configure first.
func startPluginWith(t testing.TB, e *env, configure func(*Config), claims ...*resourceapi.ResourceClaim) (*testKubelet, *fake.Clientset, *Plugin) {
	t.Helper()
	// Unix socket paths are limited to 108 bytes: keep them short.
	sockets, err := os.MkdirTemp("", "gpudra")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(sockets) })
	objs := []runtime.Object{&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: pool, UID: "node-uid"}}}
	for _, c := range claims {
		objs = append(objs, c)
	}
	client := fakeClient(objs...)
	ctx, cancel := context.WithCancelCause(context.Background())
	t.Cleanup(func() { cancel(nil) })
	cfg := Config{
		NodeName: pool, Backend: e.machine, Client: client,
		RegistrarDir: filepath.Join(sockets, "reg"), PluginDataDir: filepath.Join(sockets, "data"), CDIDir: e.cdiDir,
		BootID: "boot-1",
	}
	configure(&cfg)
	p, err := Start(ctx, cfg, cancel)
	require.NoError(t, err)
	t.Cleanup(p.Stop)
	return registerPlugin(t, filepath.Join(sockets, "reg")), client, p
}

func TestPrepareOverTheDRASocket(t *testing.T) {
	e := newEnv(t)
	c1 := claim("uid-1", []string{"gpu-2"})
	c2 := claim("uid-2", []string{"gpu-2"}) // the same device: must be refused
	c3 := claim("uid-3", []string{"gpu-0-mig-1g-10gb-6"})
	kubelet, client := startPlugin(t, e, c1, c2, c3)
	req := &drapb.NodePrepareResourcesRequest{}
	for _, c := range []*resourceapi.ResourceClaim{c1, c2, c3} {
		req.Claims = append(req.Claims, &drapb.Claim{Namespace: c.Namespace, Name: c.Name, Uid: string(c.UID)})
	}
	resp, err := kubelet.dra.NodePrepareResources(context.Background(), req)
	require.NoError(t, err)
	require.Len(t, resp.Claims, 3)
	assert.Empty(t, resp.Claims["uid-1"].Error)
	require.Len(t, resp.Claims["uid-1"].Devices, 1)
	assert.Equal(t, "gpu-2", resp.Claims["uid-1"].Devices[0].DeviceName)
	assert.Equal(t, []string{"gpu.gpudra.dev/claim=uid-1-gpu-2"}, resp.Claims["uid-1"].Devices[0].CdiDeviceIds)
	assert.Contains(t, resp.Claims["uid-2"].Error, "device gpu-2 is unavailable: gpu-2 is prepared for claim ns/claim-uid-1 (uid-1)")
	assert.Empty(t, resp.Claims["uid-3"].Error, "one claim's error does not fail the others")

	spec := inject(t, e.cdiDir, resp.Claims["uid-3"].Devices[0].CdiDeviceIds)
	assert.Len(t, spec.Linux.Devices, 6, "control nodes, the parent GPU and two capability nodes")

	// The MIG device created for uid-3 is published with all placements;
	// slices exist in the API.
	var slices *resourceapi.ResourceSliceList
	require.Eventually(t, func() bool {
		slices, err = client.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{})
		return err == nil && len(slices.Items) == 2
	}, 10*time.Second, 50*time.Millisecond, "the node's 2 slices (8 counter sets; 58 devices) are published")

	un, err := kubelet.dra.NodeUnprepareResources(context.Background(), &drapb.NodeUnprepareResourcesRequest{Claims: req.Claims})
	require.NoError(t, err)
	for uid, r := range un.Claims {
		assert.Empty(t, r.Error, uid)
	}
	assert.Empty(t, e.cdiSpecs())
	assert.Empty(t, e.migDevices())
}

// TestCorruptCheckpointAtStart: the plugin starts anyway, with an Event on
// the Node naming where the damaged file went.
func TestCorruptCheckpointAtStart(t *testing.T) {
	e := newEnv(t)
	sockets, err := os.MkdirTemp("", "gpudra")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(sockets) })
	data := filepath.Join(sockets, "data")
	require.NoError(t, os.MkdirAll(data, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(data, "checkpoint.json"), []byte(`{"checksum":1,"data":{}}`), 0o600))
	client := fake.NewSimpleClientset(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: pool}})
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	p, err := Start(ctx, Config{NodeName: pool, Backend: e.machine, Client: client, RegistrarDir: filepath.Join(sockets, "reg"),
		PluginDataDir: data, CDIDir: e.cdiDir, BootID: "boot-1"}, cancel)
	require.NoError(t, err, "a corrupt checkpoint never stops the plugin")
	defer p.Stop()
	// Recorded in the background (events.k8s.io/v1, client-go's recorder).
	var events *eventsv1.EventList
	require.Eventually(t, func() bool {
		events, err = client.EventsV1().Events("default").List(ctx, metav1.ListOptions{})
		return err == nil && len(events.Items) > 0
	}, 10*time.Second, 20*time.Millisecond)
	require.Len(t, events.Items, 1)
	ev := events.Items[0]
	assert.Equal(t, ReasonCheckpointCorrupt, ev.Reason)
	assert.Equal(t, v1.EventTypeWarning, ev.Type)
	assert.Equal(t, "Node", ev.Regarding.Kind)
	assert.Equal(t, pool, ev.Regarding.Name)
	assert.Equal(t, EventsReportingController, ev.ReportingController)
	assert.Contains(t, ev.Note, "checkpoint is corrupt: checksum 00000001")
	assert.Contains(t, ev.Note, "checkpoint.json.corrupt-")
}

// fakeClient is a client-go fake that names ResourceSlices from their
// generateName, as the API server does (the fake does not).
func fakeClient(objs ...runtime.Object) *fake.Clientset {
	client := fake.NewSimpleClientset(objs...)
	var generated atomic.Int32
	client.PrependReactor("create", "resourceslices", func(a k8stesting.Action) (bool, runtime.Object, error) {
		obj := a.(k8stesting.CreateAction).GetObject().(*resourceapi.ResourceSlice)
		if obj.Name == "" {
			obj.Name = fmt.Sprintf("%s%d", obj.GenerateName, generated.Add(1))
		}
		return false, nil, nil
	})
	return client
}

// TestSocketPathTooLong: a plugin directory whose sockets cannot be bound
// (a unix socket path holds at most 107 bytes) is refused at Start, naming
// the socket, its length and the value to change, before any directory,
// checkpoint or CDI spec is written; 107 bytes fit.
func TestSocketPathTooLong(t *testing.T) {
	const podUID = "6597d34d-8d70-4a43-bb85-3ea5480d8121"
	base, err := os.MkdirTemp("", "gpudra")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(base) })
	// "dra-<uid>.sock" is 45 bytes, after the directory and a slash.
	fitting := filepath.Join(base, strings.Repeat("d", maxSocketPath-len(base)-1-45-1))
	require.Len(t, Config{PluginDataDir: fitting, RegistrarDir: base, PodUID: podUID}.socketPaths()[0], maxSocketPath)
	require.NoError(t, socketPathsFit(Config{PluginDataDir: fitting, RegistrarDir: base, PodUID: podUID}.socketPaths()))

	tooLong := fitting + "x"
	e := newEnv(t)
	_, err = Start(context.Background(), Config{NodeName: pool, Backend: e.machine, Client: fakeClient(),
		RegistrarDir: filepath.Join(base, "reg"), PluginDataDir: tooLong, CDIDir: e.cdiDir, PodUID: podUID, BootID: "boot-1"}, func(error) {})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "dra-"+podUID+".sock is 108 bytes, over the 107")
	assert.Contains(t, err.Error(), "kubeletPlugin.kubeletDir")
	assert.NoDirExists(t, tooLong, "nothing was made for a plugin that cannot serve")
}
