package plugin

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/sharing"
)

// waitEvent waits for an events.k8s.io/v1 Event with reason whose note
// contains what, and returns it.
func waitEvent(t *testing.T, client *fake.Clientset, reason, what string) eventsv1.Event {
	t.Helper()
	var found eventsv1.Event
	require.Eventually(t, func() bool {
		list, err := client.EventsV1().Events(metav1.NamespaceDefault).List(context.Background(), metav1.ListOptions{})
		if err != nil {
			return false
		}
		for _, ev := range list.Items {
			if ev.Reason == reason && strings.Contains(ev.Note, what) {
				found = ev
				return true
			}
		}
		return false
	}, 10*time.Second, 20*time.Millisecond, "no %s Event about %s", reason, what)
	return found
}

// A started plugin records its Events on the Node through the recorder:
// a GPU turning unhealthy and recovering, each GPU in an Event of its own,
// and a MIG device the GPU refused, naming the claim.
func TestNodeEvents(t *testing.T) {
	e := newEnv(t)
	sockets, err := os.MkdirTemp("", "gpudra")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(sockets) })
	client := fakeClient(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: pool, UID: "node-uid"}})
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	p, err := Start(ctx, Config{NodeName: pool, Backend: e.machine, Client: client, RegistrarDir: filepath.Join(sockets, "reg"),
		PluginDataDir: filepath.Join(sockets, "data"), CDIDir: e.cdiDir, BootID: "boot-1"}, cancel)
	require.NoError(t, err)
	defer p.Stop()
	inv := inventory(t, e.machine)

	require.NoError(t, e.machine.InjectXID(inv.GPUs[2].UUID, "", 48))
	ev := waitEvent(t, client, ReasonGPUUnhealthy, inv.GPUs[2].UUID)
	assert.Equal(t, v1.EventTypeWarning, ev.Type)
	assert.Equal(t, v1.ObjectReference{APIVersion: "v1", Kind: "Node", Name: pool, UID: "node-uid", FieldPath: "devices{gpu-2}"}, ev.Regarding)
	assert.Equal(t, EventsReportingController, ev.ReportingController)
	assert.Equal(t, "TaintDevices", ev.Action)
	assert.Contains(t, ev.Note, "GPU gpu-2 ("+inv.GPUs[2].UUID+") is unhealthy: XID 48")
	assert.Contains(t, ev.Note, UnhealthyTaintKey+"=xid-48:NoSchedule")
	assert.Contains(t, ev.Note, "it needs a GPU reset")

	// Another GPU's fault is an Event of its own, not a count on the first.
	require.NoError(t, e.machine.InjectXID(inv.GPUs[3].UUID, "", 79))
	ev = waitEvent(t, client, ReasonGPUUnhealthy, inv.GPUs[3].UUID)
	assert.Equal(t, "devices{gpu-3}", ev.Regarding.FieldPath)
	assert.Contains(t, ev.Note, "XID 79")

	require.NoError(t, e.machine.ResetGPU(inv.GPUs[2].UUID))
	ev = waitEvent(t, client, ReasonGPURecovered, inv.GPUs[2].UUID)
	assert.Equal(t, v1.EventTypeNormal, ev.Type)
	assert.Equal(t, "devices{gpu-2}", ev.Regarding.FieldPath)

	// The GPU refuses a second 1g.10gb+me (it has one OFA engine).
	_, err = e.machine.CreateMigDevice(context.Background(), nvdevice.MigCreateRequest{ParentUUID: inv.GPUs[0].UUID, Profile: "1g.10gb+me", Start: 0})
	require.NoError(t, err)
	c := claim("u1", []string{"gpu-0-mig-1g-10gb-me-6"})
	out, err := p.Driver.PrepareResourceClaims(context.Background(), []*resourceapi.ResourceClaim{c})
	require.NoError(t, err)
	require.ErrorIs(t, out["u1"].Err, nvdevice.ErrInsufficientResources)
	ev = waitEvent(t, client, ReasonMIGCreationFailed, "claim ns/claim-u1")
	assert.Equal(t, v1.EventTypeWarning, ev.Type)
	assert.Equal(t, pool, ev.Regarding.Name)
	require.NotNil(t, ev.Related)
	assert.Equal(t, v1.ObjectReference{APIVersion: "resource.k8s.io/v1", Kind: "ResourceClaim", Namespace: "ns", Name: "claim-u1", UID: "u1"}, *ev.Related)
	assert.Contains(t, ev.Note, "gpu-0-mig-1g-10gb-me-6")
	assert.Contains(t, ev.Note, "insufficient resources")
}

// Events the plugin records beyond health and prepares, and what none of
// them may exceed.
func TestNodeEventNotes(t *testing.T) {
	server := sharing.MPSServer{Key: "mps-abc", Devices: []string{"GPU-a", "GPU-b"}}
	for _, tc := range []struct {
		name     string
		record   func(e *nodeEvents)
		reason   string
		typ      string
		part     string
		contains string
	}{
		{name: "MPS server restarted", record: func(e *nodeEvents) { e.mpsRestarted(server, nil) },
			reason: ReasonMPSServerRestarted, typ: v1.EventTypeNormal, part: "mpsServers{mps-abc}", contains: "devices GPU-a,GPU-b"},
		{name: "MPS server restart failed", record: func(e *nodeEvents) { e.mpsRestarted(server, errors.New("pod refused")) },
			reason: ReasonMPSServerRestartFailed, typ: v1.EventTypeWarning, part: "mpsServers{mps-abc}", contains: "pod refused"},
		{name: "checkpoint lost", record: func(e *nodeEvents) { e.checkpointRebuilt(RebuildReport{Adopted: []string{"ns/a"}}) },
			reason: ReasonCheckpointLost, typ: v1.EventTypeWarning, contains: "ns/a"},
		{name: "a long note is cut to the API's limit", record: func(e *nodeEvents) {
			e.mpsRestarted(server, errors.New(strings.Repeat("x", 2000)))
		}, reason: ReasonMPSServerRestartFailed, typ: v1.EventTypeWarning, part: "mpsServers{mps-abc}", contains: "xxx..."},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client := fakeClient(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: pool, UID: "node-uid"}})
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			e, err := startNodeEvents(ctx, client, pool)
			require.NoError(t, err)
			defer e.shutdown()
			tc.record(e)
			ev := waitEvent(t, client, tc.reason, tc.contains)
			assert.Equal(t, tc.typ, ev.Type)
			assert.Equal(t, tc.part, ev.Regarding.FieldPath)
			assert.Equal(t, "Node", ev.Regarding.Kind)
			assert.Equal(t, metav1.NamespaceDefault, ev.Namespace, "a Node's Events go to the default namespace")
			assert.LessOrEqual(t, len(ev.Note), maxNote)
			assert.NotEmpty(t, ev.Action)
		})
	}
}

// A driver without a recorder (tests, a failed start) records nothing and
// does not fail.
func TestNilNodeEvents(t *testing.T) {
	var e *nodeEvents
	assert.NotPanics(t, func() {
		e.mpsRestarted(sharing.MPSServer{Key: "k"}, nil)
		e.checkpointRebuilt(RebuildReport{})
		e.prepareFailed(claim("u", nil), &migCreateError{device: "d", err: errors.New("x")})
		e.shutdown()
	})
}
