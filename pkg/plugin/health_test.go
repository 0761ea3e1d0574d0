package plugin

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

func TestHealthReportsAndTaints(t *testing.T) {
	e := newEnv(t)
	d := &Driver{state: e.start(), backend: e.machine, pool: pool}
	published := make(chan struct{}, 10)
	d.publish = func(context.Context) error { published <- struct{}{}; return nil }
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	d.startRepublishing(ctx)
	require.NoError(t, d.watchHealth(ctx))
	reports := make(chan kubeletplugin.DeviceHealthReport)
	done := make(chan error)
	go func() { done <- d.WatchHealthStatus(ctx, reports) }()

	next := func() map[string]kubeletplugin.DeviceHealth {
		t.Helper()
		return nextHealthReport(t, reports, "no health report")
	}
	first := next()
	require.Len(t, first, 2*26+6, "the first report covers every device: 2 GPUs in MIG mode with 25 placements each, 6 without")
	assert.Equal(t, kubeletplugin.HealthStatusHealthy, first["gpu-1"].Health)

	inv, _ := e.machine.Inventory(ctx)
	require.NoError(t, e.machine.InjectXID(inv.GPUs[1].UUID, "", 13)) // application error: ignored
	require.NoError(t, e.machine.InjectXID(inv.GPUs[1].UUID, "", 95)) // uncontained ECC error: unhealthy until a reset
	rep := next()
	assert.Equal(t, kubeletplugin.HealthStatusUnhealthy, rep["gpu-1"].Health)
	assert.Equal(t, "xid-95", rep["gpu-1"].Message)
	assert.Equal(t, kubeletplugin.HealthStatusUnhealthy, rep["gpu-1-mig-1g-10gb-0"].Health, "its MIG devices too")
	assert.Equal(t, kubeletplugin.HealthStatusHealthy, rep["gpu-0"].Health)
	<-published

	res, _, err := d.Resources(ctx)
	require.NoError(t, err)
	tainted := 0
	for _, s := range res.Pools[pool].Slices {
		for _, dev := range s.Devices {
			if len(dev.Taints) > 0 {
				tainted++
				assert.Equal(t, UnhealthyTaintKey, dev.Taints[0].Key)
				assert.Equal(t, resourceapi.DeviceTaintEffectNoSchedule, dev.Taints[0].Effect, "NoSchedule unless configured")
			}
		}
	}
	assert.Equal(t, 26, tainted, "the GPU and its 25 placements are tainted")

	require.ErrorIs(t, e.machine.RecoverGPU(inv.GPUs[1].UUID), sim.ErrResetRequired, "answering is not enough after XID 95")
	require.NoError(t, e.machine.ResetGPU(inv.GPUs[1].UUID))
	assert.Equal(t, kubeletplugin.HealthStatusHealthy, next()["gpu-1"].Health, "the device comes back after the reset")
	res, _, err = d.Resources(ctx)
	require.NoError(t, err)
	for _, s := range res.Pools[pool].Slices {
		for _, dev := range s.Devices {
			assert.Empty(t, dev.Taints, dev.Name)
		}
	}
	cancel()
	require.NoError(t, <-done)
}

// Without any kubelet health stream, an unhealthy GPU is still tainted in
// the published slices, with the configured effect.
func TestHealthTaintsWithoutAHealthStream(t *testing.T) {
	e := newEnv(t)
	d := &Driver{state: e.start(), backend: e.machine, pool: pool, taintEffect: resourceapi.DeviceTaintEffectNoExecute}
	published := make(chan struct{}, 10)
	d.publish = func(context.Context) error { published <- struct{}{}; return nil }
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	d.startRepublishing(ctx)
	require.NoError(t, d.watchHealth(ctx))
	inv, err := e.machine.Inventory(ctx)
	require.NoError(t, err)
	require.NoError(t, e.machine.InjectXID(inv.GPUs[2].UUID, "", 48)) // double-bit ECC error
	select {
	case <-published:
	case <-time.After(5 * time.Second):
		t.Fatal("not republished after a critical XID")
	}
	res, _, err := d.Resources(ctx)
	require.NoError(t, err)
	for _, s := range res.Pools[pool].Slices {
		for _, dev := range s.Devices {
			if dev.Name == "gpu-2" {
				require.Len(t, dev.Taints, 1)
				assert.Equal(t, resourceapi.DeviceTaintEffectNoExecute, dev.Taints[0].Effect)
				assert.Equal(t, "xid-48", dev.Taints[0].Value)
			}
		}
	}
}

// taintsOf lists the devices with a taint, with the taint's value.
func taintsOf(t *testing.T, d *Driver) map[string]string {
	t.Helper()
	res, _, err := d.Resources(context.Background())
	require.NoError(t, err)
	out := map[string]string{}
	for _, s := range res.Pools[pool].Slices {
		for _, dev := range s.Devices {
			if len(dev.Taints) > 0 {
				out[dev.Name] = dev.Taints[0].Value
			}
		}
	}
	return out
}

// readHealthFile returns the UUIDs the health file lists.
func readHealthFile(t *testing.T, path string) map[string]nvdevice.HealthEvent {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	var rec healthRecord
	require.NoError(t, json.Unmarshal(b, &rec))
	assert.Equal(t, "boot-1", rec.BootID)
	assert.Equal(t, healthVersion, rec.Version)
	return rec.Unhealthy
}

func waitPublished(t *testing.T, published <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-published:
	case <-time.After(5 * time.Second):
		t.Fatal("not republished: " + what)
	}
}

// A taint survives a plugin restart: the new driver publishes it before any
// event, hands it to the backend (here a new simulated machine over the same
// GPUs, as a new process's NVML backend knows nothing), and drops it from
// the file when the GPU recovers.
func TestHealthSurvivesARestart(t *testing.T) {
	path := filepath.Join(t.TempDir(), HealthFile)
	e := newEnv(t)
	d := &Driver{state: e.start(), backend: e.machine, pool: pool}
	published := make(chan struct{}, 10)
	d.publish = func(context.Context) error { published <- struct{}{}; return nil }
	ctx, cancel := context.WithCancel(context.Background())
	d.restoreHealth(ctx, path, "boot-1")
	assert.Empty(t, taintsOf(t, d), "no file yet: nothing tainted")
	d.startRepublishing(ctx)
	require.NoError(t, d.watchHealth(ctx))
	inv, err := e.machine.Inventory(ctx)
	require.NoError(t, err)
	bad := inv.GPUs[3].UUID
	require.NoError(t, e.machine.InjectXID(bad, "", 94)) // needs no reset
	waitPublished(t, published, "XID 94")
	require.NoError(t, e.machine.InjectXID(bad, "", 48)) // needs a reset: the GPU keeps this one
	waitPublished(t, published, "XID 48 outweighs XID 94")
	saved := readHealthFile(t, path)
	require.Contains(t, saved, bad)
	assert.Equal(t, uint64(48), saved[bad].XID)
	cancel() // the plugin stops

	e2 := newEnv(t) // a new process: same node, same GPUs, a backend that saw nothing
	require.Equal(t, bad, inventory(t, e2.machine).GPUs[3].UUID)
	d2 := &Driver{state: e2.start(), backend: e2.machine, pool: pool}
	published2 := make(chan struct{}, 10)
	d2.publish = func(context.Context) error { published2 <- struct{}{}; return nil }
	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	d2.restoreHealth(ctx2, path, "boot-1")
	taints := taintsOf(t, d2)
	assert.Equal(t, "xid-48", taints["gpu-3"], "tainted again before any event")
	assert.Len(t, taints, 1)

	d2.startRepublishing(ctx2)
	require.NoError(t, d2.watchHealth(ctx2))
	require.ErrorIs(t, e2.machine.RecoverGPU(bad), sim.ErrResetRequired, "the backend was told the GPU needs a reset")
	require.NoError(t, e2.machine.ResetGPU(bad))
	waitPublished(t, published2, "recovery")
	assert.Empty(t, taintsOf(t, d2))
	assert.Empty(t, readHealthFile(t, path), "a recovered GPU leaves the file")
}

func inventory(t *testing.T, m *sim.Machine) *nvdevice.Inventory {
	t.Helper()
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	return inv
}

func TestHealthStore(t *testing.T) {
	gpu := "GPU-aaaa"
	ev := nvdevice.HealthEvent{Kind: nvdevice.HealthXID, GPUUUID: gpu, XID: 95, Time: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), Message: "XID 95"}
	for _, tc := range []struct {
		name    string
		content string // "" : written by save
		want    map[string]nvdevice.HealthEvent
	}{
		{name: "round trip", want: map[string]nvdevice.HealthEvent{gpu: ev}},
		{name: "no file", content: "-", want: nil},
		{name: "unknown fields are ignored", want: map[string]nvdevice.HealthEvent{gpu: {Kind: nvdevice.HealthXID, GPUUUID: gpu, XID: 48}},
			content: `{"version":7,"bootID":"boot-1","future":{"x":1},"unhealthy":{"GPU-aaaa":{"kind":"xid","xid":48,"severity":"high"}}}`},
		{name: "another boot: the GPUs were reset", content: `{"version":1,"bootID":"boot-0","unhealthy":{"GPU-aaaa":{"kind":"xid","gpuUUID":"GPU-aaaa","xid":48}}}`},
		{name: "corrupt", content: `{"version":1,"bootID":"boot-1","unhealthy":{"GPU-aaaa":`},
		{name: "not JSON", content: "\x00\x01garbage"},
		{name: "wrong shape", content: `{"version":1,"bootID":"boot-1","unhealthy":["GPU-aaaa"]}`},
		{name: "entries that cannot taint are dropped", want: map[string]nvdevice.HealthEvent{gpu: {Kind: nvdevice.HealthGPULost, GPUUUID: gpu}},
			content: `{"version":1,"bootID":"boot-1","unhealthy":{"GPU-aaaa":{"kind":"gpu-lost"},"GPU-b":{"kind":"xid","xid":13},` +
				`"GPU-c":{"kind":"recovered"},"GPU-d":{"kind":"xid","gpuUUID":"GPU-other","xid":48},"":{"kind":"gpu-lost"}}}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			s := &healthStore{path: filepath.Join(dir, HealthFile), bootID: "boot-1"}
			switch tc.content {
			case "":
				require.NoError(t, s.save(tc.want))
				entries, err := os.ReadDir(dir)
				require.NoError(t, err)
				require.Len(t, entries, 1, "no temporary file left behind")
			case "-":
			default:
				require.NoError(t, os.WriteFile(s.path, []byte(tc.content), 0o600))
			}
			var got map[string]nvdevice.HealthEvent
			require.NotPanics(t, func() { got = s.load(klog.Background()) })
			if len(tc.want) == 0 {
				assert.Empty(t, got)
				return
			}
			assert.Equal(t, tc.want, got)
		})
	}
}

// The plugin's own start reads the health file: its first publication has
// the taint, and a corrupt or stale file starts it without any.
func TestHealthFileAtStart(t *testing.T) {
	for _, tc := range []struct {
		name    string
		content string
		taint   bool
	}{
		{name: "a taint from this boot is published again", content: `{"version":1,"bootID":"boot-1","unhealthy":{"UUID":{"kind":"xid","gpuUUID":"UUID","xid":79}}}`, taint: true},
		{name: "a taint from before a reboot is dropped", content: `{"version":1,"bootID":"boot-0","unhealthy":{"UUID":{"kind":"xid","gpuUUID":"UUID","xid":79}}}`},
		{name: "a corrupt file is ignored", content: `{"version":1,"bootID":"boot-1","unhealthy":{"UUID":{"kind":"xid","gpuUUID":"UUI`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			uuid := inventory(t, e.machine).GPUs[2].UUID
			sockets, err := os.MkdirTemp("", "gpudra")
			require.NoError(t, err)
			t.Cleanup(func() { os.RemoveAll(sockets) })
			data := filepath.Join(sockets, "data")
			require.NoError(t, os.MkdirAll(data, 0o755))
			content := []byte(tc.content)
			for i := 0; i+4 <= len(content); i++ { // the GPU's real UUID in place of UUID
				if string(content[i:i+4]) == "UUID" {
					content = append(append(append([]byte{}, content[:i]...), uuid...), content[i+4:]...)
					i += len(uuid) - 1
				}
			}
			require.NoError(t, os.WriteFile(filepath.Join(data, HealthFile), content, 0o600))
			client := fakeClient(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: pool, UID: "node-uid"}})
			ctx, cancel := context.WithCancelCause(context.Background())
			defer cancel(nil)
			p, err := Start(ctx, Config{NodeName: pool, Backend: e.machine, Client: client, RegistrarDir: filepath.Join(sockets, "reg"),
				PluginDataDir: data, CDIDir: e.cdiDir, BootID: "boot-1"}, cancel)
			require.NoError(t, err, "the health file never stops the plugin")
			defer p.Stop()
			var taints map[string]string
			require.Eventually(t, func() bool {
				slices, err := client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
				if err != nil || len(slices.Items) == 0 {
					return false
				}
				taints = map[string]string{}
				n := 0
				for _, s := range slices.Items {
					n += len(s.Spec.Devices)
					for _, dev := range s.Spec.Devices {
						if len(dev.Taints) > 0 {
							taints[dev.Name] = dev.Taints[0].Value
						}
					}
				}
				return n > 0
			}, 10*time.Second, 50*time.Millisecond)
			if tc.taint {
				assert.Equal(t, map[string]string{"gpu-2": "xid-79"}, taints, "published with the taint from the start")
				return
			}
			assert.Empty(t, taints)
		})
	}
}

// nextHealthReport waits up to 5 s for the next report on the health stream,
// by device; without one the test fails with why.
func nextHealthReport(t *testing.T, reports <-chan kubeletplugin.DeviceHealthReport, why string) map[string]kubeletplugin.DeviceHealth {
	t.Helper()
	select {
	case r := <-reports:
		out := map[string]kubeletplugin.DeviceHealth{}
		for _, h := range r.Devices {
			out[h.DeviceName] = h
		}
		return out
	case <-time.After(5 * time.Second):
		t.Fatal(why)
		return nil
	}
}
