package scalebench

import (
	"bytes"
	"image/png"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParseMetrics(t *testing.T) {
	m, err := parseMetrics(strings.NewReader(`# HELP x
gpudra_controller_leader 1
gpudra_gang_plan_duration_seconds_bucket{le="0.001"} 3
gpudra_gang_plan_duration_seconds_sum 0.25
gpudra_gang_plan_duration_seconds_count 5
gpudra_class_devices{device_class="a",state="free"} 7 1700000000
gpudra_class_devices{device_class="b",state="free"} 2
`))
	require.NoError(t, err)
	assert.Equal(t, map[string]float64{"gpudra_controller_leader": 1, "gpudra_gang_plan_duration_seconds_sum": 0.25,
		"gpudra_gang_plan_duration_seconds_count": 5, "gpudra_class_devices": 9}, m)
}

func TestLineAndPlot(t *testing.T) {
	w := func(name string, pods int, lat time.Duration) Workload {
		return Workload{Name: name, Pods: pods, Bound: pods, Span: time.Second, PodsPerSec: float64(pods), Latencies: []time.Duration{lat}}
	}
	res := Result{Points: []Point{
		{Mix: MixMigOff, Nodes: 100, Devices: 800, Workloads: []Workload{w("gpu", 10, time.Second)}, CtrlRSS: 50 << 20},
		{Mix: MixMigOff, Nodes: 300, Devices: 2400, Workloads: []Workload{w("gpu", 10, time.Second), w("gangs 1x8x8", 8, time.Minute)},
			CtrlIdleCPU: 0.5, CtrlRSS: 64 << 20, CPRSS: 1 << 30},
	}}
	assert.Equal(t, "scale nodes=300 devices=2400 pods_per_s=10.0 bound_p99=1s controller_idle_cpu=0.5 controller_rss=64", res.Line())
	require.NoError(t, res.AllBound())
	var b bytes.Buffer
	require.NoError(t, Plot(&b, res.Points))
	_, err := png.Decode(&b)
	require.NoError(t, err)
}

// A quick run draws no plot unless asked: its 50 nodes would replace the
// committed sweep's (issue 50).
func TestPlotPath(t *testing.T) {
	for _, tc := range []struct {
		name  string
		flag  string
		quick bool
		want  string
	}{
		{name: "sweep", want: DefaultPlot},
		{name: "quick", quick: true, want: ""},
		{name: "quick, asked for", flag: "/tmp/p.png", quick: true, want: "/tmp/p.png"},
		{name: "sweep elsewhere", flag: "/tmp/p.png", want: "/tmp/p.png"},
	} {
		t.Run(tc.name, func(t *testing.T) { assert.Equal(t, tc.want, PlotPath(tc.flag, tc.quick)) })
	}
}
