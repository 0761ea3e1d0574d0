package telemetry

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/common/expfmt"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/prepared"
)

// series is the metric's series lines (no HELP, no TYPE).
func series(t *testing.T, c prometheus.Collector, metric string) string {
	t.Helper()
	got, err := testutil.CollectAndFormat(c, expfmt.TypeTextPlain, metric)
	require.NoError(t, err)
	var out []string
	for _, l := range strings.Split(string(got), "\n") {
		if l != "" && !strings.HasPrefix(l, "#") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

func TestScrapeNeverReads(t *testing.T) {
	for _, tc := range []struct {
		name      string
		samples   int // Sample calls before the scrapes
		err       error
		wantUp    string
		wantPower int // power limit series
	}{
		{"before the first sample", 0, nil, `gpudra_telemetry_up{node="n1"} 0`, 0},
		{"after a sample", 1, nil, `gpudra_telemetry_up{node="n1"} 1`, 1},
		{"after a failed sample", 1, errors.New("NVML went away"), `gpudra_telemetry_up{node="n1"} 0`, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := &fakeReader{samples: []nvdevice.TelemetrySample{gpuSample}, err: tc.err}
			c := NewCollector(r, "n1", time.Second)
			for range tc.samples {
				c.Sample(context.Background())
			}
			for range 5 {
				assert.Equal(t, tc.wantUp, series(t, c, "gpudra_telemetry_up"))
				assert.Equal(t, tc.wantPower, testutil.CollectAndCount(c, "gpudra_gpu_power_limit_watts"))
			}
			r.mu.Lock()
			defer r.mu.Unlock()
			assert.Equal(t, tc.samples, r.reads, "only Sample reads; five scrapes read nothing")
		})
	}
}

// signalReader reports each read on reads, and blocks it until release
// has a value when gated.
type signalReader struct {
	reads   chan struct{}
	release chan struct{}
	gated   bool
	mu      sync.Mutex
	util    float64
	onRead  func()
}

func (s *signalReader) Telemetry(context.Context) ([]nvdevice.TelemetrySample, error) {
	s.reads <- struct{}{}
	if s.gated {
		<-s.release
	}
	if s.onRead != nil {
		s.onRead()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	g := gpuSample
	g.GPUUtilization = nvdevice.Read(s.util)
	return []nvdevice.TelemetrySample{g}, nil
}

func TestSamplerReadsOncePerInterval(t *testing.T) {
	const interval = 10 * time.Second
	fc := clocktesting.NewFakeClock(time.Unix(1000, 0))
	r := &signalReader{reads: make(chan struct{}, 10)}
	c := NewCollector(r, "n1", interval)
	c.clock = fc
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); c.Run(ctx) }()
	waitRead := func(what string) {
		t.Helper()
		select {
		case <-r.reads:
		case <-time.After(5 * time.Second):
			t.Fatalf("no read %s", what)
		}
	}
	noRead := func(what string) {
		t.Helper()
		select {
		case <-r.reads:
			t.Fatalf("a read %s", what)
		case <-time.After(50 * time.Millisecond):
		}
	}
	waitRead("at start")
	require.Eventually(t, fc.HasWaiters, 5*time.Second, time.Millisecond, "the sampler waits on its ticker")
	for _, step := range []struct {
		advance time.Duration
		read    bool
	}{
		{interval - time.Millisecond, false},
		{time.Millisecond, true}, // one interval after the start
		{interval / 2, false},
		{interval / 2, true},
		{interval, true},
	} {
		fc.Step(step.advance)
		if step.read {
			waitRead("after " + step.advance.String())
		} else {
			noRead("after " + step.advance.String())
		}
	}
	cancel()
	fc.Step(interval)
	<-done
	noRead("after Run returned")
}

func TestSlowReadDoesNotBlockScrape(t *testing.T) {
	r := &signalReader{reads: make(chan struct{}, 1), release: make(chan struct{}), util: 0.25}
	c := NewCollector(r, "n1", time.Second)
	c.Sample(context.Background()) // ungated: 0.25
	<-r.reads
	r.gated = true
	r.mu.Lock()
	r.util = 0.75
	r.mu.Unlock()
	sampleDone := make(chan struct{})
	go func() { defer close(sampleDone); c.Sample(context.Background()) }()
	<-r.reads // the read is under way, and blocked
	for _, tc := range []struct {
		name string
		want string
	}{
		{"a scrape during the read gets the last sample", `gpudra_gpu_utilization_ratio{` + gpuL + `} 0.25`},
		{"and so does the next one", `gpudra_gpu_utilization_ratio{` + gpuL + `} 0.25`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := make(chan string, 1)
			go func() { got <- series(t, c, "gpudra_gpu_utilization_ratio") }()
			select {
			case s := <-got:
				assert.Equal(t, tc.want, s)
			case <-time.After(5 * time.Second):
				t.Fatal("the scrape waited for the read")
			}
		})
	}
	c.Sample(context.Background()) // returns at once: a read is under way
	r.release <- struct{}{}
	<-sampleDone
	assert.Equal(t, `gpudra_gpu_utilization_ratio{`+gpuL+`} 0.75`, series(t, c, "gpudra_gpu_utilization_ratio"), "the read's sample, once it completed")
}

func TestSampleDurationAndTime(t *testing.T) {
	for _, tc := range []struct {
		name     string
		took     time.Duration
		wantDur  string
		wantTime string
	}{
		{"a quick read", 0, "0", "1000"},
		{"a read of 250 ms", 250 * time.Millisecond, "0.25", "1000.25"},
		{"a read of 3 s", 3 * time.Second, "3", "1003"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fc := clocktesting.NewFakeClock(time.Unix(1000, 0))
			r := &signalReader{reads: make(chan struct{}, 1), onRead: func() { fc.Step(tc.took) }}
			c := NewCollector(r, "n1", time.Second)
			c.clock = fc
			assert.Empty(t, series(t, c, "gpudra_telemetry_last_sample_timestamp_seconds"), "no sample yet")
			c.Sample(context.Background())
			assert.Equal(t, `gpudra_telemetry_sample_duration_seconds{node="n1"} `+tc.wantDur, series(t, c, "gpudra_telemetry_sample_duration_seconds"))
			assert.Equal(t, `gpudra_telemetry_last_sample_timestamp_seconds{node="n1"} `+tc.wantTime, series(t, c, "gpudra_telemetry_last_sample_timestamp_seconds"))
		})
	}
}

func splitLines(s string) []string { return strings.Split(s, "\n") }

func joinLines(l []string) string { return strings.Join(l, "\n") }

func countLines(s, suffix string) int {
	n := 0
	for _, l := range splitLines(s) {
		if strings.HasSuffix(l, suffix) {
			n++
		}
	}
	return n
}

// A read that hangs in the driver (the simulator's telemetry hook blocks
// on one GPU) makes telemetry_up 0 once it has taken longer than one
// interval, and the sample's age grows; the frozen figures are not sent.
// When the read completes, the new sample is fresh again.
func TestHungReadIsNotUp(t *testing.T) {
	const interval = 10 * time.Second
	m, err := sim.NewBuiltin("dgx-h100-nomig", "n1")
	require.NoError(t, err)
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	var hang atomic.Bool // the reading of GPU 3 hangs until release
	release := make(chan struct{})
	entered := make(chan struct{}, 1)
	m.SetTelemetryHook(func(gpu string) {
		if gpu == inv.GPUs[3].UUID {
			entered <- struct{}{}
			if hang.Load() {
				<-release
			}
		}
	})
	fc := clocktesting.NewFakeClock(time.Unix(1000, 0))
	c := NewCollector(m, "n1", interval)
	c.SetClock(fc)
	c.SetClaims(func() []prepared.Claim { return nil })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); c.Run(ctx) }()
	defer func() { cancel(); <-done }()
	<-entered // the first pass, not hung
	require.Eventually(t, fc.HasWaiters, 5*time.Second, time.Millisecond, "the sampler waits on its ticker")

	check := func(what, up, age string, devices int) {
		t.Helper()
		assert.Equal(t, `gpudra_telemetry_up{node="n1"} `+up, series(t, c, "gpudra_telemetry_up"), what)
		assert.Equal(t, `gpudra_telemetry_last_sample_age_seconds{node="n1"} `+age, series(t, c, "gpudra_telemetry_last_sample_age_seconds"), what)
		assert.Equal(t, devices, testutil.CollectAndCount(c, "gpudra_gpu_power_watts"), "%s: power series", what)
		assert.Equal(t, devices, testutil.CollectAndCount(c, "gpudra_device_free"), "%s: device_free series", what)
	}
	check("after the first pass", "1", "0", 8)

	hang.Store(true)
	fc.Step(interval) // the second pass starts, and hangs on GPU 3
	select {
	case <-entered:
	case <-time.After(5 * time.Second):
		t.Fatal("no second pass")
	}
	check("a read under way", "1", "10", 8)
	fc.Step(interval)
	check("a read under way for one interval", "1", "20", 8)
	fc.Step(time.Millisecond)
	check("a read hung for longer than one interval", "0", "20.001", 0)
	fc.Step(time.Minute)
	check("a read hung for over a minute", "0", "80.001", 0)

	hang.Store(false)
	close(release)
	require.Eventually(t, func() bool { return series(t, c, "gpudra_telemetry_up") == `gpudra_telemetry_up{node="n1"} 1` },
		5*time.Second, time.Millisecond, "the hung read completes")
	check("the hung read completed", "1", "0", 8)
}

// A sample older than three intervals is stale, even with no read under
// way (the sampler stopped).
func TestStaleSampleIsNotUp(t *testing.T) {
	const interval = 10 * time.Second
	fc := clocktesting.NewFakeClock(time.Unix(1000, 0))
	c := NewCollector(&fakeReader{samples: []nvdevice.TelemetrySample{gpuSample}}, "n1", interval)
	c.SetClock(fc)
	c.Sample(context.Background())
	for _, step := range []struct {
		advance time.Duration
		up, age string
	}{
		{0, "1", "0"},
		{3 * interval, "1", "30"},
		{time.Millisecond, "0", "30.001"},
		{time.Hour, "0", "3630.001"},
	} {
		fc.Step(step.advance)
		assert.Equal(t, `gpudra_telemetry_up{node="n1"} `+step.up, series(t, c, "gpudra_telemetry_up"), "age %s", step.age)
		assert.Equal(t, `gpudra_telemetry_last_sample_age_seconds{node="n1"} `+step.age, series(t, c, "gpudra_telemetry_last_sample_age_seconds"))
		want := 0
		if step.up == "1" {
			want = 1
		}
		assert.Equal(t, want, testutil.CollectAndCount(c, "gpudra_gpu_utilization_ratio"), "age %s: the utilization series", step.age)
	}
	c.Sample(context.Background())
	assert.Equal(t, `gpudra_telemetry_up{node="n1"} 1`, series(t, c, "gpudra_telemetry_up"), "a new sample is fresh")
}
