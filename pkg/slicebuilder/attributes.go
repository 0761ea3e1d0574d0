package slicebuilder

import (
	"strconv"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/dynamic-resource-allocation/deviceattribute"
	"k8s.io/utils/ptr"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// gpuAttributes are a whole GPU's: what NVIDIA's drivers publish, under
// the same names, plus where the GPU sits.
func gpuAttributes(g *nvdevice.GPU) map[resourceapi.QualifiedName]resourceapi.DeviceAttribute {
	attrs := placeAttributes(g)
	attrs["brand"] = str(g.Brand)
	attrs["architecture"] = str(g.Architecture)
	attrs["minor"] = resourceapi.DeviceAttribute{IntValue: ptr.To(int64(g.Minor))}
	setVersion(attrs, "cudaComputeCapability", g.CUDAComputeCapability)
	setVersion(attrs, "driverVersion", g.DriverVersion)
	setVersion(attrs, "cudaDriverVersion", g.CUDADriverVersion)
	// The standard attributes come from their owner, which also refuses
	// what the standard does not allow (a bus id outside the BDF form):
	// those are left out.
	if a, err := deviceattribute.GetPCIBusIDAttribute(g.PCI.BusID); err == nil {
		attrs[a.Name] = a.Value
	}
	return attrs
}

// placeAttributes are what a MIG device carries of its GPU: the product,
// the GPU's index, and the PCIe root and NUMA node a claim aligns on. A
// MIG device publishes nothing else of the GPU (brand, architecture,
// versions, minor, bus id: the same on every MIG device of a GPU, and on
// its whole-GPU device, found by parentUUID), because kube-scheduler
// copies every attribute of every device it evaluates into CEL maps, for
// every pending pod on every node: at 1,000 nodes in MIG mode the seven
// dropped attributes (and the engine capacities, see capacities) were a third of a pod's
// scheduling time (docs/scale.md).
func placeAttributes(g *nvdevice.GPU) map[resourceapi.QualifiedName]resourceapi.DeviceAttribute {
	attrs := map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
		"productName": str(g.ProductName),
		"index":       {IntValue: ptr.To(int64(g.Index))},
	}
	if g.PCI.PCIeRoot != "" {
		attrs[deviceattribute.StandardDeviceAttributePCIeRoot] = str(g.PCI.PCIeRoot)
	}
	// Left out where the GPU has no NUMA affinity, which the standard forbids.
	if a, err := deviceattribute.GetNUMANodeAttribute(g.NUMANode, deviceattribute.ScalarAttribute); err == nil {
		attrs[a.Name] = a.Value
	}
	return attrs
}

func str(s string) resourceapi.DeviceAttribute { return resourceapi.DeviceAttribute{StringValue: &s} }

// setVersion publishes a version attribute when it can be written as semver.
func setVersion(attrs map[resourceapi.QualifiedName]resourceapi.DeviceAttribute, name resourceapi.QualifiedName, v string) {
	if sv, ok := Semver(v); ok {
		attrs[name] = resourceapi.DeviceAttribute{VersionValue: &sv}
	}
}

// Semver turns NVIDIA's dotted versions into semantic versions: "9.0" ->
// "9.0.0", "12.8" -> "12.8.0", "570.172.08" -> "570.172.8" (semver forbids
// leading zeros). It reports false for anything else.
func Semver(v string) (string, bool) {
	parts := strings.Split(strings.TrimSpace(v), ".")
	if len(parts) < 1 || len(parts) > 3 {
		return "", false
	}
	for len(parts) < 3 {
		parts = append(parts, "0")
	}
	for i, p := range parts {
		n, err := strconv.ParseUint(p, 10, 64)
		if err != nil {
			return "", false
		}
		parts[i] = strconv.FormatUint(n, 10)
	}
	return strings.Join(parts, "."), true
}

// capacities are what a device offers: memory and multiprocessors. Its
// engines are not published as capacities: every H100 has the same
// (productName says which), a MIG device's follow from its profile
// (1g.10gb+me is the one with the OFA and JPEG engines), and kube-scheduler
// checks every capacity of every device it tries against the request,
// building maps each time: five engine capacities made a 9-GPU claim that
// fits nowhere cost 1.7x more at 1,000 MIG-off nodes (docs/scale.md). The
// engines still count in the GPU's shared counters, where MIG needs them.
//
// A GPU whose multiprocessors NVML does not count (one that is not
// MIG-capable, such as an L40S: nvdevice.GPU.Engines is zero) publishes no
// multiprocessors capacity rather than 0, which a claim asking for any
// would read as a GPU without SMs.
func capacities(memoryMiB uint64, e nvdevice.Engines) map[resourceapi.QualifiedName]resourceapi.DeviceCapacity {
	out := map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{CapacityMemory: {Value: mebibytes(memoryMiB)}}
	if e.Multiprocessors > 0 {
		out[CapacityMultiprocessors] = resourceapi.DeviceCapacity{Value: *resource.NewQuantity(int64(e.Multiprocessors), resource.DecimalSI)}
	}
	return out
}
