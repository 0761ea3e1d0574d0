package slicebuilder

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/api/validate/content"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/utils/ptr"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// h100Placements is the H100 80GB MIG table of ../shared/facts/h100.md, written
// out here independently of the simulator: profile, device-name label,
// placement starts and sizes, memory and SMs (SXM5).
var h100Placements = []struct {
	profile   string
	label     string
	starts    []int
	size      int
	memoryMiB int64
	sms       int64
}{
	{"1g.10gb", "1g-10gb", []int{0, 1, 2, 3, 4, 5, 6}, 1, 9984, 16},
	{"1g.10gb+me", "1g-10gb-me", []int{0, 1, 2, 3, 4, 5, 6}, 1, 9984, 16},
	{"1g.20gb", "1g-20gb", []int{0, 2, 4, 6}, 2, 20096, 26},
	{"2g.20gb", "2g-20gb", []int{0, 2, 4}, 2, 20096, 32},
	{"3g.40gb", "3g-40gb", []int{0, 4}, 4, 40448, 60},
	{"4g.40gb", "4g-40gb", []int{0}, 4, 40448, 64},
	{"7g.80gb", "7g-80gb", []int{0}, 8, 81152, 132},
}

// migName is the expected stable name of a MIG placement.
func migName(gpu int, label string, start int) string {
	return fmt.Sprintf("gpu-%d-mig-%s-%d", gpu, label, start)
}

// expectedGPUDevices lists the names one GPU should publish: the full GPU
// and, with MIG on, every placement of every profile.
func expectedGPUDevices(gpu int, mig bool) []string {
	names := []string{fmt.Sprintf("gpu-%d", gpu)}
	if mig {
		for _, p := range h100Placements {
			for _, s := range p.starts {
				names = append(names, migName(gpu, p.label, s))
			}
		}
	}
	return names
}

// devicesOfGPU groups devices by the GPU they belong to (the "index" attribute).
func devicesOfGPU(devs []resourceapi.Device) map[int64][]resourceapi.Device {
	out := map[int64][]resourceapi.Device{}
	for _, d := range devs {
		if a, ok := d.Attributes["index"]; ok && a.IntValue != nil {
			out[*a.IntValue] = append(out[*a.IntValue], d)
		} else {
			out[-1] = append(out[-1], d)
		}
	}
	return out
}

func deviceNames(devs []resourceapi.Device) []string {
	var out []string
	for _, d := range devs {
		out = append(out, d.Name)
	}
	return out
}

func TestDevicesPerGPU(t *testing.T) {
	tests := []struct {
		machine string
		gpus    int
		mig     bool
		total   int
	}{
		{"dgx-h100", 8, true, 208},
		{"dgx-h100-nomig", 8, false, 8},
		{"h100-pcie", 2, true, 52},
		{"h100-nvlink-fabric", 8, false, 8},
		{oneGPUMig, 1, true, 26},
		{"name: partly\ngpuCount: 2\nmigEnabled: [1]\n", 2, false, 1 + 26}, // GPU 0 without MIG, GPU 1 with it
	}
	for _, tc := range tests {
		t.Run(strings.SplitN(tc.machine, "\n", 2)[0], func(t *testing.T) {
			_, inv := machine(t, tc.machine, "node-a")
			devs := allDevices(build(t, inv, "node-a", Options{}))
			assert.Len(t, devs, tc.total)

			byGPU := devicesOfGPU(devs)
			assert.NotContains(t, byGPU, int64(-1), "every device names its GPU index")
			assert.Len(t, byGPU, tc.gpus)
			for i := 0; i < tc.gpus; i++ {
				mig := tc.mig || inv.GPUs[i].MIG.Enabled
				assert.ElementsMatch(t, expectedGPUDevices(i, mig), deviceNames(byGPU[int64(i)]), "GPU %d", i)

				types := map[string]int{}
				profiles := map[string]int{}
				for _, d := range byGPU[int64(i)] {
					types[strAttr(d, "type")]++
					if p := strAttr(d, "migProfile"); p != "" {
						profiles[p]++
					}
				}
				wantTypes := map[string]int{TypeGPU: 1}
				wantProfiles := map[string]int{}
				if mig {
					wantTypes[TypeMIG] = 25
					wantProfiles = map[string]int{"1g.10gb": 7, "1g.10gb+me": 7, "1g.20gb": 4, "2g.20gb": 3, "3g.40gb": 2, "4g.40gb": 1, "7g.80gb": 1}
				}
				assert.Equal(t, wantTypes, types, "GPU %d: device types", i)
				assert.Equal(t, wantProfiles, profiles, "GPU %d: MIG devices per profile", i)
			}
		})
	}
}

func TestStableAcrossBuilds(t *testing.T) {
	tests := []struct {
		name        string
		otherNode   string
		wantSameAll bool // the whole output is identical, not only the names
	}{
		{"same node, second machine", "node-a", true},
		{"other node", "node-b", false},
	}
	_, invA := machine(t, "dgx-h100", "node-a")
	first := build(t, invA, "node-a", Options{})
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, invB := machine(t, "dgx-h100", tc.otherNode)
			second := build(t, invB, tc.otherNode, Options{})
			if tc.wantSameAll {
				assert.Equal(t, first, second)
				return
			}
			assert.Equal(t, deviceNames(allDevices(first)), deviceNames(allDevices(second)), "device names do not depend on the node")
			require.Equal(t, len(first), len(second))
			for i := range first {
				var setsA, setsB []string
				for _, cs := range first[i].Spec.SharedCounters {
					setsA = append(setsA, cs.Name)
				}
				for _, cs := range second[i].Spec.SharedCounters {
					setsB = append(setsB, cs.Name)
				}
				assert.Equal(t, setsA, setsB, "counter set names do not depend on the node")
			}
			uuidsA := map[string]bool{}
			for _, d := range allDevices(first) {
				for _, a := range []resourceapi.QualifiedName{"uuid", "parentUUID"} {
					if v := strAttr(d, a); v != "" {
						uuidsA[v] = true
					}
				}
			}
			require.Len(t, uuidsA, 8, "the 8 GPU UUIDs")
			for _, d := range allDevices(second) {
				for _, a := range []resourceapi.QualifiedName{"uuid", "parentUUID"} {
					if v := strAttr(d, a); v != "" {
						assert.False(t, uuidsA[v], "%s of %s on %s is also on node-a", a, d.Name, tc.otherNode)
					}
				}
			}
		})
	}
}

// semverRE is the official semver 2.0 pattern.
var semverRE = regexp.MustCompile(`^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$`)

// qualifiedNameErrors validates an attribute or capacity name as the API
// does: a C identifier of at most 32 characters, optionally prefixed by a
// DNS subdomain of at most 63 characters and a slash.
func qualifiedNameErrors(name resourceapi.QualifiedName) []string {
	domain, id, found := strings.Cut(string(name), "/")
	if !found {
		domain, id = "", string(name)
	}
	errs := content.IsCIdentifier(id)
	if len(id) > resourceapi.DeviceMaxIDLength {
		errs = append(errs, fmt.Sprintf("identifier longer than %d", resourceapi.DeviceMaxIDLength))
	}
	if found {
		errs = append(errs, validation.IsDNS1123Subdomain(domain)...)
		if len(domain) > resourceapi.DeviceMaxDomainLength {
			errs = append(errs, fmt.Sprintf("domain longer than %d", resourceapi.DeviceMaxDomainLength))
		}
	}
	return errs
}

func TestSliceLimits(t *testing.T) {
	tests := []struct {
		name    string
		machine string
		// wantCounterSlices is how many slices carry only counter sets.
		wantCounterSlices int
	}{
		{"dgx-h100", "dgx-h100", 1},
		{"dgx-h100-nomig", "dgx-h100-nomig", 0},
		{"h100-pcie", "h100-pcie", 1},
		{"h100-nvlink-fabric", "h100-nvlink-fabric", 0},
		{"20 GPUs", "name: big\ngpuCount: 20\nnvlink: nvswitch\nmigEnabled: all\n", 3},
		{"foreign MIG device", "name: f\ngpuCount: 2\nmigEnabled: all\nmigDevices:\n- {gpu: 0, profile: 3g.40gb, start: 4}\n", 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, inv := machine(t, tc.machine, "node-a")
			slices := build(t, inv, "node-a", Options{})
			require.NotEmpty(t, slices)

			poolSlices := map[string]int{}
			sliceNames := map[string]bool{}
			counterSlices := 0
			// pool -> counter set -> counters
			sets := map[string]map[string]map[string]resource.Quantity{}
			for _, s := range slices {
				pool := s.Spec.Pool.Name
				poolSlices[pool]++
				assert.Equal(t, DriverName, s.Spec.Driver)
				require.NotNil(t, s.Spec.NodeName)
				assert.Equal(t, "node-a", *s.Spec.NodeName)
				assert.Empty(t, validation.IsDNS1123Subdomain(s.Name), "slice name %q", s.Name)
				assert.False(t, sliceNames[s.Name], "duplicate slice name %s", s.Name)
				sliceNames[s.Name] = true

				assert.False(t, len(s.Spec.Devices) > 0 && len(s.Spec.SharedCounters) > 0, "slice %s has both devices and shared counters", s.Name)
				assert.LessOrEqual(t, len(s.Spec.Devices), resourceapi.ResourceSliceMaxDevicesWithAdvancedFeatures, "slice %s", s.Name)
				assert.LessOrEqual(t, len(s.Spec.SharedCounters), resourceapi.ResourceSliceMaxCounterSets, "slice %s", s.Name)
				if len(s.Spec.SharedCounters) > 0 {
					counterSlices++
				}
				for _, cs := range s.Spec.SharedCounters {
					assert.Empty(t, validation.IsDNS1123Label(cs.Name), "counter set %q", cs.Name)
					assert.LessOrEqual(t, len(cs.Counters), resourceapi.ResourceSliceMaxCountersPerCounterSet, "counter set %s", cs.Name)
					if sets[pool] == nil {
						sets[pool] = map[string]map[string]resource.Quantity{}
					}
					assert.NotContains(t, sets[pool], cs.Name, "counter set %s twice in pool %s", cs.Name, pool)
					sets[pool][cs.Name] = map[string]resource.Quantity{}
					for name, c := range cs.Counters {
						assert.Empty(t, validation.IsDNS1123Label(name), "counter %q in %s", name, cs.Name)
						assert.GreaterOrEqual(t, c.Value.Sign(), 0, "counter %s/%s", cs.Name, name)
						sets[pool][cs.Name][name] = c.Value
					}
				}
			}
			assert.Equal(t, tc.wantCounterSlices, counterSlices)
			partitioned := 0
			for _, g := range inv.GPUs {
				if g.MIG.Capable && g.MIG.Enabled {
					partitioned++
				}
			}
			assert.Len(t, sets["node-a"], partitioned, "one counter set per GPU in MIG mode, none for a GPU with MIG off")
			for _, s := range slices {
				assert.Equal(t, int64(poolSlices[s.Spec.Pool.Name]), s.Spec.Pool.ResourceSliceCount,
					"slice %s: ResourceSliceCount of pool %s", s.Name, s.Spec.Pool.Name)
				assert.Equal(t, slices[0].Spec.Pool.Generation, s.Spec.Pool.Generation, "one generation per pool")
			}

			names := map[string]bool{}
			for _, s := range slices {
				pool := s.Spec.Pool.Name
				for _, d := range s.Spec.Devices {
					assert.Empty(t, validation.IsDNS1123Label(d.Name), "device name %q", d.Name)
					assert.False(t, names[d.Name], "device %s twice in the pool", d.Name)
					names[d.Name] = true

					assert.LessOrEqual(t, len(d.Attributes)+len(d.Capacity), resourceapi.ResourceSliceMaxAttributesAndCapacitiesPerDevice, "device %s", d.Name)
					for name, a := range d.Attributes {
						assert.Empty(t, qualifiedNameErrors(name), "device %s: attribute name %q", d.Name, name)
						set := 0
						for _, isSet := range []bool{a.IntValue != nil, a.BoolValue != nil, a.StringValue != nil, a.VersionValue != nil} {
							if isSet {
								set++
							}
						}
						assert.Equal(t, 1, set, "device %s: attribute %s must have exactly one value", d.Name, name)
						if a.StringValue != nil {
							assert.LessOrEqual(t, len(*a.StringValue), resourceapi.DeviceAttributeMaxValueLength, "device %s: attribute %s", d.Name, name)
						}
						if a.VersionValue != nil {
							assert.Regexp(t, semverRE, *a.VersionValue, "device %s: attribute %s", d.Name, name)
						}
					}
					for name := range d.Capacity {
						assert.Empty(t, qualifiedNameErrors(name), "device %s: capacity name %q", d.Name, name)
					}

					migMode := d.Attributes["migEnabled"].BoolValue != nil && *d.Attributes["migEnabled"].BoolValue
					switch {
					case strAttr(d, "type") == TypeGPU && migMode, strAttr(d, "type") == TypeMIG && strAttr(d, "uuid") == "":
						// Anything the scheduler's counters must account for.
						assert.NotEmpty(t, d.ConsumesCounters, "device %s consumes no counters", d.Name)
					case strAttr(d, "type") == TypeGPU:
						// MIG off: nothing else draws on the GPU.
						assert.Empty(t, d.ConsumesCounters, "device %s: MIG off, no counters", d.Name)
					}
					assert.LessOrEqual(t, len(d.ConsumesCounters), resourceapi.ResourceSliceMaxDeviceCounterConsumptionsPerDevice, "device %s", d.Name)
					for _, cc := range d.ConsumesCounters {
						set, ok := sets[pool][cc.CounterSet]
						if !assert.True(t, ok, "device %s consumes from counter set %s, which pool %s lacks", d.Name, cc.CounterSet, pool) {
							continue
						}
						assert.LessOrEqual(t, len(cc.Counters), resourceapi.ResourceSliceMaxCountersPerDeviceCounterConsumption, "device %s", d.Name)
						for name, c := range cc.Counters {
							have, ok := set[name]
							if assert.True(t, ok, "device %s consumes counter %s, which set %s lacks", d.Name, name, cc.CounterSet) {
								assert.LessOrEqual(t, c.Value.Cmp(have), 0, "device %s alone needs more %s than %s has", d.Name, name, cc.CounterSet)
							}
						}
					}
				}
			}
		})
	}
}

func TestFullGPUAttributes(t *testing.T) {
	_, inv := machine(t, "dgx-h100-nomig", "node-a")
	byName := devicesByName(build(t, inv, "node-a", Options{}))
	domain := strAttr(byName["gpu-0"], "nvlinkDomain")
	require.NotEmpty(t, domain, "a DGX H100 GPU is in an NVLink domain")
	_, migInv := machine(t, "dgx-h100", "node-a")
	assert.Empty(t, strAttr(devicesByName(build(t, migInv, "node-a", Options{}))["gpu-0"], "nvlinkDomain"),
		"... unless it is in MIG mode: no NVLink peer-to-peer then")

	for i := 0; i < 8; i++ {
		g := inv.GPUs[i]
		d, ok := byName[fmt.Sprintf("gpu-%d", i)]
		require.True(t, ok, "gpu-%d is published", i)
		want := []struct {
			attr resourceapi.QualifiedName
			want resourceapi.DeviceAttribute
		}{
			{"type", resourceapi.DeviceAttribute{StringValue: ptr.To("gpu")}},
			{"uuid", resourceapi.DeviceAttribute{StringValue: ptr.To(g.UUID)}},
			{"productName", resourceapi.DeviceAttribute{StringValue: ptr.To("NVIDIA H100 80GB HBM3")}},
			{"architecture", resourceapi.DeviceAttribute{StringValue: ptr.To("Hopper")}},
			{"cudaComputeCapability", resourceapi.DeviceAttribute{VersionValue: ptr.To("9.0.0")}},
			{"index", resourceapi.DeviceAttribute{IntValue: ptr.To(int64(i))}},
			{"minor", resourceapi.DeviceAttribute{IntValue: ptr.To(int64(i))}},
			{"nvlinkDomain", resourceapi.DeviceAttribute{StringValue: ptr.To(domain)}},
			{"resource.kubernetes.io/pciBusID", resourceapi.DeviceAttribute{StringValue: ptr.To(g.PCI.BusID)}},
			{"resource.kubernetes.io/numaNode", resourceapi.DeviceAttribute{IntValue: ptr.To(int64(i / 4))}}, // DGX: GPUs 0-3 on NUMA node 0
		}
		for _, w := range want {
			assert.Equal(t, w.want, d.Attributes[w.attr], "gpu-%d: attribute %s", i, w.attr)
		}
		assert.Regexp(t, `^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$`, strAttr(d, "resource.kubernetes.io/pciBusID"), "gpu-%d", i)
		assert.Regexp(t, `^GPU-[0-9a-f]{8}-`, strAttr(d, "uuid"), "gpu-%d", i)
		for _, v := range []resourceapi.QualifiedName{"driverVersion", "cudaDriverVersion"} {
			if assert.NotNil(t, d.Attributes[v].VersionValue, "gpu-%d: %s is a version", i, v) {
				assert.Regexp(t, semverRE, *d.Attributes[v].VersionValue, "gpu-%d: %s", i, v)
			}
		}
		assert.NotContains(t, d.Attributes, resourceapi.QualifiedName("fabricClique"), "gpu-%d: no multi-node fabric on a DGX H100", i)
		assert.True(t, resource.MustParse("81559Mi").Equal(d.Capacity["memory"].Value), "gpu-%d: memory %s", i, ptr.To(d.Capacity["memory"].Value))
		assert.True(t, resource.MustParse("132").Equal(d.Capacity["multiprocessors"].Value), "gpu-%d: multiprocessors", i)
	}
}

func TestMigAttributes(t *testing.T) {
	_, inv := machine(t, "dgx-h100", "node-a")
	byName := devicesByName(build(t, inv, "node-a", Options{}))
	for _, p := range h100Placements {
		t.Run(p.profile, func(t *testing.T) {
			for gpu := 0; gpu < 8; gpu++ {
				for _, start := range p.starts {
					name := migName(gpu, p.label, start)
					d, ok := byName[name]
					if !assert.True(t, ok, "%s is published", name) {
						continue
					}
					assert.Equal(t, TypeMIG, strAttr(d, "type"), name)
					assert.Equal(t, p.profile, strAttr(d, "migProfile"), name)
					assert.Equal(t, inv.GPUs[gpu].UUID, strAttr(d, "parentUUID"), name)
					assert.Equal(t, inv.GPUs[gpu].PCI.PCIeRoot, strAttr(d, "resource.kubernetes.io/pcieRoot"), name)
					assert.Equal(t, "NVIDIA H100 80GB HBM3", strAttr(d, "productName"), name)
					// Slim (issue 26): what a claim selects or aligns on, nothing
					// that only repeats the GPU's device.
					var keys []string
					for k := range d.Attributes {
						keys = append(keys, string(k))
					}
					assert.ElementsMatch(t, []string{"type", "migProfile", "parentUUID", "productName", "index",
						"resource.kubernetes.io/pcieRoot", "resource.kubernetes.io/numaNode"}, keys, name)
					assert.Len(t, d.Capacity, 2, "%s: memory and multiprocessors", name)
					assert.NotContains(t, d.Attributes, resourceapi.QualifiedName("nvlinkDomain"), "%s: MIG devices have no NVLink peer-to-peer", name)
					assert.NotContains(t, d.Attributes, resourceapi.QualifiedName("fabricClique"), name)
					assert.NotContains(t, d.Attributes, resourceapi.QualifiedName("uuid"), "%s: a placement that does not exist yet has no UUID", name)

					mem := resource.MustParse(fmt.Sprintf("%dMi", p.memoryMiB))
					assert.True(t, mem.Equal(d.Capacity["memory"].Value), "%s: memory %s, want %s", name, ptr.To(d.Capacity["memory"].Value), &mem)
					assert.Equal(t, p.sms, ptr.To(d.Capacity["multiprocessors"].Value).Value(), "%s: multiprocessors", name)

					// The memory-slice counters it consumes are exactly its placement.
					require.Len(t, d.ConsumesCounters, 1, name)
					assert.Equal(t, fmt.Sprintf("gpu-%d-counters", gpu), d.ConsumesCounters[0].CounterSet, name)
					var slices []int
					for c := range d.ConsumesCounters[0].Counters {
						var s int
						if _, err := fmt.Sscanf(c, "memory-slice-%d", &s); err == nil {
							slices = append(slices, s)
						}
					}
					want := nvdevice.Placement{Start: start, Size: p.size}.Slices()
					assert.ElementsMatch(t, want, slices, "%s: memory slices", name)
				}
			}
		})
	}
}

func TestMachineVariants(t *testing.T) {
	uuidDotClique := regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\.1$`)
	tests := []struct {
		machine     string
		product     string
		wantDevices int
		wantDomain  bool // full GPUs carry one shared nvlinkDomain
		wantClique  bool // ... which is the fabric clique "<uuid>.1"
		wantMig     bool
	}{
		{"dgx-h100", "NVIDIA H100 80GB HBM3", 208, false, false, true}, // MIG mode: no NVLink P2P
		{"h100-pcie", "NVIDIA H100 PCIe", 52, false, false, true},
		{"h100-nvlink-fabric", "NVIDIA H100 80GB HBM3", 8, true, true, false},
		{"dgx-h100-nomig", "NVIDIA H100 80GB HBM3", 8, true, false, false},
	}
	for _, tc := range tests {
		t.Run(tc.machine, func(t *testing.T) {
			_, inv := machine(t, tc.machine, "node-a")
			slices := build(t, inv, "node-a", Options{})
			devs := allDevices(slices)
			assert.Len(t, devs, tc.wantDevices)

			domains := map[string]bool{}
			for _, d := range devs {
				assert.Equal(t, tc.product, strAttr(d, "productName"), d.Name)
				if !tc.wantMig {
					assert.Equal(t, TypeGPU, strAttr(d, "type"), "%s: MIG is off, only full GPUs", d.Name)
				}
				if strAttr(d, "type") != TypeGPU {
					assert.NotContains(t, d.Attributes, resourceapi.QualifiedName("nvlinkDomain"), d.Name)
					continue
				}
				domain, hasDomain := d.Attributes["nvlinkDomain"]
				clique, hasClique := d.Attributes["fabricClique"]
				assert.Equal(t, tc.wantDomain, hasDomain, "%s: nvlinkDomain", d.Name)
				assert.Equal(t, tc.wantClique, hasClique, "%s: fabricClique", d.Name)
				if hasDomain {
					require.NotNil(t, domain.StringValue, d.Name)
					assert.NotEmpty(t, *domain.StringValue, d.Name)
					domains[*domain.StringValue] = true
				}
				if hasClique {
					require.NotNil(t, clique.StringValue, d.Name)
					assert.Regexp(t, uuidDotClique, *clique.StringValue, d.Name)
					assert.Equal(t, clique, domain, "%s: the fabric clique is the NVLink domain", d.Name)
				}
			}
			if tc.wantDomain {
				assert.Len(t, domains, 1, "all GPUs of the node share one NVLink domain")
			}

			memorySlices := false
			for _, s := range slices {
				for _, cs := range s.Spec.SharedCounters {
					_, ok := cs.Counters["memory-slice-0"]
					memorySlices = memorySlices || ok
				}
			}
			assert.Equal(t, tc.wantMig, memorySlices, "memory-slice counters exist only with MIG on")
		})
	}
}

func TestForeignMigDevice(t *testing.T) {
	const spec = "name: foreign\ngpuCount: 2\nmigEnabled: all\nmigDevices:\n- {gpu: 0, profile: 3g.40gb, start: 4}\n"
	_, inv := machine(t, spec, "node-a")
	require.Len(t, inv.GPUs[0].MIG.Devices, 1)
	existing := inv.GPUs[0].MIG.Devices[0]
	require.Equal(t, nvdevice.Placement{Start: 4, Size: 4}, existing.Placement)

	// With the device unmanaged, GPU 0 offers what does not overlap memory
	// slices 4-7, plus the existing 3g.40gb at 4 as it is.
	foreignGPU0 := []string{}
	for _, p := range h100Placements {
		for _, s := range p.starts {
			pl := nvdevice.Placement{Start: s, Size: p.size}
			if !pl.Overlaps(existing.Placement) || (p.profile == "3g.40gb" && s == 4) {
				foreignGPU0 = append(foreignGPU0, migName(0, p.label, s))
			}
		}
	}
	require.Len(t, foreignGPU0, 15)

	tests := []struct {
		name      string
		managed   map[string]bool
		wantGPU0  []string
		wantUUID4 string // the uuid attribute of gpu-0-mig-3g-40gb-4
	}{
		{"someone else's", nil, foreignGPU0, existing.UUID},
		{"someone else's, other devices managed", map[string]bool{"MIG-not-this-one": true}, foreignGPU0, existing.UUID},
		{"managed by the driver", map[string]bool{existing.UUID: true}, expectedGPUDevices(0, true), ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			devs := allDevices(build(t, inv, "node-a", Options{ManagedMigDevices: tc.managed}))
			byGPU := devicesOfGPU(devs)
			assert.ElementsMatch(t, tc.wantGPU0, deviceNames(byGPU[0]), "GPU 0")
			assert.ElementsMatch(t, expectedGPUDevices(1, true), deviceNames(byGPU[1]), "GPU 1 is untouched")

			byName := map[string]resourceapi.Device{}
			for _, d := range devs {
				byName[d.Name] = d
			}
			kept, ok := byName["gpu-0-mig-3g-40gb-4"]
			require.True(t, ok, "the 3g.40gb at 4 is offered")
			assert.Equal(t, tc.wantUUID4, strAttr(kept, "uuid"))
			assert.Equal(t, "3g.40gb", strAttr(kept, "migProfile"))
			assert.Equal(t, inv.GPUs[0].UUID, strAttr(kept, "parentUUID"))
		})
	}
}

func TestTaints(t *testing.T) {
	unhealthy := resourceapi.DeviceTaint{Key: "gpu.gpudra.dev/unhealthy", Value: "xid-79", Effect: resourceapi.DeviceTaintEffectNoSchedule}
	draining := resourceapi.DeviceTaint{Key: "gpu.gpudra.dev/draining", Effect: resourceapi.DeviceTaintEffectNoExecute}
	tests := []struct {
		name   string
		taints map[string][]resourceapi.DeviceTaint
	}{
		{"full GPU", map[string][]resourceapi.DeviceTaint{"gpu-3": {unhealthy}}},
		{"MIG device", map[string][]resourceapi.DeviceTaint{"gpu-5-mig-1g-10gb-me-2": {unhealthy}}},
		{"two taints, two devices", map[string][]resourceapi.DeviceTaint{"gpu-0": {unhealthy, draining}, "gpu-7-mig-7g-80gb-0": {draining}}},
		{"unknown device", map[string][]resourceapi.DeviceTaint{"gpu-99": {unhealthy}}},
	}
	_, inv := machine(t, "dgx-h100", "node-a")
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			slices := build(t, inv, "node-a", Options{Taints: tc.taints})
			tainted := 0
			for _, d := range allDevices(slices) {
				assert.Equal(t, tc.taints[d.Name], d.Taints, d.Name)
				if len(d.Taints) > 0 {
					tainted++
				}
			}
			want := len(tc.taints)
			if _, ok := tc.taints["gpu-99"]; ok {
				want--
			}
			assert.Equal(t, want, tainted)
			for _, s := range slices {
				assert.LessOrEqual(t, len(s.Spec.Devices), resourceapi.ResourceSliceMaxDevicesWithAdvancedFeatures)
			}
		})
	}
}

func TestSemver(t *testing.T) {
	tests := []struct {
		in     string
		want   string
		wantOK bool
	}{
		{"9.0", "9.0.0", true},
		{"570.172.08", "570.172.8", true},
		{"12.8", "12.8.0", true},
		{"550", "550.0.0", true},
		{"1.2.3", "1.2.3", true},
		{"abc", "", false},
		{"1.2.3.4", "", false},
		{"", "", false},
		{"1.-2", "", false},
		{"1..2", "", false},
	}
	for _, tc := range tests {
		t.Run(tc.in, func(t *testing.T) {
			got, ok := Semver(tc.in)
			assert.Equal(t, tc.wantOK, ok)
			assert.Equal(t, tc.want, got)
			if ok {
				assert.Regexp(t, semverRE, got)
			}
		})
	}
}

func TestEmptyNode(t *testing.T) {
	res, err := Build(&nvdevice.Inventory{}, "node-a", Options{})
	require.NoError(t, err)
	slices := ResourceSlices(res, "node-a")
	require.Len(t, slices, 1, "an empty pool still publishes one slice")
	assert.Empty(t, slices[0].Spec.Devices)
	assert.Equal(t, int64(1), slices[0].Spec.Pool.ResourceSliceCount)
}

func TestFractionalGPUs(t *testing.T) {
	_, inv := machine(t, "name: two\ngpuCount: 2\nnvlink: nvswitch\nmigEnabled: [0]\n", "node-a")
	slices := build(t, inv, "node-a", Options{FractionalGPUs: true})
	var full0, full1 *resourceapi.Device
	for _, s := range slices {
		for i := range s.Spec.Devices {
			switch s.Spec.Devices[i].Name {
			case "gpu-0":
				full0 = &s.Spec.Devices[i]
			case "gpu-1":
				full1 = &s.Spec.Devices[i]
			}
		}
	}
	require.NotNil(t, full0)
	require.NotNil(t, full1)
	// GPU 0 has MIG on: published as before, not shareable.
	assert.Nil(t, full0.AllowMultipleAllocations)
	assert.NotEmpty(t, full0.ConsumesCounters)
	// GPU 1 has MIG off: shareable, every capacity with a request policy,
	// no counters.
	require.NotNil(t, full1.AllowMultipleAllocations)
	assert.True(t, *full1.AllowMultipleAllocations)
	assert.Empty(t, full1.ConsumesCounters)
	assert.Equal(t, "fractional", *full1.Attributes["sharing"].StringValue)
	for name, c := range full1.Capacity {
		require.NotNil(t, c.RequestPolicy, "capacity %s has no request policy: a claim not asking for it would take it all", name)
		require.NotNil(t, c.RequestPolicy.Default)
		if name == CapacityMemory {
			assert.True(t, c.RequestPolicy.Default.Equal(c.Value), "a claim that asks for no memory takes all of it")
			assert.Equal(t, "1Gi", c.RequestPolicy.ValidRange.Min.String())
		} else {
			assert.True(t, c.RequestPolicy.Default.IsZero(), "%s: nothing consumed by default", name)
		}
	}
}

// What the standard forbids is left out: a NUMA node of a GPU without NUMA
// affinity, and a bus id outside the BDF form (a VMD domain).
func TestStandardAttributesLeftOutWhenTheStandardForbidsThem(t *testing.T) {
	for _, tc := range []struct {
		name              string
		busID             string
		numa              int
		wantBus, wantNUMA bool
	}{
		{"plain", "0000:18:00.0", 1, true, true},
		{"no NUMA affinity", "0000:18:00.0", -1, true, false},
		{"VMD domain", "10000:e1:00.0", 0, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, inv := machine(t, "dgx-h100-nomig", "node-a")
			g := inv.GPUs[0]
			g.PCI.BusID, g.NUMANode = tc.busID, tc.numa
			attrs := gpuAttributes(&g)
			_, hasBus := attrs["resource.kubernetes.io/pciBusID"]
			numa, hasNUMA := attrs["resource.kubernetes.io/numaNode"]
			assert.Equal(t, tc.wantBus, hasBus, "pciBusID published")
			assert.Equal(t, tc.wantNUMA, hasNUMA, "numaNode published")
			if hasNUMA {
				assert.Equal(t, int64(tc.numa), *numa.IntValue)
			}
		})
	}
}

// With MIG creation off (feature gate DynamicMIG), a GPU in MIG mode offers
// only the instances that exist; a GPU with MIG off is offered whole.
func TestExistingMigOnly(t *testing.T) {
	m, inv := machine(t, "name: t\ngpuModel: h100-sxm5\ngpuCount: 2\nnvlink: nvswitch\nmigEnabled: [0]\n", "node-a")
	_, err := m.CreateMigDevice(context.Background(), nvdevice.MigCreateRequest{ParentUUID: inv.GPUs[0].UUID, Profile: "3g.40gb", Start: 4})
	require.NoError(t, err)
	inv, err = m.Inventory(context.Background())
	require.NoError(t, err)

	var names []string
	for _, d := range allDevices(build(t, inv, "node-a", Options{ExistingMigOnly: true})) {
		names = append(names, d.Name)
	}
	assert.ElementsMatch(t, []string{"gpu-0-mig-3g-40gb-4", "gpu-1"}, names)

	all := allDevices(build(t, inv, "node-a", Options{}))
	assert.Greater(t, len(all), 2, "with creation on, every free placement is offered")
}

// TestDCGMExporterAttributes: the attributes dcgm-exporter reads from a DRA
// driver's slices to attribute pods' GPU metrics (its
// internal/pkg/transformation/dra.go): type "gpu" with uuid, type "mig"
// with parentUUID (without it dcgm-exporter skips the device) and, with
// Options.DCGMExporterAttributes, profile; without it no device pays for
// profile.
func TestDCGMExporterAttributes(t *testing.T) {
	for _, tc := range []struct {
		name    string
		machine string
		opts    Options
	}{
		{"MIG off", "dgx-h100-nomig", Options{DCGMExporterAttributes: true}},
		{"MIG, every placement", "dgx-h100", Options{DCGMExporterAttributes: true}},
		{"MIG, existing only", "name: two\ngpuCount: 1\nmigEnabled: all\nmigDevices:\n- {gpu: 0, profile: 3g.40gb, start: 4}\n", Options{Mig: MigPolicy{Existing: true}, DCGMExporterAttributes: true}},
		{"off: no profile", "dgx-h100", Options{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, inv := machine(t, tc.machine, "node-a")
			devs := allDevices(build(t, inv, "node-a", tc.opts))
			require.NotEmpty(t, devs)
			migs := 0
			for _, d := range devs {
				switch strAttr(d, "type") {
				case TypeGPU:
					assert.NotEmpty(t, strAttr(d, "uuid"), "%s: a GPU's uuid", d.Name)
					assert.Empty(t, strAttr(d, "profile"), "%s: a GPU has no profile", d.Name)
				case TypeMIG:
					migs++
					assert.NotEmpty(t, strAttr(d, "parentUUID"), "%s: parentUUID", d.Name)
					if !tc.opts.DCGMExporterAttributes {
						assert.Empty(t, strAttr(d, "profile"), "%s: no profile unless asked", d.Name)
						break
					}
					assert.NotEmpty(t, strAttr(d, "profile"), "%s: profile", d.Name)
					assert.Equal(t, strAttr(d, "migProfile"), strAttr(d, "profile"), "%s: profile is the MIG profile", d.Name)
				default:
					t.Errorf("%s: type %q, dcgm-exporter knows gpu and mig", d.Name, strAttr(d, "type"))
				}
			}
			if tc.machine != "dgx-h100-nomig" {
				assert.NotZero(t, migs, "MIG devices published")
			}
		})
	}
}
