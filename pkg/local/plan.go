package local

import (
	"context"
	"fmt"
	"slices"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/gpudra/gpudra/pkg/allocator"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// Device classes as the chart installs them: a request written for the
// cluster names them.
const (
	GPUClass = "gpu.gpudra.dev"
	MIGClass = "mig.gpudra.dev"
)

// Classes are the chart's DeviceClasses that mean something on one
// machine: whole GPUs and MIG devices (the MPS and time-slicing classes
// select whole GPUs too).
func Classes() []*resourceapi.DeviceClass {
	class := func(name, expr string) *resourceapi.DeviceClass {
		return &resourceapi.DeviceClass{ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: resourceapi.DeviceClassSpec{Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
				Expression: `device.driver == "gpu.gpudra.dev" && ` + expr}}}}}
	}
	gpu := `device.attributes["gpu.gpudra.dev"].type == "gpu"`
	return []*resourceapi.DeviceClass{
		class(GPUClass, gpu),
		class(MIGClass, `device.attributes["gpu.gpudra.dev"].type == "mig"`),
		class("gpu-mps.gpudra.dev", gpu),
		class("gpu-timesliced.gpudra.dev", gpu),
	}
}

// Machine is what plans run over: the machine's published devices, as the
// kubelet plugin would publish them: with the MIG policy all where local
// may create MIG devices (every placement of a GPU in MIG mode), existing
// otherwise.
type Machine struct {
	Node   string
	Slices []*resourceapi.ResourceSlice
	// devices by name, for the UUIDs and domains of a result.
	devices map[string]resourceapi.Device
	// placements are the MIG placements by device name, for the ones that
	// do not exist yet.
	placements map[string]MigPlacement
}

// MigPlacement is a MIG device local creates for an allocation: recorded
// before it is created, so that a kill between the steps is rolled back
// by placement.
type MigPlacement struct {
	ParentUUID string `json:"parentUUID"`
	Profile    string `json:"profile"`
	Start      int    `json:"start"`
	// UUID is set once it exists.
	UUID string `json:"uuid,omitempty"`
}

// NewMachine builds the machine's slices from its inventory; createMIG
// publishes every MIG placement of a GPU in MIG mode, which a plan may then
// choose and local creates.
func NewMachine(inv *nvdevice.Inventory, node string, createMIG bool) (*Machine, error) {
	opts := slicebuilder.Options{Mig: slicebuilder.MigPolicy{Existing: true}, ExistingMigOnly: true}
	if createMIG {
		opts = slicebuilder.Options{}
	}
	res, err := slicebuilder.Build(inv, node, opts)
	if err != nil {
		return nil, err
	}
	m := &Machine{Node: node, devices: map[string]resourceapi.Device{}, placements: map[string]MigPlacement{}}
	for i := range inv.GPUs {
		g := &inv.GPUs[i]
		for _, p := range g.MIG.Profiles {
			for _, pl := range p.Placements {
				m.placements[slicebuilder.MigDeviceName(g, p.Name, pl.Start)] = MigPlacement{ParentUUID: g.UUID, Profile: p.Name, Start: pl.Start}
			}
		}
	}
	for _, s := range slicebuilder.ResourceSlices(res, node) {
		m.Slices = append(m.Slices, &s)
		for _, d := range s.Spec.Devices {
			m.devices[d.Name] = d
		}
	}
	return m, nil
}

// drainedSlices are the slices without the devices of drained GPUs (a
// whole GPU by its uuid, a MIG device by its parent's).
func (m *Machine) drainedSlices(drained []string) []*resourceapi.ResourceSlice {
	if len(drained) == 0 {
		return m.Slices
	}
	out := make([]*resourceapi.ResourceSlice, 0, len(m.Slices))
	for _, s := range m.Slices {
		c := s.DeepCopy()
		c.Spec.Devices = slices.DeleteFunc(c.Spec.Devices, func(d resourceapi.Device) bool {
			return slices.Contains(drained, allocator.StringAttribute(d, "uuid")) || slices.Contains(drained, allocator.StringAttribute(d, "parentUUID"))
		})
		out = append(out, c)
	}
	return out
}

// claim is the request as a ResourceClaim, allocated with result when it
// is set.
func claim(r Request, result *resourceapi.AllocationResult) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: r.Name, Namespace: r.User, UID: types.UID("local-" + r.Name)},
		Spec:       resourceapi.ResourceClaimSpec{Devices: r.Devices},
	}
	if result != nil {
		c.Status.Allocation = result.DeepCopy()
	}
	return c
}

// plan finds devices for r beside the allocations, or says why none fit
// (an allocator.NotFitError when the machine is busy).
func (m *Machine) plan(ctx context.Context, r Request, allocs []Allocation, drained []string) (Allocation, error) {
	allocated := make([]*resourceapi.ResourceClaim, 0, len(allocs))
	for _, a := range allocs {
		// Time-slicing requests share devices with each other, MPS ones
		// too (never with an exclusive one, nor across kinds): their
		// devices do not count as used for one.
		if sharesWith(r, a) {
			continue
		}
		allocated = append(allocated, claim(a.Request, &a.Result))
	}
	res, err := allocator.Plan(ctx, allocator.Input{
		Claims:    []*resourceapi.ResourceClaim{claim(r, nil)},
		Slices:    m.drainedSlices(drained),
		Classes:   Classes(),
		Allocated: allocated,
		Strategy:  allocator.FewestNVLinkDomains,
	})
	if err != nil {
		return Allocation{}, err
	}
	a := Allocation{Request: r, Result: res.Allocations[0].Result}
	for _, d := range a.Result.Devices.Results {
		dev, ok := m.devices[d.Device]
		if !ok {
			return Allocation{}, fmt.Errorf("the allocator chose %s, which the machine does not publish", d.Device)
		}
		ad := Device{Name: d.Device, UUID: allocator.StringAttribute(dev, "uuid"), NVLinkDomain: allocator.StringAttribute(dev, "nvlinkDomain")}
		if ad.UUID == "" {
			// A MIG placement that does not exist yet: created at grant.
			pl, ok := m.placements[d.Device]
			if !ok {
				return Allocation{}, fmt.Errorf("device %s has no UUID and is no MIG placement", d.Device)
			}
			ad.MIG = &pl
		}
		a.Devices = append(a.Devices, ad)
	}
	return a, nil
}

// Fits says whether r could ever be met on the empty, undrained machine:
// a request no wait would meet is refused at once.
func (m *Machine) Fits(ctx context.Context, r Request) error {
	_, err := m.plan(ctx, r, nil, nil)
	return err
}

// hasGPU says whether the machine has a whole GPU with this UUID.
func (m *Machine) hasGPU(uuid string) bool {
	for _, d := range m.devices {
		if allocator.StringAttribute(d, "uuid") == uuid || allocator.StringAttribute(d, "parentUUID") == uuid {
			return true
		}
	}
	return false
}

// Capacity is the number of whole GPUs the machine publishes.
func (m *Machine) Capacity() int {
	n := 0
	for _, d := range m.devices {
		if allocator.StringAttribute(d, "type") == "gpu" {
			n++
		}
	}
	return n
}
