package plugin

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"regexp"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"

	"github.com/gpudra/gpudra/internal/version"
	"github.com/gpudra/gpudra/pkg/nodelock"
	"github.com/gpudra/gpudra/pkg/plugin/checkpoint"
	"github.com/gpudra/gpudra/pkg/prepared"
)

// value reads a gauge or a counter.
func value(t *testing.T, m prometheus.Metric) float64 {
	t.Helper()
	var out dto.Metric
	require.NoError(t, m.Write(&out))
	switch {
	case out.Gauge != nil:
		return out.Gauge.GetValue()
	case out.Counter != nil:
		return out.Counter.GetValue()
	}
	t.Fatalf("%s is neither a gauge nor a counter", m.Desc())
	return 0
}

func get(t *testing.T, h http.Handler, path string) (int, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	body, _ := io.ReadAll(rec.Body)
	return rec.Code, string(body)
}

func TestMetricsAndLiveness(t *testing.T) {
	e := newEnv(t)
	ok, bad := claim("ok", []string{"gpu-1"}), claim("bad", []string{"gpu-1"})
	m := NewMetrics()
	kubelet, _, p := startPluginWithMetrics(t, e, m, ok, bad)
	h := m.Handler(p.Sockets...)

	code, body := get(t, h, "/healthz")
	assert.Equal(t, http.StatusOK, code, body)

	_, err := kubelet.dra.NodePrepareResources(context.Background(), &drapb.NodePrepareResourcesRequest{Claims: []*drapb.Claim{
		{Namespace: ok.Namespace, Name: ok.Name, Uid: "ok"}, {Namespace: bad.Namespace, Name: bad.Name, Uid: "bad"}}})
	require.NoError(t, err)
	_, body = get(t, h, "/metrics")
	assert.Contains(t, body, `gpudra_plugin_claim_operations_total{operation="prepare",result="success"} 1`)
	assert.Contains(t, body, `gpudra_plugin_claim_operations_total{operation="prepare",result="error"} 1`)
	assert.Contains(t, body, `gpudra_plugin_claim_operation_duration_seconds_count{operation="prepare"} 2`)
	assert.Contains(t, body, "gpudra_plugin_devices_published 58")
	// Where each prepare's time went, as far as it got: both waited for
	// the lock and read the GPUs; the bad one stopped at its plan (its
	// device is the good one's); the good one made its GPU's MIG device (a
	// whole GPU in MIG mode) and shared nothing.
	for step, n := range map[string]int{PrepareStepLock: 2, PrepareStepInventory: 2, PrepareStepPlan: 1, PrepareStepMIG: 1, PrepareStepCDI: 1, PrepareStepCheckpoint: 1} {
		assert.Contains(t, body, fmt.Sprintf(`gpudra_plugin_prepare_step_duration_seconds_count{step=%q} %d`, step, n))
	}
	assert.NotContains(t, body, `step="sharing"`)

	p.Stop()
	code, body = get(t, h, "/healthz")
	assert.Equal(t, http.StatusServiceUnavailable, code, "a plugin whose sockets are gone is not alive")
	assert.Contains(t, body, "dra.sock")
}

// /metrics carries what every gpudra component exports, and a prepare that
// takes 90 s (a MIG device and an MPS server pod, say) lands in a bucket,
// not in +Inf.
func TestMetricsEndpointOverHTTP(t *testing.T) {
	m := NewMetrics()
	start := m.begin(opPrepare)
	m.observe(opPrepare, start.Add(-90*time.Second), nil)

	srv := httptest.NewServer(m.Handler())
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	body := string(b)

	assert.Contains(t, body, "\ngo_goroutines ")
	assert.Contains(t, body, "\nprocess_cpu_seconds_total ")
	assert.Regexp(t, `gpudra_build_info\{commit="[^"]*",component="kubelet-plugin",go_version="go[^"]*",version="`+regexp.QuoteMeta(version.Version)+`"\} 1`, body)
	assert.Contains(t, body, `gpudra_plugin_claim_operation_duration_seconds_bucket{operation="prepare",le="60"} 0`)
	assert.Contains(t, body, `gpudra_plugin_claim_operation_duration_seconds_bucket{operation="prepare",le="120"} 1`)
	assert.Contains(t, body, `gpudra_plugin_claim_operations_total{operation="prepare",result="success"} 1`)
	assert.Contains(t, body, `gpudra_plugin_claim_operations_total{operation="prepare",result="error"} 0`, "error series exist from the start, for rate alerts")
	assert.Contains(t, body, `gpudra_plugin_operations_in_flight{operation="prepare"} 0`)
	assert.Contains(t, body, "gpudra_plugin_prepared_claims 0")
}

// The in-flight gauge counts a prepare while it waits for the node lock (held
// here as another plugin instance would hold it during a rolling update);
// the prepared claims gauge follows prepares and unprepares.
func TestPreparedClaimsAndInFlightGauges(t *testing.T) {
	e := newEnv(t)
	a, b, busy := claim("a", []string{"gpu-1"}), claim("b", []string{"gpu-2"}), claim("busy", []string{"gpu-1"})
	m := NewMetrics()
	kubelet, _, p := startPluginWithMetrics(t, e, m, a, b, busy)
	preparedNow := func() float64 { return value(t, m.preparedClaims) }
	inFlight := func(op string) float64 { return value(t, m.inFlight.WithLabelValues(op)) }
	ref := func(c *resourceapi.ResourceClaim) *drapb.Claim {
		return &drapb.Claim{Namespace: c.Namespace, Name: c.Name, Uid: string(c.UID)}
	}
	ctx := context.Background()
	assert.Equal(t, 0.0, preparedNow())

	other, err := nodelock.Open(filepath.Join(filepath.Dir(p.Sockets[0]), "state.lock"))
	require.NoError(t, err)
	require.NoError(t, other.Lock(ctx))
	// Released on every path: close waits for the holder, and the plugin's
	// Stop for the prepare behind it.
	release := sync.OnceFunc(other.Unlock)
	defer func() { release(); _ = other.Close() }()
	done := make(chan error, 1)
	go func() {
		resp, err := kubelet.dra.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: []*drapb.Claim{ref(a), ref(b)}})
		if err == nil && (resp.Claims["a"].Error != "" || resp.Claims["b"].Error != "") {
			err = fmt.Errorf("prepare: %v", resp.Claims)
		}
		done <- err
	}()
	require.Eventually(t, func() bool { return inFlight(opPrepare) == 1 }, 10*time.Second, 5*time.Millisecond,
		"a prepare waiting for the node lock is in flight")
	assert.Equal(t, 0.0, preparedNow())
	release()
	require.NoError(t, <-done)
	assert.Equal(t, 0.0, inFlight(opPrepare))
	assert.Equal(t, 2.0, preparedNow())

	resp, err := kubelet.dra.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: []*drapb.Claim{ref(busy)}})
	require.NoError(t, err)
	require.NotEmpty(t, resp.Claims["busy"].Error)
	assert.Equal(t, 2.0, preparedNow(), "a refused prepare prepares nothing")

	un, err := kubelet.dra.NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{Claims: []*drapb.Claim{ref(a)}})
	require.NoError(t, err)
	require.Empty(t, un.Claims["a"].Error)
	assert.Equal(t, 1.0, preparedNow())
	assert.Equal(t, 0.0, inFlight(opUnprepare))
	assert.Equal(t, 2.0, value(t, m.operations.WithLabelValues(opPrepare, "success")))
	assert.Equal(t, 1.0, value(t, m.operations.WithLabelValues(opPrepare, "error")))
	assert.Equal(t, 1.0, value(t, m.operations.WithLabelValues(opUnprepare, "success")))
}

// A restarted plugin sets the prepared claims gauge from the checkpoint
// before any prepare: the start-up sweep reports it.
func TestPreparedClaimsGaugeAtStart(t *testing.T) {
	e := newEnv(t)
	s := e.start()
	for _, c := range []*resourceapi.ResourceClaim{claim("a", []string{"gpu-1"}), claim("b", []string{"gpu-0-mig-1g-10gb-6"})} {
		_, err := prep(s, c)
		require.NoError(t, err)
	}
	require.NoError(t, s.Close())

	m := NewMetrics()
	e.onPreparedClaims = m.onPreparedClaims()
	s = e.start()
	defer s.Close()
	assert.Equal(t, 2.0, value(t, m.preparedClaims))

	_, err := s.Unprepare(context.Background(), "b")
	require.NoError(t, err)
	assert.Equal(t, 1.0, value(t, m.preparedClaims))
}

// Interrupted prepares (a kill, a failed rollback) are not prepared claims.
func TestCountPreparedSkipsInterruptedPrepares(t *testing.T) {
	cp := checkpoint.New("boot-1")
	assert.Equal(t, 0, countPrepared(cp))
	cp.Put(prepared.Claim{UID: "done", State: prepared.PrepareCompleted})
	cp.Put(prepared.Claim{UID: "started", State: prepared.PrepareStarted})
	assert.Equal(t, 1, countPrepared(cp))
}

// Without metrics the state gets no hook: nothing is counted for nobody.
func TestNoMetricsNoHook(t *testing.T) {
	var m *Metrics
	assert.Nil(t, m.onPreparedClaims())
	assert.NotPanics(t, func() { m.observe(opPrepare, m.begin(opPrepare), nil) })
}
