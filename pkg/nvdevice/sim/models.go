package sim

import "github.com/gpudra/gpudra/pkg/nvdevice"

// gpuModel is the fixed description of one GPU product, from
// ../shared/facts/h100.md. Figures marked "derived" there are derived here too.
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
}

// Model names a machine spec can use.
const (
	ModelH100SXM5 = "h100-sxm5"
	ModelH100PCIe = "h100-pcie"
)

func placements(size int, starts ...int) []nvdevice.Placement {
	p := make([]nvdevice.Placement, 0, len(starts))
	for _, s := range starts {
		p = append(p, nvdevice.Placement{Start: s, Size: size})
	}
	return p
}

// h100Profiles builds the H100 80GB GPU-instance profile table. sms gives the
// multiprocessor count per profile in table order, which is the one figure that
// differs between the SXM5 and PCIe boards.
func h100Profiles(sms [7]int) []nvdevice.MigProfile {
	eng := func(sm, ce, dec, jpeg, ofa int) nvdevice.Engines {
		return nvdevice.Engines{Multiprocessors: sm, CopyEngines: ce, Decoders: dec, JPEGEngines: jpeg, OFAEngines: ofa}
	}
	return []nvdevice.MigProfile{
		{Name: "1g.10gb", ID: 19, NVMLIndex: 0, ComputeSlices: 1, MaxInstances: 7, MemoryMiB: 9984,
			Engines: eng(sms[0], 1, 1, 1, 0), Placements: placements(1, 0, 1, 2, 3, 4, 5, 6)},
		{Name: "1g.10gb+me", ID: 20, NVMLIndex: 7, ComputeSlices: 1, MaxInstances: 1, MemoryMiB: 9984,
			Engines: eng(sms[1], 1, 1, 1, 1), Placements: placements(1, 0, 1, 2, 3, 4, 5, 6)},
		// 19.62 GiB: the facts mark the MiB figure as derived.
		{Name: "1g.20gb", ID: 15, NVMLIndex: 9, ComputeSlices: 1, MaxInstances: 4, MemoryMiB: 20096,
			Engines: eng(sms[2], 1, 1, 1, 0), Placements: placements(2, 0, 2, 4, 6)},
		{Name: "2g.20gb", ID: 14, NVMLIndex: 1, ComputeSlices: 2, MaxInstances: 3, MemoryMiB: 20096,
			Engines: eng(sms[3], 2, 2, 2, 0), Placements: placements(2, 0, 2, 4)},
		{Name: "3g.40gb", ID: 9, NVMLIndex: 2, ComputeSlices: 3, MaxInstances: 2, MemoryMiB: 40448,
			Engines: eng(sms[4], 3, 3, 3, 0), Placements: placements(4, 0, 4)},
		{Name: "4g.40gb", ID: 5, NVMLIndex: 3, ComputeSlices: 4, MaxInstances: 1, MemoryMiB: 40448,
			Engines: eng(sms[5], 4, 4, 4, 0), Placements: placements(4, 0)},
		{Name: "7g.80gb", ID: 0, NVMLIndex: 4, ComputeSlices: 7, MaxInstances: 1, MemoryMiB: 81152,
			Engines: eng(sms[6], 8, 7, 7, 1), Placements: placements(8, 0)},
	}
}

var gpuModels = map[string]gpuModel{
	ModelH100SXM5: {
		productName:  "NVIDIA H100 80GB HBM3",
		brand:        "NVIDIA",
		architecture: "Hopper",
		computeCap:   "9.0",
		memoryMiB:    81559,
		pciDeviceID:  "10de:2330",
		engines:      nvdevice.Engines{Multiprocessors: 132, CopyEngines: 8, Decoders: 7, JPEGEngines: 7, OFAEngines: 1},
		nvlinkLinks:  18,
		profiles:     h100Profiles([7]int{16, 16, 26, 32, 60, 64, 132}),
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
		engines:      nvdevice.Engines{Multiprocessors: 114, CopyEngines: 8, Decoders: 7, JPEGEngines: 7, OFAEngines: 1},
		nvlinkLinks:  0,
		// Three NVLink bridges join two cards: 600 GB/s bidirectional, 12
		// NVLink4 links at 25 GB/s per direction. From NVIDIA's H100 PCIe
		// product brief, not from ../shared/facts/h100.md.
		bridgeLinks: 12,
		profiles:    h100Profiles([7]int{14, 14, 14, 28, 42, 56, 114}),
	},
}
