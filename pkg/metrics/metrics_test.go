package metrics

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/internal/version"
)

func scrape(t *testing.T, h http.Handler) string {
	t.Helper()
	srv := httptest.NewServer(h)
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(body)
}

func TestRegistryServesRuntimeProcessAndBuildInfo(t *testing.T) {
	oldVersion, oldCommit := version.Version, version.Commit
	version.Version, version.Commit = "v1.2.3-test", "abc123"
	t.Cleanup(func() { version.Version, version.Commit = oldVersion, oldCommit })

	reg := NewRegistry(ComponentKubeletPlugin)
	body := scrape(t, Handler(reg))

	assert.Contains(t, body, "\ngo_goroutines ", "the Go runtime collector")
	assert.Contains(t, body, "\ngo_memstats_heap_alloc_bytes ")
	assert.Contains(t, body, "\nprocess_cpu_seconds_total ", "the process collector")
	assert.Contains(t, body, "\nprocess_open_fds ")
	assert.Contains(t, body, `gpudra_build_info{commit="abc123",component="kubelet-plugin",go_version="`+runtime.Version()+`",version="v1.2.3-test"} 1`)
	assert.Contains(t, body, `promhttp_metric_handler_requests_total{code="200"} 0`, "scrapes are counted in the same registry")
}

// A histogram on DurationBuckets puts a one-minute operation in a bucket of
// its own, not in +Inf.
func TestDurationBucketsReachMinutes(t *testing.T) {
	reg := NewRegistry(ComponentController)
	h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "test_duration_seconds", Help: "test", Buckets: DurationBuckets})
	reg.MustRegister(h)
	h.Observe(45)

	body := scrape(t, Handler(reg))
	assert.Contains(t, body, `test_duration_seconds_bucket{le="0.0005"} 0`)
	assert.Contains(t, body, `test_duration_seconds_bucket{le="30"} 0`)
	assert.Contains(t, body, `test_duration_seconds_bucket{le="60"} 1`)
	assert.Contains(t, body, `test_duration_seconds_bucket{le="120"} 1`)
	assert.GreaterOrEqual(t, DurationBuckets[len(DurationBuckets)-1], 120.0)
}

// Registries are independent: two plugins in one process (devcluster) each
// register everything without a clash.
func TestRegistriesDoNotCollide(t *testing.T) {
	a, b := NewRegistry(ComponentKubeletPlugin), NewRegistry(ComponentKubeletPlugin)
	ga := prometheus.NewGauge(prometheus.GaugeOpts{Name: "gpudra_test", Help: "test"})
	gb := prometheus.NewGauge(prometheus.GaugeOpts{Name: "gpudra_test", Help: "test"})
	require.NoError(t, a.Register(ga))
	require.NoError(t, b.Register(gb))
	ga.Set(1)
	gb.Set(2)
	assert.Contains(t, scrape(t, Handler(a)), "\ngpudra_test 1\n")
	assert.Contains(t, scrape(t, Handler(b)), "\ngpudra_test 2\n")
	// A second handler on one registry reuses the scrape counters.
	assert.NotPanics(t, func() { Handler(a) })
}

func TestServeStopsWithContext(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, addr, Handler(NewRegistry(ComponentController))) }()
	require.Eventually(t, func() bool {
		resp, err := http.Get("http://" + addr + "/metrics")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 10*time.Second, 20*time.Millisecond)
	cancel()
	select {
	case err := <-done:
		assert.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return after its context ended")
	}
}

func TestServeReportsABadAddress(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	err := Serve(ctx, "not-an-address", http.NotFoundHandler())
	require.Error(t, err)
	assert.Contains(t, err.Error(), "metrics server on not-an-address")
}
