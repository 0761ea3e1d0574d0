package gang

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"

	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// nodeSlices are what the plugin publishes for a simulated machine.
func nodeSlices(t testing.TB, machine, node string, opts slicebuilder.Options) []*resourceapi.ResourceSlice {
	t.Helper()
	m, err := sim.NewBuiltin(machine, node)
	require.NoError(t, err)
	inv, err := m.Inventory(context.Background())
	require.NoError(t, err)
	res, err := slicebuilder.Build(inv, node, opts)
	require.NoError(t, err)
	var out []*resourceapi.ResourceSlice
	for _, s := range slicebuilder.ResourceSlices(res, node) {
		s.UID = types.UID(s.Name)
		out = append(out, &s)
	}
	return out
}

func celClass(name, expr string) *resourceapi.DeviceClass {
	return &resourceapi.DeviceClass{ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID(name), ResourceVersion: "1"}, Spec: resourceapi.DeviceClassSpec{
		Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: expr}}}}}
}

// TestClassCounterEqualsFromScratch: through random slice adds, updates
// and deletes, claim allocations, releases and deletions, reservations
// holding claims and class changes, the counts kept from events equal a
// count from scratch after every step (issue 26). MIG-mode nodes make
// counter sets matter: a MIG device in use makes its GPU allocated.
func TestClassCounterEqualsFromScratch(t *testing.T) {
	ctx := context.Background()
	celCache := cel.NewCache(10, cel.Features{})
	counter := newClassCounter(celCache)
	classes := map[string]*resourceapi.DeviceClass{}
	setClass := func(c *resourceapi.DeviceClass) {
		classes[c.Name] = c
		counter.upsertClass(ctx, c)
	}
	setClass(celClass("gpu.gpudra.dev", `device.attributes["gpu.gpudra.dev"].type == "gpu"`))
	setClass(celClass("mig.gpudra.dev", `device.attributes["gpu.gpudra.dev"].type == "mig"`))

	published := map[types.UID]*resourceapi.ResourceSlice{}
	claims := map[string]*resourceapi.ResourceClaim{}
	held := sets.New[string]()
	publish := func(s *resourceapi.ResourceSlice) {
		published[s.UID] = s
		counter.upsertSlice(ctx, s)
	}
	machines := []string{"h100-pcie", "dgx-h100-nomig"}
	nodes := 0
	addNode := func() {
		node := fmt.Sprintf("node-%d", nodes)
		for _, s := range nodeSlices(t, machines[nodes%2], node, slicebuilder.Options{}) {
			publish(s)
		}
		nodes++
	}
	addNode()
	addNode()

	rng := rand.New(rand.NewPCG(1, 26))
	pick := func() (*resourceapi.ResourceSlice, bool) {
		var withDevices []*resourceapi.ResourceSlice
		for _, s := range published {
			if len(s.Spec.Devices) > 0 {
				withDevices = append(withDevices, s)
			}
		}
		if len(withDevices) == 0 {
			return nil, false
		}
		// Map order is random: sort for a reproducible sequence.
		slices.SortFunc(withDevices, func(a, b *resourceapi.ResourceSlice) int { return strings.Compare(a.Name, b.Name) })
		return withDevices[rng.IntN(len(withDevices))], true
	}
	claimKeys := func() []string {
		keys := sets.List(sets.KeySet(claims))
		return keys
	}
	steps := map[string]int{}
	for step := range 400 {
		var op string
		switch r := rng.IntN(100); {
		case r < 35:
			op = "allocate"
			s, ok := pick()
			if !ok {
				continue
			}
			name := fmt.Sprintf("c%d", step)
			var devices []string
			for range 1 + rng.IntN(2) {
				devices = append(devices, s.Spec.Devices[rng.IntN(len(s.Spec.Devices))].Name)
			}
			cl := allocatedClaim(name, devices...)
			for i := range cl.Status.Allocation.Devices.Results {
				cl.Status.Allocation.Devices.Results[i].Pool = s.Spec.Pool.Name
			}
			if rng.IntN(2) == 0 {
				cl.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: "p", UID: "p"}}
			}
			claims["ns/"+name] = cl
			counter.upsertClaim(cl)
		case r < 50:
			keys := claimKeys()
			if len(keys) == 0 {
				continue
			}
			key := keys[rng.IntN(len(keys))]
			if rng.IntN(2) == 0 {
				op = "deallocate"
				cl := claims[key].DeepCopy()
				cl.Status.Allocation, cl.Status.ReservedFor = nil, nil
				claims[key] = cl
				counter.upsertClaim(cl)
			} else {
				op = "delete claim"
				counter.deleteClaim(claims[key])
				delete(claims, key)
			}
		case r < 60:
			op = "hold"
			held = sets.New[string]()
			for _, k := range claimKeys() {
				if rng.IntN(3) == 0 {
					held.Insert(k)
				}
			}
			counter.setHeld(held)
		case r < 80:
			s, ok := pick()
			if !ok {
				continue
			}
			s = s.DeepCopy()
			s.ResourceVersion = fmt.Sprint(step)
			i := rng.IntN(len(s.Spec.Devices))
			if r < 72 {
				op = "update slice: a device changes"
				typ := "gpu"
				if *s.Spec.Devices[i].Attributes["type"].StringValue == "gpu" {
					typ = "mig"
				}
				s.Spec.Devices[i].Attributes["type"] = resourceapi.DeviceAttribute{StringValue: &typ}
			} else {
				op = "update slice: a device goes"
				s.Spec.Devices = append(s.Spec.Devices[:i], s.Spec.Devices[i+1:]...)
			}
			publish(s)
		case r < 88:
			op = "delete slice"
			s, ok := pick()
			if !ok {
				continue
			}
			delete(published, s.UID)
			counter.deleteSlice(s)
		case r < 95:
			op = "add node"
			addNode()
		default:
			op = "update class"
			c := classes["mig.gpudra.dev"].DeepCopy()
			c.ResourceVersion = fmt.Sprint(step)
			c.Spec.Selectors[0].CEL.Expression = fmt.Sprintf(`device.attributes["gpu.gpudra.dev"].type == "mig" && device.attributes["gpu.gpudra.dev"].index <= %d`, rng.IntN(2))
			setClass(c)
		}
		steps[op]++

		var sl []*resourceapi.ResourceSlice
		for _, s := range published {
			sl = append(sl, s)
		}
		var cls []*resourceapi.DeviceClass
		for _, c := range classes {
			cls = append(cls, c)
		}
		var cs []*resourceapi.ResourceClaim
		for _, c := range claims {
			cs = append(cs, c)
		}
		want := countByClass(ctx, celCache, cls, sl, cs, held, nil)
		require.Equal(t, want, counter.snapshot(), "step %d: %s", step, op)
	}
	for _, op := range []string{"allocate", "deallocate", "delete claim", "hold", "update slice: a device changes", "update slice: a device goes", "delete slice", "add node", "update class"} {
		require.Positive(t, steps[op], "the sequence exercised %q", op)
	}
}
