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

// commonAttributes are shared by a GPU and the MIG devices carved from it.
func commonAttributes(g *nvdevice.GPU) map[resourceapi.QualifiedName]resourceapi.DeviceAttribute {
	attrs := map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
		"productName":  str(g.ProductName),
		"brand":        str(g.Brand),
		"architecture": str(g.Architecture),
		"index":        {IntValue: ptr.To(int64(g.Index))},
		"minor":        {IntValue: ptr.To(int64(g.Minor))},
	}
	setVersion(attrs, "cudaComputeCapability", g.CUDAComputeCapability)
	setVersion(attrs, "driverVersion", g.DriverVersion)
	setVersion(attrs, "cudaDriverVersion", g.CUDADriverVersion)
	// The standard attributes come from their owner, which also refuses
	// what the standard does not allow (a bus id outside the BDF form, a
	// NUMA node of a device without NUMA affinity): those are left out.
	if a, err := deviceattribute.GetPCIBusIDAttribute(g.PCI.BusID); err == nil {
		attrs[a.Name] = a.Value
	}
	if g.PCI.PCIeRoot != "" {
		attrs[deviceattribute.StandardDeviceAttributePCIeRoot] = str(g.PCI.PCIeRoot)
	}
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

// capacities are what a device offers, under the architecture's names.
func capacities(memoryMiB uint64, e nvdevice.Engines) map[resourceapi.QualifiedName]resourceapi.DeviceCapacity {
	count := func(n int) resourceapi.DeviceCapacity {
		return resourceapi.DeviceCapacity{Value: *resource.NewQuantity(int64(n), resource.DecimalSI)}
	}
	return map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
		CapacityMemory:          {Value: mebibytes(memoryMiB)},
		CapacityMultiprocessors: count(e.Multiprocessors),
		"copyEngines":           count(e.CopyEngines),
		"decoders":              count(e.Decoders),
		"encoders":              count(e.Encoders),
		"jpegEngines":           count(e.JPEGEngines),
		"ofaEngines":            count(e.OFAEngines),
	}
}
