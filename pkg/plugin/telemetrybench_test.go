package plugin

import (
	"context"
	"sort"
	"testing"
	"time"

	drapb "k8s.io/kubelet/pkg/apis/dra/v1"

	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/telemetry"
)

// spendNVML makes the simulator's modelled NVML calls cost what they would
// on the H200: it spins for their CPU time and sleeps for their waits
// (the PCIe throughput windows), so that a telemetry pass loads the
// machine as the NVML backend's would.
func spendNVML(_ string, cpu, wait time.Duration) {
	for end := time.Now().Add(cpu); time.Now().Before(end); {
	}
	time.Sleep(wait)
}

// BenchmarkPrepareWithTelemetry is the prepare and unprepare round trip of
// BenchmarkPrepareUnprepareFullGPU (one whole GPU of an 8-GPU node, through
// the DRA socket) with the node's telemetry sampler off, and on with its
// NVML calls costing what the H200's do (sim.H200NVMLTiming, spent: spun
// and slept), in the sampler's cadence (on) and reading everything every
// pass as before issue 50 (on-every-pass). The modes alternate in blocks
// of 20 claims over 20 rounds, so that the machine's noise falls on each
// alike. The sampler runs every 500 ms, 20 times its default rate, so that
// more prepares than one in a hundred overlap a pass: the p99 is then a
// prepare that met one. Run it with -benchtime 1x.
func BenchmarkPrepareWithTelemetry(b *testing.B) {
	const rounds, block = 20, 20
	e := newEnv(b)
	c := claim("bench", []string{"gpu-3"})
	kubelet, _, _ := startPluginWithMetrics(b, e, NewMetrics(), c)
	req := []*drapb.Claim{{Namespace: c.Namespace, Name: c.Name, Uid: string(c.UID)}}
	ctx := context.Background()
	timing := sim.H200NVMLTiming()
	timing.Spend = spendNVML
	e.machine.SetNVMLTiming(timing)

	// The sampler's cadence compressed by the same 20: the slow readings
	// every 3 s (six passes, as one minute is at 10 s).
	const interval, slow = 500 * time.Millisecond, 3 * time.Second
	modes := []struct {
		name string
		col  *telemetry.Collector // nil: no sampler
	}{{"off", nil}, {"on", telemetry.NewCollector(e.machine, pool, interval)}, {"on-every-pass", telemetry.NewCollector(e.machine, pool, interval)}}
	modes[1].col.SetSlowInterval(slow)
	modes[2].col.SetSlowInterval(0)
	lat := map[string][]time.Duration{}
	for b.Loop() {
		clear(lat)
		for range rounds {
			for _, mode := range modes {
				stop := func() {}
				if mode.col != nil {
					// A block samples as Run does; the collector keeps its
					// cadence from one block to the next.
					runCtx, cancel := context.WithCancel(ctx)
					done := make(chan struct{})
					go func() {
						defer close(done)
						t := time.NewTicker(interval)
						defer t.Stop()
						for {
							mode.col.Sample(runCtx)
							select {
							case <-runCtx.Done():
								return
							case <-t.C:
							}
						}
					}()
					stop = func() { cancel(); <-done }
				}
				for range block {
					start := time.Now()
					resp, err := kubelet.dra.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: req})
					if err != nil || resp.Claims["bench"].Error != "" {
						b.Fatalf("prepare: %v %v", err, resp)
					}
					lat[mode.name] = append(lat[mode.name], time.Since(start))
					un, err := kubelet.dra.NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{Claims: req})
					if err != nil || un.Claims["bench"].Error != "" {
						b.Fatalf("unprepare: %v %v", err, un)
					}
				}
				stop()
			}
		}
	}
	pct := func(l []time.Duration, p float64) float64 {
		sort.Slice(l, func(i, j int) bool { return l[i] < l[j] })
		return float64(l[int(p*float64(len(l)-1))].Microseconds()) / 1000
	}
	off99 := pct(lat["off"], 0.99)
	for _, mode := range modes {
		b.ReportMetric(pct(lat[mode.name], 0.50), mode.name+"-prepare-p50-ms")
		b.ReportMetric(pct(lat[mode.name], 0.99), mode.name+"-prepare-p99-ms")
		if mode.col != nil {
			b.ReportMetric(pct(lat[mode.name], 0.99)/off99, mode.name+"-p99-x-off")
		}
	}
	ledger := e.machine.NVMLLedger()
	b.ReportMetric(float64(ledger.Calls), "nvml-calls")
}
