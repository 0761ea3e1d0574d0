package gpusmoke

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/telemetry"
)

// telemetryPassGap is the time between the two telemetry passes: GPM
// figures are over it.
var telemetryPassGap = time.Second

// scrapeTelemetry reads the GPU's telemetry through the kubelet plugin's
// collector (issue 36), exactly as its /metrics would serve it, and keeps
// the scrape in the results (telemetry.prom): what the real NVML path
// gives, field by field, and what it leaves unsupported. It scrapes after
// a second pass, as the plugin's sampler makes one an interval after its
// first: GPM figures (SM activity, NVLink throughput) need two samples.
func scrapeTelemetry(ctx context.Context, w io.Writer, res *results, r nvdevice.TelemetryReader) error {
	reg := prometheus.NewRegistry()
	c := telemetry.NewCollector(r, GPUNode, 0)
	c.Sample(ctx) // the pass the plugin's sampler makes at its start
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(telemetryPassGap):
	}
	c.Sample(ctx) // the next: the scrape has what it read over the gap
	if err := reg.Register(c); err != nil {
		return fmt.Errorf("register the telemetry collector: %w", err)
	}
	families, err := reg.Gather()
	if err != nil {
		return fmt.Errorf("gather: %w", err)
	}
	var buf bytes.Buffer
	enc := expfmt.NewEncoder(&buf, expfmt.NewFormat(expfmt.TypeTextPlain))
	series := 0
	for _, mf := range families {
		if err := enc.Encode(mf); err != nil {
			return err
		}
		series += len(mf.GetMetric())
	}
	fmt.Fprintf(w, "== telemetry: %d metric families, %d series through the plugin's collector (telemetry.prom)\n", len(families), series)
	return res.write("telemetry.prom", buf.String())
}
