package slicebuilder

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

func TestDGXH100Devices(t *testing.T) {
	_, inv := machine(t, "dgx-h100", "node-a")
	slices := build(t, inv, "node-a", Options{})
	devs := allDevices(slices)
	require.Len(t, devs, 8*26)

	perProfile := map[string]int{}
	gpus := 0
	for _, d := range devs {
		switch strAttr(d, "type") {
		case TypeGPU:
			gpus++
		case TypeMIG:
			perProfile[strAttr(d, "migProfile")]++
		default:
			t.Errorf("device %s has type %q", d.Name, strAttr(d, "type"))
		}
	}
	assert.Equal(t, 8, gpus)
	assert.Equal(t, map[string]int{"1g.10gb": 56, "1g.10gb+me": 56, "1g.20gb": 32, "2g.20gb": 24, "3g.40gb": 16, "4g.40gb": 8, "7g.80gb": 8}, perProfile)

	byName := devicesByName(slices)
	for i := 0; i < 8; i++ {
		assert.Contains(t, byName, fmt.Sprintf("gpu-%d", i))
		assert.Contains(t, byName, fmt.Sprintf("gpu-%d-mig-1g-10gb-me-6", i))
		assert.Contains(t, byName, fmt.Sprintf("gpu-%d-mig-3g-40gb-4", i))
	}

	full, mig := byName["gpu-0"], byName["gpu-0-mig-1g-10gb-0"]
	assert.Equal(t, "NVIDIA H100 80GB HBM3", strAttr(full, "productName"))
	assert.Equal(t, inv.GPUs[0].UUID, strAttr(full, "uuid"))
	assert.Equal(t, "9.0.0", *full.Attributes["cudaComputeCapability"].VersionValue)
	assert.Equal(t, "570.172.8", *full.Attributes["driverVersion"].VersionValue)
	assert.Equal(t, "12.8.0", *full.Attributes["cudaDriverVersion"].VersionValue)
	assert.Equal(t, "0000:18:00.0", strAttr(full, "resource.kubernetes.io/pciBusID"))
	assert.Equal(t, int64(0), *full.Attributes["resource.kubernetes.io/numaNode"].IntValue)
	assert.True(t, resource.MustParse("81559Mi").Equal(full.Capacity["memory"].Value))
	assert.True(t, resource.MustParse("9984Mi").Equal(mig.Capacity["memory"].Value))
	assert.Equal(t, inv.GPUs[0].UUID, strAttr(mig, "parentUUID"))
	assert.NotContains(t, mig.Attributes, resourceapi.QualifiedName("nvlinkDomain"), "MIG instances have no NVLink peer-to-peer")
	assert.NotContains(t, mig.Attributes, resourceapi.QualifiedName("uuid"), "a placement that does not exist yet has no UUID")

	domain := strAttr(full, "nvlinkDomain")
	require.NotEmpty(t, domain)
	for i := 1; i < 8; i++ {
		assert.Equal(t, domain, strAttr(byName[fmt.Sprintf("gpu-%d", i)], "nvlinkDomain"))
	}
}

func TestSliceLimits(t *testing.T) {
	for _, m := range []string{"dgx-h100", "dgx-h100-nomig", "h100-pcie", "h100-nvlink-fabric", "name: big\ngpuCount: 20\nmigEnabled: all\n"} {
		t.Run(m, func(t *testing.T) {
			_, inv := machine(t, m, "node-a")
			slices := build(t, inv, "node-a", Options{})
			sets := map[string]resourceapi.CounterSet{}
			names := map[string]bool{}
			for _, s := range slices {
				assert.Equal(t, DriverName, s.Spec.Driver)
				assert.Equal(t, "node-a", *s.Spec.NodeName)
				assert.Equal(t, int64(len(slices)), s.Spec.Pool.ResourceSliceCount)
				assert.Empty(t, validation.IsDNS1123Subdomain(s.Name))
				assert.False(t, len(s.Spec.Devices) > 0 && len(s.Spec.SharedCounters) > 0, "slice %s mixes devices and counters", s.Name)
				assert.LessOrEqual(t, len(s.Spec.Devices), MaxDevicesWithCounters)
				assert.LessOrEqual(t, len(s.Spec.SharedCounters), MaxCounterSetsPerSlice)
				for _, cs := range s.Spec.SharedCounters {
					assert.Empty(t, validation.IsDNS1123Label(cs.Name))
					assert.LessOrEqual(t, len(cs.Counters), MaxCountersPerSet)
					for c := range cs.Counters {
						assert.Empty(t, validation.IsDNS1123Label(c), "counter %q", c)
					}
					assert.NotContains(t, sets, cs.Name)
					sets[cs.Name] = cs
				}
			}
			for _, d := range allDevices(slices) {
				assert.Empty(t, validation.IsDNS1123Label(d.Name), "device %q", d.Name)
				assert.False(t, names[d.Name], "duplicate device %s", d.Name)
				names[d.Name] = true
				assert.LessOrEqual(t, len(d.Attributes)+len(d.Capacity), MaxAttributesAndCapacities)
				assert.LessOrEqual(t, len(d.ConsumesCounters), 2)
				for _, cc := range d.ConsumesCounters {
					cs, ok := sets[cc.CounterSet]
					require.True(t, ok, "device %s consumes from unknown set %s", d.Name, cc.CounterSet)
					for c, v := range cc.Counters {
						have, ok := cs.Counters[c]
						require.True(t, ok, "device %s consumes unknown counter %s", d.Name, c)
						assert.LessOrEqual(t, v.Value.Cmp(have.Value), 0, "device %s alone exceeds %s", d.Name, c)
					}
				}
				for name := range d.Attributes {
					assert.LessOrEqual(t, len(name), 64)
				}
			}
		})
	}
}

func TestStableNames(t *testing.T) {
	_, a1 := machine(t, "dgx-h100", "node-a")
	_, a2 := machine(t, "dgx-h100", "node-a")
	_, b := machine(t, "dgx-h100", "node-b")
	sa1, sa2, sb := build(t, a1, "node-a", Options{}), build(t, a2, "node-a", Options{}), build(t, b, "node-b", Options{})
	assert.Equal(t, sa1, sa2, "same node, same slices")
	da, db := allDevices(sa1), allDevices(sb)
	require.Equal(t, len(da), len(db))
	for i := range da {
		assert.Equal(t, da[i].Name, db[i].Name, "device names do not depend on the node")
	}
	assert.NotEqual(t, strAttr(da[0], "uuid"), strAttr(db[0], "uuid"))
}

func TestMachinesAttributes(t *testing.T) {
	_, pcie := machine(t, "h100-pcie", "n")
	for _, d := range allDevices(build(t, pcie, "n", Options{})) {
		assert.NotContains(t, d.Attributes, resourceapi.QualifiedName("nvlinkDomain"), d.Name)
	}
	_, fabric := machine(t, "h100-nvlink-fabric", "n")
	full := devicesByName(build(t, fabric, "n", Options{}))["gpu-3"]
	assert.Regexp(t, `^[0-9a-f-]{36}\.1$`, strAttr(full, "fabricClique"))
	assert.Equal(t, strAttr(full, "fabricClique"), strAttr(full, "nvlinkDomain"))

	_, nomig := machine(t, "dgx-h100-nomig", "n")
	slices := build(t, nomig, "n", Options{})
	assert.Len(t, allDevices(slices), 8, "MIG disabled: full GPUs only")
	for _, s := range slices {
		for _, cs := range s.Spec.SharedCounters {
			assert.NotContains(t, cs.Counters, "memory-slice-0", "no memory-slice counters without MIG")
		}
	}
}

func TestForeignMigDevice(t *testing.T) {
	const spec = "name: x\ngpuCount: 2\nmigEnabled: all\nmigDevices:\n- {gpu: 0, profile: 3g.40gb, start: 4}\n"
	_, inv := machine(t, spec, "n")
	existing := inv.GPUs[0].MIG.Devices[0]

	byName := devicesByName(build(t, inv, "n", Options{}))
	assert.NotContains(t, byName, "gpu-0", "a GPU with someone else's MIG device cannot be handed out whole")
	assert.Contains(t, byName, "gpu-1")
	kept := byName["gpu-0-mig-3g-40gb-4"]
	assert.Equal(t, existing.UUID, strAttr(kept, "uuid"), "the existing instance is offered as it is")
	for _, hidden := range []string{"gpu-0-mig-1g-10gb-4", "gpu-0-mig-1g-10gb-6", "gpu-0-mig-1g-20gb-6", "gpu-0-mig-2g-20gb-4", "gpu-0-mig-7g-80gb-0"} {
		assert.NotContains(t, byName, hidden)
	}
	for _, free := range []string{"gpu-0-mig-4g-40gb-0", "gpu-0-mig-1g-10gb-3", "gpu-0-mig-2g-20gb-2"} {
		assert.Contains(t, byName, free)
	}

	managed := devicesByName(build(t, inv, "n", Options{ManagedMigDevices: map[string]bool{existing.UUID: true}}))
	assert.Len(t, managed, 2*26, "devices the driver created hide nothing: the counters account for them")
	assert.NotContains(t, managed["gpu-0-mig-3g-40gb-4"].Attributes, resourceapi.QualifiedName("uuid"))
}

func TestTaints(t *testing.T) {
	_, inv := machine(t, oneGPUMig, "n")
	taint := resourceapi.DeviceTaint{Key: "gpu.gpudra.dev/unhealthy", Value: "xid-79", Effect: resourceapi.DeviceTaintEffectNoSchedule}
	byName := devicesByName(build(t, inv, "n", Options{Taints: map[string][]resourceapi.DeviceTaint{"gpu-0": {taint}}}))
	assert.Equal(t, []resourceapi.DeviceTaint{taint}, byName["gpu-0"].Taints)
	assert.Empty(t, byName["gpu-0-mig-1g-10gb-0"].Taints)
}

func TestSemver(t *testing.T) {
	for in, want := range map[string]string{"9.0": "9.0.0", "570.172.08": "570.172.8", "12.8": "12.8.0", "550": "550.0.0", "abc": "", "1.2.3.4": "", "": "", "1.-2": ""} {
		got, ok := Semver(in)
		assert.Equal(t, want != "", ok, in)
		assert.Equal(t, want, got, in)
	}
}

func TestEmptyNode(t *testing.T) {
	res, err := Build(&nvdevice.Inventory{}, "n", Options{})
	require.NoError(t, err)
	slices := ResourceSlices(res, "n")
	require.Len(t, slices, 1, "an empty pool still publishes one slice")
	assert.Empty(t, slices[0].Spec.Devices)
}
