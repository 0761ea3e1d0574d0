package telemetry

import (
	"context"
	"fmt"
	"syscall"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/prepared"
)

// passBenchNodes are the nodes of BenchmarkTelemetryPass: an HGX H200 with
// MIG off (8 GPUs), and with MIG on and every GPU cut into seven 1g.18gb
// devices (56 MIG devices); every device busy with one process.
func passBenchNodes() []struct {
	name string
	spec sim.MachineSpec
} {
	mig := sim.MachineSpec{Name: "hgx-h200-mig56", GPUModel: sim.ModelH200SXM, GPUCount: 8, NVLink: sim.NVLinkNVSwitch,
		MigEnabled: sim.MigEnabledSpec{All: true}}
	for g := range 8 {
		for s := range 7 {
			mig.MigDevices = append(mig.MigDevices, sim.MigDeviceSpec{GPU: g, Profile: "1g.18gb", Start: s})
		}
	}
	return []struct {
		name string
		spec sim.MachineSpec
	}{
		{"gpus-8", sim.MachineSpec{Name: "hgx-h200-nomig", GPUModel: sim.ModelH200SXM, GPUCount: 8, NVLink: sim.NVLinkNVSwitch}},
		{"mig-56", mig},
	}
}

// processCPU is the CPU time (user and system) the process has used.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkTelemetryPass is what one sampling pass costs a node, on the
// simulator's NVML timing model calibrated on the H200
// (sim.H200NVMLTiming), in three modes: every pass reading everything with
// a call per reading, as before issue 50 (every-pass); the sampler's
// cadence (the slow readings every minute, the devices every ten) with a
// call per reading (slow-cadence, issue 50's first step); and the cadence
// with the field values, the MIG processes on the GPU's handle and no MPS
// list on a device not shared with MPS (field-values, issue 50's part 2);
// and that with the kept entries checked rather than read again every ten
// minutes, and the readings NVML refused (a MIG-mode GPU's utilization
// and own GPM sample) not asked again in between (checked-entries, now).
// Passes are 10 s apart on a fake clock, so a run's average counts the
// full passes at their share.
//
//   - cpu-ms/pass: the modelled NVML CPU plus the CPU this process spent
//     (the collector and the simulator; getrusage), the figure the target
//     is set on;
//   - nvml-cpu-ms/pass, nvml-calls/pass: the modelled NVML calls alone;
//   - nvml-wall-ms/pass: the modelled NVML time with its waits (the PCIe
//     throughput windows): how long a pass would take.
//
// The model only counts (no Spend): the figures do not depend on how
// loaded this machine is.
func BenchmarkTelemetryPass(b *testing.B) {
	for _, node := range passBenchNodes() {
		for _, mode := range []struct {
			name                 string
			slow                 time.Duration
			perCall, fullEntries bool
		}{
			{"every-pass", 0, true, true},
			{"slow-cadence", DefaultSlowInterval, true, true},
			{"field-values", DefaultSlowInterval, false, true},
			{"checked-entries", DefaultSlowInterval, false, false},
		} {
			b.Run(fmt.Sprintf("%s/%s", node.name, mode.name), func(b *testing.B) {
				ctx := context.Background()
				m, err := sim.New(node.spec, "node-a")
				if err != nil {
					b.Fatal(err)
				}
				inv, err := m.Inventory(ctx)
				if err != nil {
					b.Fatal(err)
				}
				pid := 1000
				for _, g := range inv.GPUs {
					devices := []string{g.UUID}
					if g.MIG.Enabled {
						devices = devices[:0]
						for _, d := range g.MIG.Devices {
							devices = append(devices, d.UUID)
						}
					}
					for _, d := range devices {
						pid++
						if err := m.StartProcess(d, pid, 0.8, 4<<30); err != nil {
							b.Fatal(err)
						}
					}
				}
				timing := sim.H200NVMLTiming()
				timing.PerCallReads, timing.FullEntries = mode.perCall, mode.fullEntries
				m.SetNVMLTiming(timing)
				clk := clocktesting.NewFakeClock(time.Unix(1e9, 0))
				c := NewCollector(m, "node-a", DefaultInterval)
				c.SetClock(clk)
				c.SetSlowInterval(mode.slow)
				// The plugin's claims: none shared with MPS (a node of
				// whole GPUs and MIG devices), so no MPS client list.
				c.SetClaims(func() []prepared.Claim { return nil })
				c.Sample(ctx) // the first pass: GPM's first sample
				before, cpu := m.NVMLLedger(), processCPU(b)
				passes := 0
				for b.Loop() {
					clk.Step(DefaultInterval)
					c.Sample(ctx)
					passes++
				}
				b.StopTimer()
				after, goCPU := m.NVMLLedger(), processCPU(b)-cpu
				perPass := func(d time.Duration) float64 { return d.Seconds() * 1000 / float64(passes) }
				nvmlCPU := after.CPU - before.CPU
				b.ReportMetric(perPass(nvmlCPU+goCPU), "cpu-ms/pass")
				b.ReportMetric(perPass(nvmlCPU), "nvml-cpu-ms/pass")
				b.ReportMetric(perPass(nvmlCPU+after.Wait-before.Wait), "nvml-wall-ms/pass")
				b.ReportMetric(float64(after.Calls-before.Calls)/float64(passes), "nvml-calls/pass")
			})
		}
	}
}
