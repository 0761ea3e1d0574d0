package sim

import (
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// NVMLTiming is a timing model of the NVML calls the NVML backend
// (pkg/nvdevice/nvml) makes in a telemetry pass: with it set
// (SetNVMLTiming), the machine's Telemetry charges, for every GPU and MIG
// device, the calls the backend would make for it, in the same cadence
// (nvdevice.TelemetryOptions), so that
// what a pass costs on a real node can be measured without a GPU
// (BenchmarkTelemetryPass in pkg/telemetry). It is off by default: tests
// pay nothing for it.
type NVMLTiming struct {
	// CPU is each NVML function's time on the calling thread, by its C
	// name; a function not listed costs DefaultCPU.
	CPU        map[string]time.Duration
	DefaultCPU time.Duration
	// Wait is time a call waits without using the CPU, by function.
	Wait map[string]time.Duration
	// Spend, when set, is given every call as it is made (a harness may
	// spin for cpu and sleep for wait, to load a machine as NVML would).
	// Nil only counts the calls (NVMLLedger), which keeps a benchmark
	// deterministic on a noisy machine.
	Spend func(function string, cpu, wait time.Duration)
	// PerCallReads charges what the backend asked before issue 50's part
	// 2, the pass the H200's capture timed: a call per reading (power,
	// the two PCIe throughput windows, the power limit, four ECC counts,
	// the remapped rows) where the backend now makes one
	// nvmlDeviceGetFieldValues call, each MIG device's two process lists
	// where it now lists them on the GPU's handle, and the MPS list on
	// every device (TelemetryOptions.MPSDevices ignored).
	PerCallReads bool
	// FullEntries charges what the backend asked before it checked its
	// kept entries: every read of the devices reads every GPU's entry in
	// full (entryCalls), and a reading NVML refuses as not supported (a
	// MIG-mode GPU's utilization and own GPM sample) is asked every pass.
	// PerCallReads implies it.
	FullEntries bool
}

// The H200's figures (testdata/real-gpus/h200/telemetry-processes, the
// NVML backend's TestRealGPUTelemetry on one H200, driver 580.159.04, in a
// VM, a CUDA process busy on it, MIG off, no NVLink): a pass took 83.7,
// 66.6 and 61.1 ms. The capture times passes, not calls, so the model
// splits the steady pass (61.1 ms, the third) as follows:
//   - nvmlDeviceGetPcieThroughput samples a byte counter over a 20 ms
//     window (nvml.h), twice a pass: 40 ms of waiting;
//   - GpmSampleAlloc, GpmSampleFree and GpmMetricsGet work on host memory
//     (nvml.h: they allocate, free and compute from two samples): next to
//     nothing, 5 us;
//   - the other 89 calls the backend made in that pass (94 in all:
//     counted with go-nvml's mock on the same GPU shape, MIG capable and
//     off, 36 NVLink states asked, one process) share the remaining
//     21.1 ms: 0.236 ms each. Every one of them is charged as CPU, an upper
//     bound: part of a real call waits on the GPU's firmware.
//
// A per-function split needs a GPU: a run of the nvml package's
// TestRealGPUCallCosts, which times each call (docs/benchmarks.md).
const (
	h200PCIeWindow = 20 * time.Millisecond
	h200HostOnly   = 5 * time.Microsecond
	h200PerCall    = 236 * time.Microsecond
)

// H200NVMLTiming is the model calibrated on the H200 (the constants above).
func H200NVMLTiming() *NVMLTiming {
	return &NVMLTiming{
		DefaultCPU: h200PerCall,
		CPU: map[string]time.Duration{
			"nvmlGpmSampleAlloc": h200HostOnly,
			"nvmlGpmSampleFree":  h200HostOnly,
			"nvmlGpmMetricsGet":  h200HostOnly,
		},
		Wait: map[string]time.Duration{"nvmlDeviceGetPcieThroughput": h200PCIeWindow},
	}
}

// NVMLLedger is what the modelled calls cost since SetNVMLTiming.
type NVMLLedger struct {
	Calls     int
	CPU, Wait time.Duration
	// ByFunction counts the calls of each function.
	ByFunction map[string]int
}

// nvmlModel is the machine's timing model state.
type nvmlModel struct {
	mu     sync.Mutex
	timing *NVMLTiming
	ledger NVMLLedger
	// devices is what the backend kept of the devices at its last full
	// read of them (a fingerprint of the GPUs and MIG devices): a fast
	// pass reads them again only when it changed, as the backend does
	// after a MIG change it made.
	devices string
}

// SetNVMLTiming turns the timing model on (t) or off (nil), and starts a
// new ledger.
func (m *Machine) SetNVMLTiming(t *NVMLTiming) {
	m.nvml.mu.Lock()
	defer m.nvml.mu.Unlock()
	m.nvml.timing = t
	m.nvml.ledger = NVMLLedger{ByFunction: map[string]int{}}
	m.nvml.devices = ""
}

// NVMLLedger returns what the modelled calls cost since SetNVMLTiming.
func (m *Machine) NVMLLedger() NVMLLedger {
	m.nvml.mu.Lock()
	defer m.nvml.mu.Unlock()
	l := m.nvml.ledger
	l.ByFunction = make(map[string]int, len(m.nvml.ledger.ByFunction))
	for k, v := range m.nvml.ledger.ByFunction {
		l.ByFunction[k] = v
	}
	return l
}

// nvmlCalls is a list of calls to charge: function -> count.
type nvmlCalls map[string]int

func (c nvmlCalls) add(fn string, n int) {
	if n > 0 {
		c[fn] += n
	}
}

// charge counts the calls, and spends them when the model says so. It is
// called without m.mu held, so that a Spend that sleeps holds up no MIG
// change, as the backend holds its lock only for its device list.
func (m *Machine) charge(calls nvmlCalls) {
	m.nvml.mu.Lock()
	t := m.nvml.timing
	if t == nil {
		m.nvml.mu.Unlock()
		return
	}
	type spent struct {
		fn        string
		cpu, wait time.Duration
		n         int
	}
	var spend []spent
	for fn, n := range calls {
		cpu, ok := t.CPU[fn]
		if !ok {
			cpu = t.DefaultCPU
		}
		wait := t.Wait[fn]
		m.nvml.ledger.Calls += n
		m.nvml.ledger.CPU += time.Duration(n) * cpu
		m.nvml.ledger.Wait += time.Duration(n) * wait
		m.nvml.ledger.ByFunction[fn] += n
		spend = append(spend, spent{fn, cpu, wait, n})
	}
	m.nvml.mu.Unlock()
	if t.Spend != nil {
		for _, s := range spend {
			for range s.n {
				t.Spend(s.fn, s.cpu, s.wait)
			}
		}
	}
}

// modelOn says whether the timing model is on, and what it charges: the
// reads before issue 50's part 2 (NVMLTiming.PerCallReads), the full
// entries (NVMLTiming.FullEntries).
func (m *Machine) modelOn() (on, perCall, fullEntries bool) {
	m.nvml.mu.Lock()
	defer m.nvml.mu.Unlock()
	t := m.nvml.timing
	if t == nil {
		return false, false, false
	}
	return true, t.PerCallReads, t.PerCallReads || t.FullEntries
}

// entryRead is what a pass reads of the devices, as the backend does.
type entryRead int

const (
	// keptEntries: none, the kept entries (a fast pass).
	keptEntries entryRead = iota
	// checkedEntries: each kept entry checked (the backend's sameEntry).
	checkedEntries
	// fullEntries: every GPU's entry read in full.
	fullEntries
)

// devicesReadAgain says how this pass reads the devices, as the backend
// does: in full on the first pass and after the devices changed (a MIG
// device made or destroyed through the backend), or when full says so
// (NVMLTiming.FullEntries) and the pass is told to read them; checked when
// it is told to read them (not opts.KeepDevices) and they did not change;
// else not at all.
func (m *Machine) devicesReadAgain(inv *nvdevice.Inventory, opts nvdevice.TelemetryOptions, full bool) entryRead {
	var b strings.Builder
	for _, g := range inv.GPUs {
		b.WriteString(g.UUID)
		for _, d := range g.MIG.Devices {
			b.WriteString("," + d.UUID)
		}
		b.WriteString(";")
	}
	m.nvml.mu.Lock()
	defer m.nvml.mu.Unlock()
	changed := m.nvml.devices != b.String()
	m.nvml.devices = b.String()
	switch {
	case changed, !opts.KeepDevices && full:
		return fullEntries
	case !opts.KeepDevices:
		return checkedEntries
	}
	return keptEntries
}

// checkedEntryCalls are the calls of the backend's check of a kept entry
// (sameEntry): the GPU's handle and UUID, its MIG mode, in MIG mode its MIG
// device handles and their UUIDs, and its links' states until one is up.
func checkedEntryCalls(c nvmlCalls, g *nvdevice.GPU) {
	c.add("nvmlDeviceGetHandleByIndex", 1)
	c.add("nvmlDeviceGetUUID", 1)
	if g.MIG.Capable {
		c.add("nvmlDeviceGetMigMode", 1)
	}
	if g.MIG.Enabled {
		c.add("nvmlDeviceGetMaxMigDeviceCount", 1)
		c.add("nvmlDeviceGetMigDeviceHandleByIndex", 7)
		c.add("nvmlDeviceGetUUID", len(g.MIG.Devices))
	}
	for _, l := range g.NVLink.Links {
		c.add("nvmlDeviceGetNvLinkState", 1)
		if l.Active {
			break
		}
	}
}

// nvlinkStatesAsked is how many link states the backend asks of each GPU
// (nvml.NVLINK_MAX_LINKS; it stops at none).
const nvlinkStatesAsked = 36

// entryCalls are the calls of the backend's inventory entry of a GPU
// (readGPU: identity, MIG mode, profiles and placements, NVLink links,
// fabric; its MIG devices and their handles in MIG mode), counted with
// go-nvml's mock on an H100-shaped GPU (pkg/nvdevice/nvml).
func entryCalls(c nvmlCalls, g *nvdevice.GPU) {
	for _, fn := range []string{
		"nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetMinorNumber",
		"nvmlDeviceGetBrand", "nvmlDeviceGetArchitecture", "nvmlDeviceGetCudaComputeCapability",
		"nvmlDeviceGetMemoryInfo", "nvmlDeviceGetPciInfo", "nvmlDeviceGetMigMode", "nvmlDeviceGetGpuFabricInfo",
	} {
		c.add(fn, 1)
	}
	c.add("nvmlDeviceGetNvLinkState", nvlinkStatesAsked)
	links := activeLinks(g)
	c.add("nvmlDeviceGetNvLinkRemotePciInfo", links)
	c.add("nvmlDeviceGetNvLinkRemoteDeviceType", links)
	if !g.MIG.Capable {
		return
	}
	c.add("nvmlDeviceGetGpuInstanceProfileInfo", 18) // nvml.GPU_INSTANCE_PROFILE_COUNT
	c.add("nvmlDeviceGetGpuInstancePossiblePlacements", len(g.MIG.Profiles))
	if !g.MIG.Enabled {
		return
	}
	// readMigDevices: every profile's GPU instances, each one's compute
	// instances by compute profile; migUUIDs: every MIG device handle.
	c.add("nvmlDeviceGetGpuInstances", len(g.MIG.Profiles))
	c.add("nvmlDeviceGetMaxMigDeviceCount", 1)
	c.add("nvmlDeviceGetMigDeviceHandleByIndex", 7)
	for _, d := range g.MIG.Devices {
		c.add("nvmlGpuInstanceGetInfo", 1)
		c.add("nvmlGpuInstanceGetComputeInstanceProfileInfo", 9) // nvml.COMPUTE_INSTANCE_PROFILE_COUNT
		c.add("nvmlGpuInstanceGetComputeInstances", computeProfilesOf(d.Profile))
		c.add("nvmlComputeInstanceGetInfo", 1)
		c.add("nvmlDeviceGetGpuInstanceId", 1)
		c.add("nvmlDeviceGetComputeInstanceId", 1)
		c.add("nvmlDeviceGetUUID", 1)
	}
	// The telemetry's own MIG device handles (migHandles).
	c.add("nvmlDeviceGetMaxMigDeviceCount", 1)
	c.add("nvmlDeviceGetMigDeviceHandleByIndex", 7)
	c.add("nvmlDeviceGetUUID", len(g.MIG.Devices))
}

// computeProfilesOf is how many compute-instance profiles (1, 2, 3, 4 and 7
// slices) fit a GPU instance of the profile ("3g.71gb": 3).
func computeProfilesOf(profile string) int {
	slices, err := strconv.Atoi(strings.SplitN(profile, "g", 2)[0])
	if err != nil {
		return 1
	}
	n := 0
	for _, s := range []int{1, 2, 3, 4, 7} {
		if s <= slices {
			n++
		}
	}
	return n
}

// readingCalls are the calls of one GPU's readings in a pass, and of its
// MIG devices' (the backend's sampleGPU; perCall: as before issue 50's
// part 2, NVMLTiming.PerCallReads). refusedAsked says whether the pass
// asks the readings NVML refuses as not supported, which the backend asks
// only when it read the devices (or every pass, NVMLTiming.FullEntries):
// a MIG-mode GPU's utilization and its own GPM sample (allocated, refused,
// freed).
func readingCalls(c nvmlCalls, g *nvdevice.GPU, s []nvdevice.TelemetrySample, gpm, perCall, refusedAsked bool, opts nvdevice.TelemetryOptions) {
	gpmSample := func(get string) {
		if gpm {
			c.add("nvmlGpmSampleAlloc", 1)
			c.add(get, 1)
			c.add("nvmlGpmMetricsGet", 1)
			c.add("nvmlGpmSampleFree", 1)
		}
	}
	mps := func(uuid string) bool { return perCall || opts.MPS(uuid) }
	processLists := func(uuid string) {
		c.add("nvmlDeviceGetComputeRunningProcesses", 1)
		if mps(uuid) {
			c.add("nvmlDeviceGetMPSComputeRunningProcesses", 1)
		}
	}
	for i := range s {
		d := &s[i]
		if d.IsMIG() {
			c.add("nvmlDeviceGetMemoryInfo", 1)
			if perCall {
				processLists(d.UUID)
			}
			gpmSample("nvmlGpmMigSampleGet")
			continue
		}
		// A MIG-mode GPU's utilization and GPM sample NVML refuses as not
		// supported: asked again only with refusedAsked.
		migRefused := g.MIG.Enabled && !perCall
		if !migRefused || refusedAsked {
			c.add("nvmlDeviceGetUtilizationRates", 1)
		}
		for _, fn := range []string{
			"nvmlDeviceGetMemoryInfo",
			"nvmlDeviceGetTemperature", "nvmlDeviceGetClockInfo", "nvmlDeviceGetCurrentClocksEventReasons",
		} {
			c.add(fn, 1)
		}
		switch {
		case !perCall:
			// Power, the PCIe byte counters and, on a full pass, the slow
			// readings: one call.
			c.add("nvmlDeviceGetFieldValues", 1)
		case opts.SkipSlow:
			c.add("nvmlDeviceGetPowerUsage", 1)
			c.add("nvmlDeviceGetPcieThroughput", 2)
		default:
			c.add("nvmlDeviceGetPowerUsage", 1)
			c.add("nvmlDeviceGetPcieThroughput", 2)
			c.add("nvmlDeviceGetEnforcedPowerLimit", 1)
			c.add("nvmlDeviceGetTotalEccErrors", 4)
			c.add("nvmlDeviceGetRemappedRows", 1)
		}
		switch {
		case !migRefused:
			gpmSample("nvmlGpmSampleGet")
		case gpm && refusedAsked:
			c.add("nvmlGpmSampleAlloc", 1)
			c.add("nvmlGpmSampleGet", 1)
			c.add("nvmlGpmSampleFree", 1)
		}
		switch {
		case !g.MIG.Enabled:
			processLists(d.UUID)
			if len(d.Processes) > 0 {
				c.add("nvmlDeviceGetProcessUtilization", 1)
			}
		case !perCall:
			// Every MIG device's processes, on the GPU's handle.
			c.add("nvmlDeviceGetComputeRunningProcesses", 1)
			if opts.MPSAny(g.MIG.Devices) {
				c.add("nvmlDeviceGetMPSComputeRunningProcesses", 1)
			}
		}
	}
}
