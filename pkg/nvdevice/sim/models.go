package sim

import (
	"fmt"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// gpuModel is the fixed description of one GPU product: the H100 from
// ../shared/facts/h100.md (figures marked "derived" there are derived here
// too), the H200 from the real H200 that ../shared/real-gpus/h200 captured,
// the L40S (not MIG-capable) from what NVML reports on a real one.
type gpuModel struct {
	productName  string
	brand        string
	architecture string
	computeCap   string
	memoryMiB    uint64
	pciDeviceID  string
	engines      nvdevice.Engines
	// nvlinkLinks are the GPU's NVLink links to NVSwitches (nvlink: nvswitch).
	nvlinkLinks int
	// bridgeLinks are the NVLink links an NVLink bridge gives a pair of
	// cards (nvlink: bridged-pairs), all to the partner card.
	bridgeLinks int
	profiles    []nvdevice.MigProfile
	// noGPM: NVML's GPU performance monitoring is Hopper and later; on
	// older products it reads not supported.
	noGPM bool
}

// Model names a machine spec can use.
const (
	ModelH100SXM5 = "h100-sxm5"
	ModelH100PCIe = "h100-pcie"
	ModelH200SXM  = "h200-sxm"
	ModelL40S     = "l40s"
)

// migGeometry is the part of a GPU-instance profile that is the same on
// every Hopper (GH100) product: which NVML profile it is, how many compute
// and memory slices it takes and where, and its engines other than the
// multiprocessors. Memory slices are nvdevice.MemorySlices (8) per GPU.
type migGeometry struct {
	id, computeSlices, maxInstances int
	copyEngines, decoders, jpeg     int
	ofa                             int
	size                            int
	starts                          []int
}

// hopperMIG is GH100's GPU-instance profile table by NVML profile enum
// (NVML_GPU_INSTANCE_PROFILE_*), as the facts and both real captures (H100
// 80GB HBM3 and H200) list it. Encoders are 0 in every profile.
var hopperMIG = map[int]migGeometry{
	0: {id: 19, computeSlices: 1, maxInstances: 7, copyEngines: 1, decoders: 1, jpeg: 1, ofa: 0, size: 1, starts: []int{0, 1, 2, 3, 4, 5, 6}},
	7: {id: 20, computeSlices: 1, maxInstances: 1, copyEngines: 1, decoders: 1, jpeg: 1, ofa: 1, size: 1, starts: []int{0, 1, 2, 3, 4, 5, 6}}, // +me
	9: {id: 15, computeSlices: 1, maxInstances: 4, copyEngines: 1, decoders: 1, jpeg: 1, ofa: 0, size: 2, starts: []int{0, 2, 4, 6}},
	1: {id: 14, computeSlices: 2, maxInstances: 3, copyEngines: 2, decoders: 2, jpeg: 2, ofa: 0, size: 2, starts: []int{0, 2, 4}},
	2: {id: 9, computeSlices: 3, maxInstances: 2, copyEngines: 3, decoders: 3, jpeg: 3, ofa: 0, size: 4, starts: []int{0, 4}},
	3: {id: 5, computeSlices: 4, maxInstances: 1, copyEngines: 4, decoders: 4, jpeg: 4, ofa: 0, size: 4, starts: []int{0}},
	4: {id: 0, computeSlices: 7, maxInstances: 1, copyEngines: 8, decoders: 7, jpeg: 7, ofa: 1, size: 8, starts: []int{0}},
}

// productProfile is what one product gives a GPU-instance profile of its
// architecture's geometry: its name, memory and multiprocessors. A
// product's profile table is a list of these, in the order the product
// lists its profiles.
type productProfile struct {
	nvmlIndex int
	name      string
	memoryMiB uint64
	sms       int
}

// migProfiles builds a product's profile table from its rows and the
// Hopper geometry.
func migProfiles(rows []productProfile) []nvdevice.MigProfile {
	out := make([]nvdevice.MigProfile, 0, len(rows))
	for _, r := range rows {
		g, ok := hopperMIG[r.nvmlIndex]
		if !ok {
			panic(fmt.Sprintf("sim: profile %s: no Hopper MIG profile with NVML enum %d", r.name, r.nvmlIndex))
		}
		pls := make([]nvdevice.Placement, 0, len(g.starts))
		for _, s := range g.starts {
			pls = append(pls, nvdevice.Placement{Start: s, Size: g.size})
		}
		out = append(out, nvdevice.MigProfile{
			Name: r.name, ID: g.id, NVMLIndex: r.nvmlIndex, ComputeSlices: g.computeSlices, MaxInstances: g.maxInstances,
			MemoryMiB: r.memoryMiB,
			Engines: nvdevice.Engines{Multiprocessors: r.sms, CopyEngines: g.copyEngines, Decoders: g.decoders,
				JPEGEngines: g.jpeg, OFAEngines: g.ofa},
			Placements: pls,
		})
	}
	return out
}

// hopperEngines are a full GH100's engines but its multiprocessors.
func hopperEngines(sms int) nvdevice.Engines {
	return nvdevice.Engines{Multiprocessors: sms, CopyEngines: 8, Decoders: 7, JPEGEngines: 7, OFAEngines: 1}
}

var gpuModels = map[string]gpuModel{
	ModelH100SXM5: {
		productName:  "NVIDIA H100 80GB HBM3",
		brand:        "NVIDIA",
		architecture: "Hopper",
		computeCap:   "9.0",
		memoryMiB:    81559,
		pciDeviceID:  "10de:2330",
		engines:      hopperEngines(132),
		nvlinkLinks:  18,
		// The facts' order (the real H100 lists its profiles by NVML enum,
		// as the H200 below; the figures are the same).
		profiles: migProfiles([]productProfile{
			{0, "1g.10gb", 9984, 16},
			{7, "1g.10gb+me", 9984, 16},
			// 19.62 GiB: the facts mark the MiB figure as derived; the real
			// H100 capture (../shared/real-gpus/h100-80gb-hbm3) confirms it.
			{9, "1g.20gb", 20096, 26},
			{1, "2g.20gb", 20096, 32},
			{2, "3g.40gb", 40448, 60},
			{3, "4g.40gb", 40448, 64},
			{4, "7g.80gb", 81152, 132},
		}),
	},
	// H100 PCIe: 114 SMs. Its per-profile SM counts are derived by scaling
	// the SXM5 GPC layout (not in the facts); memory and engines match SXM5.
	ModelH100PCIe: {
		productName:  "NVIDIA H100 PCIe",
		brand:        "NVIDIA",
		architecture: "Hopper",
		computeCap:   "9.0",
		memoryMiB:    81559,
		pciDeviceID:  "10de:2331",
		engines:      hopperEngines(114),
		nvlinkLinks:  0,
		// Three NVLink bridges join two cards: 600 GB/s bidirectional, 12
		// NVLink4 links at 25 GB/s per direction. From NVIDIA's H100 PCIe
		// product brief, not from ../shared/facts/h100.md.
		bridgeLinks: 12,
		profiles: migProfiles([]productProfile{
			{0, "1g.10gb", 9984, 14},
			{7, "1g.10gb+me", 9984, 14},
			{9, "1g.20gb", 20096, 14},
			{1, "2g.20gb", 20096, 28},
			{2, "3g.40gb", 40448, 42},
			{3, "4g.40gb", 40448, 56},
			{4, "7g.80gb", 81152, 114},
		}),
	},
	// H200 SXM (141 GB HBM3e), as on an HGX H200 board. Every figure but
	// the NVLink links is what a real H200 reported through NVML
	// (../shared/real-gpus/h200: product name, brand, architecture, compute
	// capability, 143771 MiB, 132 SMs, engines, PCI device 10de:2335, and
	// the profile table in the order NVML lists it). It has the H100's MIG
	// geometry with larger memory. The 18 NVLink links to NVSwitches are
	// from NVIDIA's HGX H200 documentation (900 GB/s, NVLink4): the capture
	// was a single GPU in a VM, without NVLink. Its power limit (700 W
	// default and max, 200 W min) is not modelled: nvdevice has no field.
	ModelH200SXM: {
		productName:  "NVIDIA H200",
		brand:        "NVIDIA",
		architecture: "Hopper",
		computeCap:   "9.0",
		memoryMiB:    143771,
		pciDeviceID:  "10de:2335",
		engines:      hopperEngines(132),
		nvlinkLinks:  18,
		profiles: migProfiles([]productProfile{
			{0, "1g.18gb", 16384, 16},
			{1, "2g.35gb", 33280, 32},
			{2, "3g.71gb", 71424, 60},
			{3, "4g.71gb", 71424, 64},
			{4, "7g.141gb", 143360, 132},
			{7, "1g.18gb+me", 16384, 16},
			{9, "1g.35gb", 33280, 26},
		}),
	},
	// L40S (Ada Lovelace, 48 GB GDDR6, PCIe), the product most often put
	// beside H100s: not MIG-capable, no NVLink. The figures are what NVML
	// reports on a real L40S (nvidia-smi -q and --query-gpu on driver
	// 595.71.05: "NVIDIA L40S", brand NVIDIA, architecture Ada Lovelace,
	// MIG mode N/A, 46068 MiB, PCI device 0x26B910DE) and the compute
	// capability 8.9 of every AD102. Its engines stay unknown (zero), as
	// the NVML backend reads them: NVML counts a full GPU's multiprocessors
	// and engines only through MIG profiles, and this GPU has none (the
	// datasheet's 142 SMs are not something NVML says).
	ModelL40S: {
		productName:  "NVIDIA L40S",
		brand:        "NVIDIA",
		architecture: "Ada Lovelace",
		computeCap:   "8.9",
		memoryMiB:    46068,
		pciDeviceID:  "10de:26b9",
		noGPM:        true,
	},
}
