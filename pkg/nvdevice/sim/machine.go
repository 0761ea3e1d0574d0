// Package sim provides simulated GPU machines faithful to
// ../shared/facts/h100.md and to real H100 and H200 GPUs as captured in
// ../shared/real-gpus: the same product figures, the real H100 and H200 MIG
// profile tables with memory-slice placements, MIG creation that refuses what the
// hardware refuses, NVLink topology through NVSwitches or NVLink bridges
// between pairs of cards, multi-node fabric
// cliques, and injectable health faults.
package sim

import (
	"context"
	"fmt"
	"sync"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// Machine is a simulated node. It implements nvdevice.Interface and is safe
// for concurrent use.
type Machine struct {
	spec     MachineSpec
	nodeName string

	mu  sync.Mutex
	inv nvdevice.Inventory
	// snap is what Inventory reads: a deep copy of inv without the GPUs
	// that fell off the bus, shared by every InventorySnapshot caller and
	// never modified; nil when the machine changed since it was made
	// (changedLocked).
	snap    *nvdevice.Inventory
	fabric  map[string]nvdevice.FabricInfo
	lost    map[string]bool // GPU UUID -> fallen off the bus
	created int             // MIG devices created so far, for UUIDs
	health  *nvdevice.HealthBroadcaster
	closed  bool
	// timeSlices: GPU UUID -> time slice level last set.
	timeSlices map[string]int
	// faults is what health.go keeps of injected faults.
	faults faults
	// stepHook and failGIDestroy are the MIG test hooks (mighooks.go).
	stepHook      func(step string)
	failGIDestroy error
	// readFaults are injected Inventory failures (readfaults.go).
	readFaults readFaults
	// telemetryHook stands for each GPU's telemetry readings
	// (readfaults.go).
	telemetryHook func(gpuUUID string)
	// driverRoot is the fake driver root DriverFiles reads (driverroot.go).
	driverRoot string
	// feed is what was last read of the driver root's ProcessFeedFile.
	feed processFeed
	// load: GPU or MIG device UUID -> how busy it is, 0 to 1, for
	// Telemetry (telemetry.go).
	load map[string]float64
	// pcieSeen are the GPUs the last telemetry pass sampled: only they
	// have a PCIe rate in the next (telemetry.go: pcieRateOf).
	pcieSeen map[string]bool
	// usage is the processes on the devices and the ECC errors injected
	// (processes.go), for Telemetry.
	usage usage
	// driverUnloaded: the kernel driver is gone (driverload.go).
	driverUnloaded bool
	// nvml is the NVML timing model of the telemetry passes, off unless
	// set (nvmltiming.go); it has a lock of its own.
	nvml nvmlModel
}

var (
	_ nvdevice.Interface            = (*Machine)(nil)
	_ nvdevice.ComputePolicy        = (*Machine)(nil)
	_ nvdevice.InventorySnapshotter = (*Machine)(nil)
)

// New builds a machine from a spec. nodeName seeds the UUIDs, so two nodes
// built from the same spec have different GPUs, and the same node gets the
// same GPUs every time.
func New(spec MachineSpec, nodeName string) (*Machine, error) {
	if err := spec.Validate(); err != nil {
		return nil, fmt.Errorf("machine %q: %w", spec.Name, err)
	}
	driver, cuda := spec.DriverVersion, spec.CUDADriverVersion
	if driver == "" {
		driver = defaultDriverVersion
	}
	if cuda == "" {
		cuda = defaultCUDADriverVersion
	}
	m := &Machine{
		spec:     spec,
		nodeName: nodeName,
		fabric:   map[string]nvdevice.FabricInfo{},
		lost:     map[string]bool{},
		health:   nvdevice.NewHealthBroadcaster(),
		inv:      nvdevice.Inventory{DriverVersion: driver, CUDADriverVersion: cuda},
	}
	for i := 0; i < spec.GPUCount; i++ {
		model := gpuModels[spec.modelOf(i)]
		g := nvdevice.GPU{
			Index:                 i,
			Minor:                 i,
			UUID:                  "GPU-" + derivedUUID(nodeName, fmt.Sprint(i)),
			ProductName:           model.productName,
			Brand:                 model.brand,
			Architecture:          model.architecture,
			CUDAComputeCapability: model.computeCap,
			MemoryMiB:             model.memoryMiB,
			Engines:               model.engines,
			PCI: nvdevice.PCI{
				BusID:    gpuBusID(i),
				DeviceID: model.pciDeviceID,
				PCIeRoot: fmt.Sprintf("pci%04x:%02x", i/len(dgxH100Buses), (i%len(dgxH100Buses))/4*0x80),
			},
			NUMANode:          (i % len(dgxH100Buses)) / 4,
			DriverVersion:     driver,
			CUDADriverVersion: cuda,
			MIG: nvdevice.MIG{
				Capable:  len(model.profiles) > 0,
				Enabled:  spec.migEnabled(i),
				Profiles: append([]nvdevice.MigProfile(nil), model.profiles...),
			},
		}
		switch spec.NVLink {
		case NVLinkNVSwitch:
			// A product without NVLink (an L40S) on such a board is a card
			// in a PCIe slot: no links, no NVLink domain.
			if model.nvlinkLinks > 0 {
				g.NVLink.Links = switchLinks()
			}
		case NVLinkBridgedPairs:
			g.NVLink.Links = bridgeLinks(model.bridgeLinks, gpuBusID(i^1))
		}
		m.inv.GPUs = append(m.inv.GPUs, g)
		if spec.Fabric != nil {
			u, _ := parseUUID(spec.Fabric.ClusterUUID) // checked by Validate
			m.fabric[g.UUID] = nvdevice.FabricInfo{ClusterUUID: u, CliqueID: spec.Fabric.CliqueID}
		}
	}
	nvdevice.AssignNVLinkDomains(m.inv.GPUs, m.fabric)
	for i, d := range spec.MigDevices {
		req := nvdevice.MigCreateRequest{ParentUUID: m.inv.GPUs[d.GPU].UUID, Profile: d.Profile, Start: d.Start}
		if _, err := m.createLocked(req); err != nil {
			return nil, fmt.Errorf("machine %q: migDevices[%d]: %w", spec.Name, i, err)
		}
	}
	return m, nil
}

// NewBuiltin builds a built-in machine or one described in a YAML file.
func NewBuiltin(nameOrFile, nodeName string) (*Machine, error) {
	spec, err := LookupSpec(nameOrFile)
	if err != nil {
		return nil, err
	}
	return New(spec, nodeName)
}

// Spec returns the spec the machine was built from.
func (m *Machine) Spec() MachineSpec { return m.spec }

// switchLinks gives a GPU its 18 NVLink links spread over the 4 NVSwitches.
func switchLinks() []nvdevice.NVLinkLink {
	var links []nvdevice.NVLinkLink
	for sw, n := range nvswitchLinks {
		for j := 0; j < n; j++ {
			links = append(links, nvdevice.NVLinkLink{
				Index: len(links), Active: true, RemoteBusID: nvswitchBusID(sw), RemoteKind: nvdevice.RemoteNVSwitch,
			})
		}
	}
	return links
}

// bridgeLinks gives a GPU the n links of its NVLink bridges, all to its
// partner card at partnerBusID.
func bridgeLinks(n int, partnerBusID string) []nvdevice.NVLinkLink {
	links := make([]nvdevice.NVLinkLink, 0, n)
	for j := 0; j < n; j++ {
		links = append(links, nvdevice.NVLinkLink{
			Index: j, Active: true, RemoteBusID: partnerBusID, RemoteKind: nvdevice.RemoteGPU,
		})
	}
	return links
}

// Inventory returns a deep copy of the machine's state. GPUs that fell off
// the bus are not listed, as NVML can no longer read them.
func (m *Machine) Inventory(ctx context.Context) (*nvdevice.Inventory, error) {
	snap, err := m.InventorySnapshot(ctx)
	if err != nil {
		return nil, err
	}
	return copyInventory(snap), nil
}

// InventorySnapshot is Inventory without a copy for the caller: the same
// read-only value until the machine changes (nvdevice.InventorySnapshotter),
// so that a prepare does not copy every GPU of the node. As a read through
// NVML it fails while the driver is unloaded and when a failure was
// injected (FailInventory).
func (m *Machine) InventorySnapshot(ctx context.Context) (*nvdevice.Inventory, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil, fmt.Errorf("simulated machine %q is closed", m.spec.Name)
	}
	if err := m.driverLoadedLocked("nvmlDeviceGetCount"); err != nil {
		return nil, err
	}
	if err := m.readFaults.takeLocked(); err != nil {
		return nil, err
	}
	if m.snap == nil {
		snap := &nvdevice.Inventory{DriverVersion: m.inv.DriverVersion, CUDADriverVersion: m.inv.CUDADriverVersion}
		for _, g := range m.inv.GPUs {
			if !m.lost[g.UUID] {
				snap.GPUs = append(snap.GPUs, copyGPU(g))
			}
		}
		m.snap = snap
	}
	return m.snap, nil
}

// changedLocked is called, with m.mu held, by everything that changes what
// Inventory shows (the GPUs, their MIG devices, which fell off the bus, the
// driver's versions): the next read makes a new snapshot. Snapshots handed
// out before keep what they showed.
func (m *Machine) changedLocked() { m.snap = nil }

func copyInventory(inv *nvdevice.Inventory) *nvdevice.Inventory {
	out := &nvdevice.Inventory{DriverVersion: inv.DriverVersion, CUDADriverVersion: inv.CUDADriverVersion}
	if inv.GPUs != nil {
		out.GPUs = make([]nvdevice.GPU, len(inv.GPUs))
		for i, g := range inv.GPUs {
			out.GPUs[i] = copyGPU(g)
		}
	}
	return out
}

func copyGPU(g nvdevice.GPU) nvdevice.GPU {
	g.MIG.Profiles = append([]nvdevice.MigProfile(nil), g.MIG.Profiles...)
	for i := range g.MIG.Profiles {
		g.MIG.Profiles[i].Placements = append([]nvdevice.Placement(nil), g.MIG.Profiles[i].Placements...)
	}
	g.MIG.Devices = append([]nvdevice.MigDevice(nil), g.MIG.Devices...)
	g.NVLink.Links = append([]nvdevice.NVLinkLink(nil), g.NVLink.Links...)
	return g
}

// Close stops the machine; health watchers are closed.
func (m *Machine) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.closed {
		m.closed = true
		m.health.Close()
	}
	return nil
}

// Devices is the machine's GPUs and MIG devices as the node's device nodes
// stand for them: every GPU, also one that fell off the bus (its
// /dev/nvidia<minor> stays), read without NVML, so injected read failures
// neither apply nor are used up. The devcluster kubelet names the GPUs a
// container's device nodes give it from this.
func (m *Machine) Devices() []nvdevice.GPU {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]nvdevice.GPU, 0, len(m.inv.GPUs))
	for _, g := range m.inv.GPUs {
		out = append(out, copyGPU(g))
	}
	return out
}
