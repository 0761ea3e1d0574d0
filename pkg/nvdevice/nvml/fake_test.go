//go:build cgo && linux

package nvml

import (
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/NVIDIA/go-nvlib/pkg/nvlib/device"
	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
)

// The fakes below are built on go-nvml's generated mocks (mock.Interface,
// mock.Device, ...) with their function fields filled from facts/h100.md:
// mock/dgxh100 is not faithful (81920 MiB, profile ids equal to the enum,
// placements in compute slices) and panics on MIG device handles, NVLink,
// fabric info and events.

func cString(s string) [32]int8 {
	var b [32]int8
	for i, c := range s {
		b[i] = int8(c)
	}
	return b
}

// h100Profiles is what NVML reports for an H100 80GB SXM5, by profile enum.
var h100Profiles = map[int]nvml.GpuInstanceProfileInfo{
	nvml.GPU_INSTANCE_PROFILE_1_SLICE:      {Id: 19, SliceCount: 1, InstanceCount: 7, MultiprocessorCount: 16, CopyEngineCount: 1, DecoderCount: 1, JpegCount: 1, MemorySizeMB: 9984},
	nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1: {Id: 20, SliceCount: 1, InstanceCount: 1, MultiprocessorCount: 16, CopyEngineCount: 1, DecoderCount: 1, JpegCount: 1, OfaCount: 1, MemorySizeMB: 9984},
	nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2: {Id: 15, SliceCount: 1, InstanceCount: 4, MultiprocessorCount: 26, CopyEngineCount: 1, DecoderCount: 1, JpegCount: 1, MemorySizeMB: 20096},
	nvml.GPU_INSTANCE_PROFILE_2_SLICE:      {Id: 14, SliceCount: 2, InstanceCount: 3, MultiprocessorCount: 32, CopyEngineCount: 2, DecoderCount: 2, JpegCount: 2, MemorySizeMB: 20096},
	nvml.GPU_INSTANCE_PROFILE_3_SLICE:      {Id: 9, SliceCount: 3, InstanceCount: 2, MultiprocessorCount: 60, CopyEngineCount: 3, DecoderCount: 3, JpegCount: 3, MemorySizeMB: 40448},
	nvml.GPU_INSTANCE_PROFILE_4_SLICE:      {Id: 5, SliceCount: 4, InstanceCount: 1, MultiprocessorCount: 64, CopyEngineCount: 4, DecoderCount: 4, JpegCount: 4, MemorySizeMB: 40448},
	nvml.GPU_INSTANCE_PROFILE_7_SLICE:      {Id: 0, SliceCount: 7, InstanceCount: 1, MultiprocessorCount: 132, CopyEngineCount: 8, DecoderCount: 7, JpegCount: 7, OfaCount: 1, MemorySizeMB: 81152},
}

// h100Placements are the placements by profile id, in memory slices.
var h100Placements = map[uint32][]nvml.GpuInstancePlacement{
	19: {{Start: 0, Size: 1}, {Start: 1, Size: 1}, {Start: 2, Size: 1}, {Start: 3, Size: 1}, {Start: 4, Size: 1}, {Start: 5, Size: 1}, {Start: 6, Size: 1}},
	20: {{Start: 0, Size: 1}, {Start: 1, Size: 1}, {Start: 2, Size: 1}, {Start: 3, Size: 1}, {Start: 4, Size: 1}, {Start: 5, Size: 1}, {Start: 6, Size: 1}},
	15: {{Start: 0, Size: 2}, {Start: 2, Size: 2}, {Start: 4, Size: 2}, {Start: 6, Size: 2}},
	14: {{Start: 0, Size: 2}, {Start: 2, Size: 2}, {Start: 4, Size: 2}},
	9:  {{Start: 0, Size: 4}, {Start: 4, Size: 4}},
	5:  {{Start: 0, Size: 4}},
	0:  {{Start: 0, Size: 8}},
}

// ciSlices are the compute-instance profiles by enum, with their slices.
var ciSlices = map[int]uint32{
	nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE: 1, nvml.COMPUTE_INSTANCE_PROFILE_2_SLICE: 2,
	nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE: 3, nvml.COMPUTE_INSTANCE_PROFILE_4_SLICE: 4,
	nvml.COMPUTE_INSTANCE_PROFILE_7_SLICE: 7,
}

type fakeCI struct {
	id   int
	enum int
	uuid string
}

type fakeGI struct {
	id        int
	info      nvml.GpuInstanceProfileInfo
	placement nvml.GpuInstancePlacement
	cis       []*fakeCI
}

// fakeGPU is one H100 SXM5 with MIG state: GPU and compute instances are
// kept, overlaps refused, and MIG device handles listed, as NVML does.
type fakeGPU struct {
	*mock.Device
	mu      sync.Mutex
	gis     []*fakeGI
	nextID  int
	nextMig int

	// createGIRet, when set, is what creating a GPU instance returns;
	// createCIRet the same for compute instances.
	createGIRet, createCIRet nvml.Return
	// busy compute instances refuse to be destroyed (processes run on them).
	busy      bool
	destroyed []string // "ci <gi>/<ci>", "gi <gi>" in order
	// failGIDestroy, when set, is what the next GPU instance destroy
	// returns (once), after its compute instances went.
	failGIDestroy nvml.Return
	// migProcs are the processes each MIG device's handle lists, by MIG
	// UUID; migProcsRet what its list calls return.
	migProcs    map[string][]nvml.ProcessInfo
	migProcsRet nvml.Return
	// migProcCalls counts the MIG handles' process utilization calls
	// (NVML samples none per MIG device: there should be none).
	migProcCalls int
}

type gpuSpec struct {
	index    int
	uuid     string
	bus      string
	migMode  int
	switches []string // NVSwitch bus ids the GPU's 18 links reach, round robin
	fabric   *nvml.GpuFabricInfo
}

func newFakeGPU(s gpuSpec) *fakeGPU {
	f := &fakeGPU{nextID: 1}
	f.Device = &mock.Device{
		GetUUIDFunc:         func() (string, nvml.Return) { return s.uuid, nvml.SUCCESS },
		GetIndexFunc:        func() (int, nvml.Return) { return s.index, nvml.SUCCESS },
		GetMinorNumberFunc:  func() (int, nvml.Return) { return s.index, nvml.SUCCESS },
		GetNameFunc:         func() (string, nvml.Return) { return "NVIDIA H100 80GB HBM3", nvml.SUCCESS },
		GetBrandFunc:        func() (nvml.BrandType, nvml.Return) { return nvml.BRAND_NVIDIA, nvml.SUCCESS },
		GetArchitectureFunc: func() (nvml.DeviceArchitecture, nvml.Return) { return nvml.DEVICE_ARCH_HOPPER, nvml.SUCCESS },
		GetCudaComputeCapabilityFunc: func() (int, int, nvml.Return) {
			return 9, 0, nvml.SUCCESS
		},
		GetMemoryInfoFunc: func() (nvml.Memory, nvml.Return) { return nvml.Memory{Total: 81559 << 20}, nvml.SUCCESS },
		GetPciInfoFunc: func() (nvml.PciInfo, nvml.Return) {
			return nvml.PciInfo{BusId: cString(s.bus), PciDeviceId: 0x233010de}, nvml.SUCCESS
		},
		GetMigModeFunc: func() (int, int, nvml.Return) { return s.migMode, s.migMode, nvml.SUCCESS },
		GetGpuInstanceProfileInfoFunc: func(p int) (nvml.GpuInstanceProfileInfo, nvml.Return) {
			if info, ok := h100Profiles[p]; ok {
				return info, nvml.SUCCESS
			}
			if p >= nvml.GPU_INSTANCE_PROFILE_COUNT {
				return nvml.GpuInstanceProfileInfo{}, nvml.ERROR_INVALID_ARGUMENT
			}
			return nvml.GpuInstanceProfileInfo{}, nvml.ERROR_NOT_SUPPORTED
		},
		GetGpuInstancePossiblePlacementsFunc: func(info *nvml.GpuInstanceProfileInfo) ([]nvml.GpuInstancePlacement, nvml.Return) {
			return h100Placements[info.Id], nvml.SUCCESS
		},
		GetNvLinkStateFunc: func(l int) (nvml.EnableState, nvml.Return) {
			if len(s.switches) == 0 {
				return 0, nvml.ERROR_NOT_SUPPORTED
			}
			if l >= 18 {
				return 0, nvml.ERROR_INVALID_ARGUMENT
			}
			return nvml.FEATURE_ENABLED, nvml.SUCCESS
		},
		GetNvLinkRemotePciInfoFunc: func(l int) (nvml.PciInfo, nvml.Return) {
			return nvml.PciInfo{BusId: cString(s.switches[l%len(s.switches)])}, nvml.SUCCESS
		},
		GetNvLinkRemoteDeviceTypeFunc: func(int) (nvml.IntNvLinkDeviceType, nvml.Return) {
			return nvml.NVLINK_DEVICE_TYPE_SWITCH, nvml.SUCCESS
		},
		GetGpuFabricInfoFunc: func() (nvml.GpuFabricInfo, nvml.Return) {
			if s.fabric == nil {
				return nvml.GpuFabricInfo{}, nvml.ERROR_NOT_SUPPORTED
			}
			return *s.fabric, nvml.SUCCESS
		},
		GetSupportedEventTypesFunc: func() (uint64, nvml.Return) {
			return nvml.EventTypeXidCriticalError | nvml.EventTypeDoubleBitEccError, nvml.SUCCESS
		},
		RegisterEventsFunc: func(uint64, nvml.EventSet) nvml.Return { return nvml.SUCCESS },
	}
	f.GetGpuInstancesFunc = f.getGpuInstances
	f.GetGpuInstanceByIdFunc = f.getGpuInstanceByID
	f.CreateGpuInstanceWithPlacementFunc = f.createGpuInstance
	f.GetMaxMigDeviceCountFunc = func() (int, nvml.Return) { return 7, nvml.SUCCESS }
	f.GetMigDeviceHandleByIndexFunc = f.getMigDeviceHandle
	return f
}

// addGI puts an existing GPU instance (with compute instances of the given
// enums) on the GPU.
func (f *fakeGPU) addGI(profile int, start uint32, ciEnums ...int) *fakeGI {
	f.mu.Lock()
	defer f.mu.Unlock()
	info := h100Profiles[profile]
	gi := &fakeGI{id: f.nextID, info: info, placement: nvml.GpuInstancePlacement{Start: start, Size: sizeOf(info)}}
	f.nextID++
	for _, e := range ciEnums {
		f.nextMig++
		gi.cis = append(gi.cis, &fakeCI{id: len(gi.cis), enum: e, uuid: fmt.Sprintf("MIG-%d", f.nextMig)})
	}
	f.gis = append(f.gis, gi)
	return gi
}

func sizeOf(info nvml.GpuInstanceProfileInfo) uint32 { return h100Placements[info.Id][0].Size }

func (f *fakeGPU) getGpuInstances(info *nvml.GpuInstanceProfileInfo) ([]nvml.GpuInstance, nvml.Return) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []nvml.GpuInstance
	for _, gi := range f.gis {
		if gi.info.Id == info.Id {
			out = append(out, f.giMock(gi))
		}
	}
	return out, nvml.SUCCESS
}

func (f *fakeGPU) getGpuInstanceByID(id int) (nvml.GpuInstance, nvml.Return) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, gi := range f.gis {
		if gi.id == id {
			return f.giMock(gi), nvml.SUCCESS
		}
	}
	return nil, nvml.ERROR_NOT_FOUND
}

func (f *fakeGPU) createGpuInstance(info *nvml.GpuInstanceProfileInfo, pl *nvml.GpuInstancePlacement) (nvml.GpuInstance, nvml.Return) {
	if f.createGIRet != nvml.SUCCESS {
		return nil, f.createGIRet
	}
	valid := false
	for _, p := range h100Placements[info.Id] {
		valid = valid || p == *pl
	}
	if !valid {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	f.mu.Lock()
	for _, gi := range f.gis {
		if pl.Start < gi.placement.Start+gi.placement.Size && gi.placement.Start < pl.Start+pl.Size {
			f.mu.Unlock()
			return nil, nvml.ERROR_INSUFFICIENT_RESOURCES
		}
	}
	f.mu.Unlock()
	var gi *fakeGI
	for e, i := range h100Profiles {
		if i.Id == info.Id {
			gi = f.addGI(e, pl.Start)
		}
	}
	return f.giMock(gi), nvml.SUCCESS
}

func (f *fakeGPU) getMigDeviceHandle(i int) (nvml.Device, nvml.Return) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, gi := range f.gis {
		for _, ci := range gi.cis {
			if n == i {
				giID, ciID, uuid := gi.id, ci.id, ci.uuid
				memBytes := uint64(gi.info.MemorySizeMB) << 20
				return &mock.Device{
					GetUUIDFunc: func() (string, nvml.Return) { return uuid, nvml.SUCCESS },
					// A MIG device handle gives its own memory: 1 GiB used.
					GetMemoryInfoFunc: func() (nvml.Memory, nvml.Return) {
						return nvml.Memory{Total: memBytes, Used: 1 << 30, Free: memBytes - 1<<30}, nvml.SUCCESS
					},
					GetGpuInstanceIdFunc:     func() (int, nvml.Return) { return giID, nvml.SUCCESS },
					GetComputeInstanceIdFunc: func() (int, nvml.Return) { return ciID, nvml.SUCCESS },
					GetComputeRunningProcessesFunc: func() ([]nvml.ProcessInfo, nvml.Return) {
						f.mu.Lock()
						defer f.mu.Unlock()
						return f.migProcs[uuid], f.migProcsRet
					},
					GetMPSComputeRunningProcessesFunc: func() ([]nvml.ProcessInfo, nvml.Return) { return nil, f.migProcsRet },
					GetProcessUtilizationFunc: func(uint64) ([]nvml.ProcessUtilizationSample, nvml.Return) {
						f.mu.Lock()
						defer f.mu.Unlock()
						f.migProcCalls++
						return nil, nvml.ERROR_NOT_SUPPORTED
					},
				}, nvml.SUCCESS
			}
			n++
		}
	}
	return nil, nvml.ERROR_NOT_FOUND
}

func (f *fakeGPU) giMock(gi *fakeGI) *mock.GpuInstance {
	return &mock.GpuInstance{
		GetInfoFunc: func() (nvml.GpuInstanceInfo, nvml.Return) {
			return nvml.GpuInstanceInfo{Device: f, Id: uint32(gi.id), ProfileId: gi.info.Id, Placement: gi.placement}, nvml.SUCCESS
		},
		GetComputeInstanceProfileInfoFunc: func(p, eng int) (nvml.ComputeInstanceProfileInfo, nvml.Return) {
			n, ok := ciSlices[p]
			if !ok || n > gi.info.SliceCount || eng != nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED {
				return nvml.ComputeInstanceProfileInfo{}, nvml.ERROR_NOT_SUPPORTED
			}
			return nvml.ComputeInstanceProfileInfo{Id: uint32(p), SliceCount: n}, nvml.SUCCESS
		},
		GetComputeInstancesFunc: func(info *nvml.ComputeInstanceProfileInfo) ([]nvml.ComputeInstance, nvml.Return) {
			f.mu.Lock()
			defer f.mu.Unlock()
			var out []nvml.ComputeInstance
			for _, ci := range gi.cis {
				if ci.enum == int(info.Id) {
					out = append(out, f.ciMock(gi, ci))
				}
			}
			return out, nvml.SUCCESS
		},
		CreateComputeInstanceFunc: func(info *nvml.ComputeInstanceProfileInfo) (nvml.ComputeInstance, nvml.Return) {
			if f.createCIRet != nvml.SUCCESS {
				return nil, f.createCIRet
			}
			f.mu.Lock()
			defer f.mu.Unlock()
			f.nextMig++
			ci := &fakeCI{id: len(gi.cis), enum: int(info.Id), uuid: fmt.Sprintf("MIG-%d", f.nextMig)}
			gi.cis = append(gi.cis, ci)
			return f.ciMock(gi, ci), nvml.SUCCESS
		},
		GetComputeInstanceByIdFunc: func(id int) (nvml.ComputeInstance, nvml.Return) {
			f.mu.Lock()
			defer f.mu.Unlock()
			for _, ci := range gi.cis {
				if ci.id == id {
					return f.ciMock(gi, ci), nvml.SUCCESS
				}
			}
			return nil, nvml.ERROR_NOT_FOUND
		},
		DestroyFunc: func() nvml.Return {
			f.mu.Lock()
			defer f.mu.Unlock()
			if len(gi.cis) > 0 {
				return nvml.ERROR_IN_USE
			}
			if ret := f.failGIDestroy; ret != nvml.SUCCESS {
				f.failGIDestroy = nvml.SUCCESS
				return ret
			}
			for i, g := range f.gis {
				if g == gi {
					f.gis = append(f.gis[:i], f.gis[i+1:]...)
					f.destroyed = append(f.destroyed, fmt.Sprintf("gi %d", gi.id))
					return nvml.SUCCESS
				}
			}
			return nvml.ERROR_NOT_FOUND
		},
	}
}

func (f *fakeGPU) ciMock(gi *fakeGI, ci *fakeCI) *mock.ComputeInstance {
	return &mock.ComputeInstance{
		GetInfoFunc: func() (nvml.ComputeInstanceInfo, nvml.Return) {
			// As in NVML, Device is the parent GPU, not the MIG device.
			return nvml.ComputeInstanceInfo{Device: f, Id: uint32(ci.id), ProfileId: uint32(ci.enum)}, nvml.SUCCESS
		},
		DestroyFunc: func() nvml.Return {
			f.mu.Lock()
			defer f.mu.Unlock()
			if f.busy {
				return nvml.ERROR_IN_USE
			}
			for i, c := range gi.cis {
				if c == ci {
					gi.cis = append(gi.cis[:i], gi.cis[i+1:]...)
					f.destroyed = append(f.destroyed, fmt.Sprintf("ci %d/%d", gi.id, ci.id))
					return nvml.SUCCESS
				}
			}
			return nvml.ERROR_NOT_FOUND
		},
	}
}

// fakeLib is NVML over the given GPUs; missing lists library symbols the
// driver lacks.
func fakeLib(gpus []*fakeGPU, missing ...string) *mock.Interface {
	devs := make([]nvml.Device, len(gpus))
	for i, g := range gpus {
		devs[i] = g
	}
	return &mock.Interface{
		SystemGetDriverVersionFunc:     func() (string, nvml.Return) { return "570.172.08", nvml.SUCCESS },
		SystemGetCudaDriverVersionFunc: func() (int, nvml.Return) { return 12080, nvml.SUCCESS },
		DeviceGetCountFunc:             func() (int, nvml.Return) { return len(devs), nvml.SUCCESS },
		DeviceGetHandleByIndexFunc: func(i int) (nvml.Device, nvml.Return) {
			if i < 0 || i >= len(devs) {
				return nil, nvml.ERROR_INVALID_ARGUMENT
			}
			return devs[i], nvml.SUCCESS
		},
		DeviceGetHandleByUUIDFunc: func(uuid string) (nvml.Device, nvml.Return) {
			for _, d := range devs {
				if u, _ := d.GetUUID(); u == uuid {
					return d, nvml.SUCCESS
				}
			}
			return nil, nvml.ERROR_NOT_FOUND
		},
		ExtensionsFunc: func() nvml.ExtendedInterface {
			return &mock.ExtendedInterface{LookupSymbolFunc: func(s string) error {
				for _, m := range missing {
					if m == s {
						return errors.New("undefined symbol: " + s)
					}
				}
				return nil
			}}
		},
		ShutdownFunc: func() nvml.Return { return nvml.SUCCESS },
	}
}

// testBackend is a backend over fakeLib, with go-nvlib told not to look up
// symbols in the (absent) library, and a sysfs root of its own.
func testBackend(t testing.TB, lib nvml.Interface) *Backend {
	t.Helper()
	return newBackend(lib, t.TempDir(), device.New(lib, device.WithVerifySymbols(false)))
}

// board is an HGX H100-like set of GPUs, every GPU's links on the given
// NVSwitches.
func board(n, migMode int, switches ...string) []*fakeGPU {
	var gpus []*fakeGPU
	for i := range n {
		gpus = append(gpus, newFakeGPU(gpuSpec{
			index: i, uuid: fmt.Sprintf("GPU-%d", i), bus: fmt.Sprintf("00000000:%02X:00.0", 0x18+0x12*i),
			migMode: migMode, switches: switches,
		}))
	}
	return gpus
}
