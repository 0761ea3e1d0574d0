package nvdevice

import (
	"fmt"
	"time"
)

// MemorySlices is the number of memory slices a Hopper GPU is divided into for
// MIG placements.
const MemorySlices = 8

// Inventory is a snapshot of one node's GPUs.
type Inventory struct {
	// DriverVersion is the kernel driver version as NVML prints it ("570.172.08").
	DriverVersion string `json:"driverVersion"`
	// CUDADriverVersion is the CUDA version the driver supports ("12.8").
	CUDADriverVersion string `json:"cudaDriverVersion"`
	GPUs              []GPU  `json:"gpus"`
}

// GPU is one physical GPU.
type GPU struct {
	Index int `json:"index"`
	// Minor is the minor number of /dev/nvidia<minor>.
	Minor        int    `json:"minor"`
	UUID         string `json:"uuid"`
	ProductName  string `json:"productName"`
	Brand        string `json:"brand"`
	Architecture string `json:"architecture"`
	// CUDAComputeCapability is "major.minor", 9.0 for Hopper.
	CUDAComputeCapability string `json:"cudaComputeCapability"`
	MemoryMiB             uint64 `json:"memoryMiB"`
	// Engines are the full GPU's execution and copy engines.
	Engines Engines `json:"engines"`
	PCI     PCI     `json:"pci"`
	// NUMANode is the NUMA node closest to the GPU, -1 when unknown.
	NUMANode          int    `json:"numaNode"`
	DriverVersion     string `json:"driverVersion"`
	CUDADriverVersion string `json:"cudaDriverVersion"`
	MIG               MIG    `json:"mig"`
	NVLink            NVLink `json:"nvlink"`
}

// Engines counts the units a GPU or a MIG device has.
type Engines struct {
	Multiprocessors int `json:"multiprocessors"`
	CopyEngines     int `json:"copyEngines"`
	Decoders        int `json:"decoders"`
	Encoders        int `json:"encoders"`
	JPEGEngines     int `json:"jpegEngines"`
	OFAEngines      int `json:"ofaEngines"`
}

// PCI locates a GPU on the PCI bus.
type PCI struct {
	// BusID is the canonical domain:bus:device.function ("0000:18:00.0").
	BusID string `json:"busID"`
	// DeviceID is vendor:device ("10de:2330").
	DeviceID string `json:"deviceID"`
	// PCIeRoot is the PCIe root complex ("pci0000:00"), empty when unknown.
	PCIeRoot string `json:"pcieRoot,omitempty"`
}

// MIG describes a GPU's MIG state.
type MIG struct {
	Capable bool `json:"capable"`
	// Enabled is the current MIG mode.
	Enabled bool `json:"enabled"`
	// Profiles are the GPU-instance profiles the GPU supports, with their
	// placements. Listed whenever the GPU is MIG capable.
	Profiles []MigProfile `json:"profiles,omitempty"`
	// Devices are the MIG devices that exist now.
	Devices []MigDevice `json:"devices,omitempty"`
}

// MigProfile is a GPU-instance profile (with its full compute instance).
type MigProfile struct {
	// Name as nvidia-smi prints it: "1g.10gb", "1g.10gb+me".
	Name string `json:"name"`
	// ID is the profile id nvidia-smi shows and instance creation takes.
	ID int `json:"id"`
	// NVMLIndex is the NVML_GPU_INSTANCE_PROFILE_* enum the profile is read with.
	NVMLIndex int `json:"nvmlIndex"`
	// ComputeSlices is the "g" count: 1, 2, 3, 4 or 7.
	ComputeSlices int     `json:"computeSlices"`
	MaxInstances  int     `json:"maxInstances"`
	MemoryMiB     uint64  `json:"memoryMiB"`
	Engines       Engines `json:"engines"`
	// Placements are where the profile may be created, in memory slices.
	Placements []Placement `json:"placements"`
}

// Placement is a range of memory slices: [Start, Start+Size).
type Placement struct {
	Start int `json:"start"`
	Size  int `json:"size"`
}

// Overlaps reports whether two placements share a memory slice.
func (p Placement) Overlaps(o Placement) bool {
	return p.Start < o.Start+o.Size && o.Start < p.Start+p.Size
}

// Slices lists the memory slices the placement covers.
func (p Placement) Slices() []int {
	s := make([]int, 0, p.Size)
	for i := p.Start; i < p.Start+p.Size; i++ {
		s = append(s, i)
	}
	return s
}

func (p Placement) String() string { return fmt.Sprintf("%d:%d", p.Start, p.Size) }

// MigDevice is an existing MIG device: a GPU instance and one compute instance.
type MigDevice struct {
	UUID       string `json:"uuid"`
	ParentUUID string `json:"parentUUID"`
	// ParentIndex is the index of the parent GPU.
	ParentIndex       int       `json:"parentIndex"`
	Profile           string    `json:"profile"`
	Placement         Placement `json:"placement"`
	GPUInstanceID     int       `json:"gpuInstanceID"`
	ComputeInstanceID int       `json:"computeInstanceID"`
	MemoryMiB         uint64    `json:"memoryMiB"`
	Engines           Engines   `json:"engines"`
}

// MigCreateRequest asks for a MIG device.
type MigCreateRequest struct {
	ParentUUID string
	Profile    string
	// Placement start, in memory slices.
	Start int
}

// MigDeviceRef names a MIG device to delete. The GPU and compute instance ids
// are what the hardware keys on; the UUID is checked when it is set.
type MigDeviceRef struct {
	ParentUUID        string
	GPUInstanceID     int
	ComputeInstanceID int
	UUID              string
}

// NVLink is a GPU's NVLink state.
type NVLink struct {
	// Links are the GPU's NVLink links, active or not.
	Links []NVLinkLink `json:"links,omitempty"`
	// Domain names the set of GPUs that can reach each other over NVLink:
	// the fabric clique when the GPU is part of a multi-node NVLink fabric,
	// otherwise an intra-node domain derived from the topology. Empty when
	// the GPU has no active NVLink.
	Domain string `json:"domain,omitempty"`
	// FabricClique is "<clusterUUID>.<cliqueId>", set only when the fabric
	// cluster UUID is non-zero (multi-node NVLink).
	FabricClique string `json:"fabricClique,omitempty"`
}

// ActiveLinks counts the links that are up.
func (n NVLink) ActiveLinks() int {
	c := 0
	for _, l := range n.Links {
		if l.Active {
			c++
		}
	}
	return c
}

// RemoteKind is what the far end of an NVLink link is.
type RemoteKind string

const (
	RemoteGPU      RemoteKind = "gpu"
	RemoteNVSwitch RemoteKind = "nvswitch"
	RemoteUnknown  RemoteKind = "unknown"
)

// NVLinkLink is one NVLink link.
type NVLinkLink struct {
	Index  int  `json:"index"`
	Active bool `json:"active"`
	// RemoteBusID is the PCI bus id of the GPU or NVSwitch at the far end.
	RemoteBusID string     `json:"remoteBusID,omitempty"`
	RemoteKind  RemoteKind `json:"remoteKind,omitempty"`
}

// HealthEventKind classifies a health event.
type HealthEventKind string

const (
	// HealthXID is an XID error reported by the driver.
	HealthXID HealthEventKind = "xid"
	// HealthGPULost means the GPU fell off the bus or vanished.
	HealthGPULost HealthEventKind = "gpu-lost"
	// HealthRecovered means a device that was unhealthy is healthy again.
	HealthRecovered HealthEventKind = "recovered"
)

// HealthEvent is one health observation.
type HealthEvent struct {
	Kind HealthEventKind `json:"kind"`
	// GPUUUID is the affected GPU.
	GPUUUID string `json:"gpuUUID"`
	// MigUUID is set when the event concerns one MIG device only.
	MigUUID string    `json:"migUUID,omitempty"`
	XID     uint64    `json:"xid,omitempty"`
	Time    time.Time `json:"time"`
	Message string    `json:"message,omitempty"`
}

// ApplicationXIDs are XIDs caused by the application, not the GPU (the
// device plugins' common ignore list): the default XIDPolicy ignores them.
var ApplicationXIDs = map[uint64]bool{13: true, 31: true, 43: true, 45: true, 68: true, 109: true}

// XIDPolicy says which health events make a GPU unhealthy. It is a value
// the caller passes, not a global, because which XIDs an admin counts as
// the application's fault is configuration (--health-ignored-xids). The
// zero value is the default: it ignores ApplicationXIDs.
type XIDPolicy struct {
	// ignored are the XIDs that leave a GPU healthy; nil: ApplicationXIDs.
	ignored map[uint64]bool
}

// DefaultXIDPolicy ignores ApplicationXIDs; the backends track recovery
// with it (a plugin with another policy hands them what it adds through
// UnhealthyTracker).
var DefaultXIDPolicy = XIDPolicy{}

// NewXIDPolicy ignores the given XIDs: nil is the default
// (ApplicationXIDs), an empty list ignores none.
func NewXIDPolicy(ignored []uint64) XIDPolicy {
	if ignored == nil {
		return DefaultXIDPolicy
	}
	p := XIDPolicy{ignored: make(map[uint64]bool, len(ignored))}
	for _, x := range ignored {
		p.ignored[x] = true
	}
	return p
}

// Ignores reports whether an XID leaves the GPU healthy.
func (p XIDPolicy) Ignores(xid uint64) bool {
	if p.ignored == nil {
		return ApplicationXIDs[xid]
	}
	return p.ignored[xid]
}

// Critical reports whether the event makes its GPU unhealthy: a lost GPU
// always does, an XID unless the policy ignores it, a recovery never.
func (p XIDPolicy) Critical(e HealthEvent) bool {
	switch e.Kind {
	case HealthGPULost:
		return true
	case HealthXID:
		return !p.Ignores(e.XID)
	default:
		return false
	}
}
