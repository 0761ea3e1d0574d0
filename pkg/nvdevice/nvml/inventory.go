//go:build cgo

package nvml

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// Inventory reads every GPU, its MIG state and NVLink topology.
func (b *Backend) Inventory(ctx context.Context) (*nvdevice.Inventory, error) {
	var inv *nvdevice.Inventory
	err := b.locked(func() error {
		var err error
		inv, err = b.readInventory(ctx)
		return err
	})
	return inv, err
}

func (b *Backend) readInventory(ctx context.Context) (*nvdevice.Inventory, error) {
	driver, ret := b.lib.SystemGetDriverVersion()
	if err := check(ret, "read driver version"); err != nil {
		return nil, err
	}
	cudaInt, ret := b.lib.SystemGetCudaDriverVersion()
	if err := check(ret, "read CUDA driver version"); err != nil {
		return nil, err
	}
	inv := &nvdevice.Inventory{DriverVersion: driver, CUDADriverVersion: fmt.Sprintf("%d.%d", cudaInt/1000, cudaInt%1000/10)}
	count, ret := b.lib.DeviceGetCount()
	if err := check(ret, "count GPUs"); err != nil {
		return nil, err
	}
	fabric := map[string]nvdevice.FabricInfo{}
	for i := 0; i < count; i++ {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		dev, ret := b.lib.DeviceGetHandleByIndex(i)
		if err := check(ret, "get GPU %d", i); err != nil {
			return nil, err
		}
		g, fi, err := b.readGPU(i, dev)
		if err != nil {
			return nil, err
		}
		g.DriverVersion, g.CUDADriverVersion = inv.DriverVersion, inv.CUDADriverVersion
		if fi != nil {
			fabric[g.UUID] = *fi
		}
		inv.GPUs = append(inv.GPUs, g)
	}
	nvdevice.AssignNVLinkDomains(inv.GPUs, fabric)
	return inv, nil
}

func (b *Backend) readGPU(index int, dev nvml.Device) (nvdevice.GPU, *nvdevice.FabricInfo, error) {
	g := nvdevice.GPU{Index: index, NUMANode: -1}
	var ret nvml.Return
	if g.UUID, ret = dev.GetUUID(); ret != nvml.SUCCESS {
		return g, nil, check(ret, "read UUID of GPU %d", index)
	}
	wrap := func(ret nvml.Return, what string) error {
		return check(ret, "read %s of GPU %d (%s)", what, index, g.UUID)
	}
	if g.Minor, ret = dev.GetMinorNumber(); ret != nvml.SUCCESS {
		return g, nil, wrap(ret, "minor number")
	}
	if g.ProductName, ret = dev.GetName(); ret != nvml.SUCCESS {
		return g, nil, wrap(ret, "name")
	}
	brand, ret := dev.GetBrand()
	if ret != nvml.SUCCESS {
		return g, nil, wrap(ret, "brand")
	}
	g.Brand = brandName(brand)
	if arch, ret := dev.GetArchitecture(); ret == nvml.SUCCESS {
		g.Architecture = architectureName(arch)
	}
	major, minor, ret := dev.GetCudaComputeCapability()
	if ret != nvml.SUCCESS {
		return g, nil, wrap(ret, "compute capability")
	}
	g.CUDAComputeCapability = fmt.Sprintf("%d.%d", major, minor)
	mem, ret := dev.GetMemoryInfo()
	if ret != nvml.SUCCESS {
		return g, nil, wrap(ret, "memory")
	}
	g.MemoryMiB = mem.Total / (1 << 20)
	pci, ret := dev.GetPciInfo()
	if ret != nvml.SUCCESS {
		return g, nil, wrap(ret, "PCI info")
	}
	g.PCI = nvdevice.PCI{
		BusID:    normalizeBusID(pci.BusId[:]),
		DeviceID: fmt.Sprintf("%04x:%04x", pci.PciDeviceId&0xffff, pci.PciDeviceId>>16),
	}
	g.PCI.PCIeRoot = b.pcieRoot(g.PCI.BusID)
	g.NUMANode = b.numaNode(g.PCI.BusID)

	mig, err := b.readMIG(dev, &g)
	if err != nil {
		return g, nil, err
	}
	g.MIG = mig
	// The full GPU's units: NVML reports them only per GPU-instance profile,
	// so they are those of the profile spanning the whole GPU. Without MIG
	// support they stay unknown (zero).
	for _, p := range mig.Profiles {
		if p.Engines.Multiprocessors > g.Engines.Multiprocessors {
			g.Engines = p.Engines
		}
	}
	g.NVLink.Links = readLinks(dev)
	return g, readFabric(dev), nil
}

func brandName(b nvml.BrandType) string {
	switch b {
	case nvml.BRAND_NVIDIA:
		return "NVIDIA"
	case nvml.BRAND_TESLA:
		return "Tesla"
	case nvml.BRAND_QUADRO, nvml.BRAND_NVIDIA_RTX:
		return "Quadro"
	case nvml.BRAND_GEFORCE:
		return "GeForce"
	case nvml.BRAND_TITAN:
		return "Titan"
	}
	return fmt.Sprintf("brand-%d", b)
}

func architectureName(a nvml.DeviceArchitecture) string {
	switch a {
	case nvml.DEVICE_ARCH_KEPLER:
		return "Kepler"
	case nvml.DEVICE_ARCH_MAXWELL:
		return "Maxwell"
	case nvml.DEVICE_ARCH_PASCAL:
		return "Pascal"
	case nvml.DEVICE_ARCH_VOLTA:
		return "Volta"
	case nvml.DEVICE_ARCH_TURING:
		return "Turing"
	case nvml.DEVICE_ARCH_AMPERE:
		return "Ampere"
	case nvml.DEVICE_ARCH_ADA:
		return "Ada Lovelace"
	case nvml.DEVICE_ARCH_HOPPER:
		return "Hopper"
	case nvml.DEVICE_ARCH_BLACKWELL:
		return "Blackwell"
	}
	return fmt.Sprintf("arch-%d", a)
}

// normalizeBusID turns NVML's "00000000:18:00.0" into the kernel's
// "0000:18:00.0".
func normalizeBusID(raw []int8) string {
	var sb strings.Builder
	for _, c := range raw {
		if c == 0 {
			break
		}
		sb.WriteByte(byte(c))
	}
	id := strings.ToLower(sb.String())
	if parts := strings.SplitN(id, ":", 2); len(parts) == 2 && len(parts[0]) > 4 {
		id = parts[0][len(parts[0])-4:] + ":" + parts[1]
	}
	return id
}

// pcieRoot resolves the GPU's sysfs path to its root complex, "pci0000:00".
func (b *Backend) pcieRoot(busID string) string {
	target, err := filepath.EvalSymlinks(filepath.Join(b.sysfs, "bus/pci/devices", busID))
	if err != nil {
		return ""
	}
	for _, part := range strings.Split(target, string(filepath.Separator)) {
		if strings.HasPrefix(part, "pci") && strings.Contains(part, ":") {
			return part
		}
	}
	return ""
}

func (b *Backend) numaNode(busID string) int {
	data, err := os.ReadFile(filepath.Join(b.sysfs, "bus/pci/devices", busID, "numa_node"))
	if err != nil {
		return -1
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil || n < 0 {
		return -1
	}
	return n
}

func readLinks(dev nvml.Device) []nvdevice.NVLinkLink {
	var links []nvdevice.NVLinkLink
	for l := 0; l < nvml.NVLINK_MAX_LINKS; l++ {
		state, ret := dev.GetNvLinkState(l)
		if ret != nvml.SUCCESS {
			// NOT_SUPPORTED on the first link means no NVLink at all;
			// INVALID_ARGUMENT past the last link ends the list.
			break
		}
		link := nvdevice.NVLinkLink{Index: l, Active: state == nvml.FEATURE_ENABLED, RemoteKind: nvdevice.RemoteUnknown}
		if link.Active {
			if pci, ret := dev.GetNvLinkRemotePciInfo(l); ret == nvml.SUCCESS {
				link.RemoteBusID = normalizeBusID(pci.BusId[:])
			}
			if t, ret := dev.GetNvLinkRemoteDeviceType(l); ret == nvml.SUCCESS {
				switch t {
				case nvml.NVLINK_DEVICE_TYPE_GPU:
					link.RemoteKind = nvdevice.RemoteGPU
				case nvml.NVLINK_DEVICE_TYPE_SWITCH:
					link.RemoteKind = nvdevice.RemoteNVSwitch
				}
			}
		}
		links = append(links, link)
	}
	return links
}

func readFabric(dev nvml.Device) *nvdevice.FabricInfo {
	fi, ret := dev.GetGpuFabricInfo()
	if ret != nvml.SUCCESS {
		return nil
	}
	return &nvdevice.FabricInfo{ClusterUUID: fi.ClusterUuid, CliqueID: fi.CliqueId}
}
