package dashboard

import (
	"context"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/cel"

	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// Which DeviceClasses select a device, by the classes' own CEL.

// classMatcher tells which DeviceClasses select a device, with the
// scheduler's own CEL. Devices of one kind share the attributes a class
// selects on (type, profile, product), so the answer is kept per kind:
// 8,000 GPUs of one model cost one evaluation per class, not 8,000.
type classMatcher struct {
	classes []*resourceapi.DeviceClass
	byKind  map[deviceKind][]string
}

// deviceKind is what the chart's classes select on.
type deviceKind struct {
	typ, profile, product, sharing string
	mig                            bool
}

func newClassMatcher(classes []*resourceapi.DeviceClass) *classMatcher {
	return &classMatcher{classes: classes, byKind: map[deviceKind][]string{}}
}

func (m *classMatcher) match(d *resourceapi.Device) []string {
	if len(m.classes) == 0 {
		return nil
	}
	kind := deviceKind{typ: attrString(d, "type"), profile: attrString(d, "migProfile"), product: attrString(d, "productName"), sharing: attrString(d, "sharing")}
	if a, ok := d.Attributes["migEnabled"]; ok && a.BoolValue != nil && *a.BoolValue {
		kind.mig = true
	}
	if got, ok := m.byKind[kind]; ok {
		return got
	}
	var out []string
	dev := cel.Device{Driver: slicebuilder.DriverName, Attributes: d.Attributes, Capacity: d.Capacity, AllowMultipleAllocations: d.AllowMultipleAllocations}
	for _, c := range m.classes {
		if classSelects(c, dev) {
			out = append(out, c.Name)
		}
	}
	m.byKind[kind] = out
	return out
}

// classSelects: every selector of the class matches; a selector that
// does not compile or fails on the device does not.
func classSelects(c *resourceapi.DeviceClass, dev cel.Device) bool {
	if len(c.Spec.Selectors) == 0 {
		return false // a class that selects everything says nothing about GPUs
	}
	for _, s := range c.Spec.Selectors {
		if s.CEL == nil {
			return false
		}
		res := celCache.GetOrCompile(s.CEL.Expression)
		if res.Error != nil {
			return false
		}
		ok, _, err := res.DeviceMatches(context.Background(), dev)
		if err != nil || !ok {
			return false
		}
	}
	return true
}
