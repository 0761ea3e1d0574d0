//go:build cgo && linux

package nvml

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"k8s.io/dynamic-resource-allocation/deviceattribute"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// skippedProducts are NVIDIA devices that are not compute GPUs (the display
// adapter of a DGX Station), as go-nvlib skips them.
var skippedProducts = map[string]bool{"DGX Display": true, "NVIDIA DGX Display": true}

// Inventory reads every GPU, its MIG state and NVLink topology.
func (b *Backend) Inventory(ctx context.Context) (*nvdevice.Inventory, error) {
	var inv *nvdevice.Inventory
	err := b.locked(func() error {
		now, events := b.now(), b.healthEvents.Load()
		var err error
		inv, err = b.readInventory(ctx)
		if err == nil {
			b.confirmSnapshot(inv, now, events) // the plugin's poll
		}
		return err
	})
	return inv, err
}

func (b *Backend) readInventory(ctx context.Context) (*nvdevice.Inventory, error) {
	logger := klog.FromContext(ctx)
	driver, ret := b.lib.SystemGetDriverVersion()
	if err := check(ret, "read driver version"); err != nil {
		return nil, err
	}
	cuda, ret := b.lib.SystemGetCudaDriverVersion()
	if err := check(ret, "read CUDA driver version"); err != nil {
		return nil, err
	}
	inv := &nvdevice.Inventory{DriverVersion: driver, CUDADriverVersion: cudaVersion(cuda)}
	count, ret := b.lib.DeviceGetCount()
	if err := check(ret, "count GPUs"); err != nil {
		return nil, err
	}
	fabric := map[string]nvdevice.FabricInfo{}
	for i := range count {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		dev, ret := b.lib.DeviceGetHandleByIndex(i)
		err := check(ret, "get handle of GPU %d", i)
		var g nvdevice.GPU
		var fi *nvdevice.FabricInfo
		if err == nil {
			g, fi, err = b.readGPU(ctx, i, dev)
		}
		if errors.Is(err, nvdevice.ErrGPULost) {
			// One GPU off the bus must not hide the others: it is left out
			// (so nothing is offered on it) and reported.
			logger.Error(err, "GPU is lost, leaving it out of the inventory", "index", i)
			continue
		}
		if err != nil {
			return nil, err
		}
		if skippedProducts[g.ProductName] {
			logger.V(4).Info("Skipping a device that is not a compute GPU", "index", i, "name", g.ProductName)
			continue
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

// cudaVersion turns NVML's 12080 into "12.8".
func cudaVersion(v int) string { return fmt.Sprintf("%d.%d", v/1000, v%1000/10) }

func (b *Backend) readGPU(ctx context.Context, index int, dev nvml.Device) (nvdevice.GPU, *nvdevice.FabricInfo, error) {
	g := nvdevice.GPU{Index: index, NUMANode: -1}
	var ret nvml.Return
	if g.UUID, ret = dev.GetUUID(); ret != nvml.SUCCESS {
		return g, nil, check(ret, "read UUID of GPU %d", index)
	}
	wrap := func(ret nvml.Return, what string) error {
		return check(ret, "read %s of GPU %d (%s)", what, index, g.UUID)
	}
	if g.ProductName, ret = dev.GetName(); ret != nvml.SUCCESS {
		return g, nil, wrap(ret, "name")
	}
	if skippedProducts[g.ProductName] {
		return g, nil, nil
	}
	if g.Minor, ret = dev.GetMinorNumber(); ret != nvml.SUCCESS {
		return g, nil, wrap(ret, "minor number")
	}
	brand, ret := dev.GetBrand()
	if ret != nvml.SUCCESS {
		return g, nil, wrap(ret, "brand")
	}
	g.Brand = brandName(brand)
	arch, ret := dev.GetArchitecture()
	if ret != nvml.SUCCESS {
		return g, nil, wrap(ret, "architecture")
	}
	g.Architecture = architectureName(arch)
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
		BusID: normalizeBusID(pci.BusId[:]),
		// PciDeviceId is 0x233010de: device in the upper 16 bits, vendor below.
		DeviceID: fmt.Sprintf("%04x:%04x", pci.PciDeviceId&0xffff, pci.PciDeviceId>>16),
	}
	g.PCI.PCIeRoot = b.pcieRoot(g.PCI.BusID)
	g.NUMANode = b.numaNode(g.PCI.BusID)

	mig, err := b.readMIG(dev, &g, mem.Total)
	if err != nil {
		return g, nil, err
	}
	g.MIG = mig
	g.Engines = fullGPUEngines(mig.Profiles)
	if g.NVLink.Links, err = b.readLinks(dev, &g); err != nil {
		return g, nil, err
	}
	fi, err := b.readFabric(ctx, dev, &g)
	return g, fi, err
}

// fullGPUEngines are the units of the full GPU. NVML has no call for a full
// GPU's multiprocessor or engine counts (GetAttributes answers only for MIG
// devices), so they are those of the GPU-instance profile spanning the whole
// GPU (the most compute slices, then the most multiprocessors): 7g.80gb on an
// H100 SXM5, 132 SMs and all its engines. On GPUs where the 7-slice instance
// leaves SMs unused (A100: 98 of 108) this is what MIG can use, not the die.
// Without MIG support they stay unknown (zero).
func fullGPUEngines(profiles []nvdevice.MigProfile) nvdevice.Engines {
	var best *nvdevice.MigProfile
	for i := range profiles {
		p := &profiles[i]
		if best == nil || p.ComputeSlices > best.ComputeSlices ||
			(p.ComputeSlices == best.ComputeSlices && p.Engines.Multiprocessors > best.Engines.Multiprocessors) {
			best = p
		}
	}
	if best == nil {
		return nvdevice.Engines{}
	}
	return best.Engines
}

// brandName is the product brand as nvidia-smi -q prints it.
func brandName(b nvml.BrandType) string {
	switch b {
	case nvml.BRAND_QUADRO:
		return "Quadro"
	case nvml.BRAND_TESLA:
		return "Tesla"
	case nvml.BRAND_NVS:
		return "NVS"
	case nvml.BRAND_GRID:
		return "Grid"
	case nvml.BRAND_GEFORCE:
		return "GeForce"
	case nvml.BRAND_TITAN:
		return "Titan"
	case nvml.BRAND_NVIDIA_VAPPS:
		return "NVIDIA Virtual Applications"
	case nvml.BRAND_NVIDIA_VPC:
		return "NVIDIA Virtual PC"
	case nvml.BRAND_NVIDIA_VCS:
		return "NVIDIA Virtual Compute Server"
	case nvml.BRAND_NVIDIA_VWS:
		return "NVIDIA RTX Virtual Workstation"
	case nvml.BRAND_NVIDIA_CLOUD_GAMING:
		return "NVIDIA Cloud Gaming"
	case nvml.BRAND_QUADRO_RTX:
		return "Quadro RTX"
	case nvml.BRAND_NVIDIA_RTX:
		return "NVIDIA RTX"
	case nvml.BRAND_NVIDIA:
		return "NVIDIA"
	case nvml.BRAND_GEFORCE_RTX:
		return "GeForce RTX"
	case nvml.BRAND_TITAN_RTX:
		return "Titan RTX"
	}
	return "Unknown"
}

// architectureName names NVML's architecture enum.
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
	case nvml.DEVICE_ARCH_RUBIN:
		return "Rubin"
	}
	return "Unknown"
}

// normalizeBusID turns NVML's "00000000:18:00.0" (a NUL-terminated C string,
// domain in 8 hex digits) into the kernel's "0000:18:00.0": lower case, the
// domain printed as sysfs does (%04x, so a VMD domain stays "10000").
func normalizeBusID(raw []int8) string {
	var sb strings.Builder
	for _, c := range raw {
		if c == 0 {
			break
		}
		sb.WriteByte(byte(c))
	}
	id := strings.ToLower(strings.TrimSpace(sb.String()))
	domain, rest, ok := strings.Cut(id, ":")
	if !ok || strings.Count(rest, ":") != 1 {
		return id // no domain ("18:00.0") or not a bus id: leave it as NVML says
	}
	d, err := strconv.ParseUint(domain, 16, 32)
	if err != nil {
		return id
	}
	return fmt.Sprintf("%04x:%s", d, rest)
}

// pcieRoot is the root complex the GPU hangs off ("pci0000:15"), from the
// owner of the standard attribute resource.kubernetes.io/pcieRoot (its
// deviceattribute package walks sysfs as the standard defines). Empty when
// unknown; the package refuses a bus id outside the 4-digit-domain BDF form
// (a VMD domain such as "10000:e1:00.0"), and such a GPU publishes no root.
func (b *Backend) pcieRoot(busID string) string {
	attr, err := deviceattribute.GetPCIeRootAttributeByPCIBusID(busID, deviceattribute.WithFSFromRoot(b.sysfs))
	if err != nil || attr.Value.StringValue == nil {
		return ""
	}
	return *attr.Value.StringValue
}

// numaNode is the GPU's NUMA node, -1 when unknown or when the GPU has no
// NUMA affinity (the standard attribute must not be published then), from
// the same package.
func (b *Backend) numaNode(busID string) int {
	attr, err := deviceattribute.GetNUMANodeAttributeByPCIBusID(busID, deviceattribute.ScalarAttribute, deviceattribute.WithFSFromRoot(b.sysfs))
	if err != nil || attr.Value.IntValue == nil {
		return -1
	}
	return int(*attr.Value.IntValue)
}
