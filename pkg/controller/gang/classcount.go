package gang

import (
	"context"
	"slices"
	"sync"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/tools/cache"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/utils/ptr"
)

// classCounter keeps the per-class device counts of gpudra_class_devices
// up to date from slice, class and claim events, so that a count costs
// what changed, not the cluster (issue 26: recounting 208,000 devices took
// 0.43 s even with the CEL results remembered). A device is counted, per
// class that selects it:
//   - held: a reservation's claim not in use allocated it;
//   - allocated: any other claim allocated it (this wins over held), or a
//     device sharing a counter set with it is held or allocated (a GPU with
//     a MIG device in use);
//   - free: otherwise. A shared device (a claim result with a share ID) is
//     free.
//
// CEL runs when a device or a class changes, once per device and class.
// Safe for concurrent use (the informers' handlers run on their own
// goroutines).
type classCounter struct {
	mu      sync.Mutex
	cel     *cel.Cache
	classes map[string]*resourceapi.DeviceClass
	// slices are the devices each slice publishes, by slice UID.
	slices  map[types.UID][]devKey
	devices map[devKey]*countedDevice
	// setMembers are the published devices consuming each counter set;
	// setUsed how many of them a claim uses.
	setMembers map[setKey][]devKey
	setUsed    map[setKey]int
	// claims are the devices each allocated claim holds, by claim key.
	claims map[string]countedClaim
	// use counts the claims holding each device, published or not.
	use    map[devKey]deviceUse
	held   sets.Set[string]
	counts map[classPool]*classCount
	// poolLabels are the node label keys that name a node's pool, tried
	// in order (Options.NodePoolLabels); nodePools the pool of each node
	// seen, sliceNodes the node of each slice (by UID), nodeSlices the
	// slices of each node: a node whose pool label changes moves its
	// devices' counts to the other pool.
	poolLabels []string
	nodePools  map[string]string
	sliceNodes map[types.UID]string
	nodeSlices map[string]sets.Set[types.UID]
}

// classPool is one DeviceClass in one node pool ("" for devices of nodes
// without a pool label, and of slices that name no node).
type classPool struct{ class, pool string }

// classCount is how many devices of one DeviceClass are free, held by a
// reservation's claim not in use, or allocated otherwise (classCounter).
type classCount struct{ free, held, allocated int }

type devKey struct{ driver, pool, device string }
type setKey struct{ driver, pool, set string }

type countedDevice struct {
	// slice publishes it: while a driver moves a device between slices,
	// the older slice's update must not remove the newer's.
	slice   types.UID
	spec    resourceapi.Device
	sets    []setKey
	classes []string // the classes that select it
	pool    string   // its node's pool
}

type countedClaim struct {
	devices  []devKey
	reserved bool // in use by a pod
}

type deviceUse struct{ held, allocated int }

func newClassCounter(celCache *cel.Cache, poolLabels ...string) *classCounter {
	return &classCounter{cel: celCache, classes: map[string]*resourceapi.DeviceClass{}, slices: map[types.UID][]devKey{},
		devices: map[devKey]*countedDevice{}, setMembers: map[setKey][]devKey{}, setUsed: map[setKey]int{},
		claims: map[string]countedClaim{}, use: map[devKey]deviceUse{}, held: sets.New[string](), counts: map[classPool]*classCount{},
		poolLabels: poolLabels, nodePools: map[string]string{}, sliceNodes: map[types.UID]string{}, nodeSlices: map[string]sets.Set[types.UID]{}}
}

// state is a published device's state now.
func (c *classCounter) state(k devKey, d *countedDevice) string {
	u := c.use[k]
	switch {
	case u.allocated > 0:
		return "allocated"
	case u.held > 0:
		return "held"
	}
	for _, s := range d.sets {
		if c.setUsed[s] > 0 {
			return "allocated"
		}
	}
	return "free"
}

func (c *classCounter) add(k devKey, sign int) {
	d := c.devices[k]
	if d == nil {
		return
	}
	st := c.state(k, d)
	for _, class := range d.classes {
		key := classPool{class, d.pool}
		cnt := c.counts[key]
		if cnt == nil {
			cnt = &classCount{}
			c.counts[key] = cnt
		}
		switch st {
		case "held":
			cnt.held += sign
		case "allocated":
			cnt.allocated += sign
		default:
			cnt.free += sign
		}
	}
}

// change takes the devices out of the counts, with every device that
// shares a counter set with them or consumes one of extra (their state may
// follow), runs mutate, and counts them again.
func (c *classCounter) change(keys []devKey, extra []setKey, mutate func()) {
	affected := sets.New[devKey](keys...)
	for _, k := range keys {
		if d := c.devices[k]; d != nil {
			extra = append(extra, d.sets...)
		}
	}
	for _, s := range extra {
		affected.Insert(c.setMembers[s]...)
	}
	for k := range affected {
		c.add(k, -1)
	}
	mutate()
	for k := range affected {
		c.add(k, +1)
	}
}

// used says whether a claim uses the device now (the counter sets follow).
func (c *classCounter) used(k devKey) bool {
	u := c.use[k]
	return u.held+u.allocated > 0
}

func (c *classCounter) setDeviceUse(k devKey, delta deviceUse) {
	before := c.used(k)
	u := c.use[k]
	u.held += delta.held
	u.allocated += delta.allocated
	if u == (deviceUse{}) {
		delete(c.use, k)
	} else {
		c.use[k] = u
	}
	if after := c.used(k); after != before {
		if d := c.devices[k]; d != nil {
			for _, s := range d.sets {
				if after {
					c.setUsed[s]++
				} else {
					c.setUsed[s]--
				}
			}
		}
	}
}

// upsertSlice records a slice's devices; CEL runs only on devices that are
// new or changed.
func (c *classCounter) upsertSlice(ctx context.Context, sl *resourceapi.ResourceSlice) {
	c.mu.Lock()
	defer c.mu.Unlock()
	old := c.slices[sl.UID]
	var keys []devKey
	var newSets []setKey
	for _, d := range sl.Spec.Devices {
		keys = append(keys, devKey{sl.Spec.Driver, sl.Spec.Pool.Name, d.Name})
		for _, cc := range d.ConsumesCounters {
			newSets = append(newSets, setKey{sl.Spec.Driver, sl.Spec.Pool.Name, cc.CounterSet})
		}
	}
	c.change(append(slices.Clone(old), keys...), newSets, func() {
		kept := map[devKey]*countedDevice{}
		for _, k := range old {
			if d := c.devices[k]; d != nil && d.slice == sl.UID {
				kept[k] = d
			}
			c.removeDevice(k, sl.UID)
		}
		for i, d := range sl.Spec.Devices {
			k := keys[i]
			if other := c.devices[k]; other != nil {
				c.removeDevice(k, other.slice) // moved here from another slice
			}
			cd := kept[k]
			if cd == nil || !equality.Semantic.DeepEqual(cd.spec, d) {
				cd = &countedDevice{slice: sl.UID, spec: d, classes: c.match(ctx, sl.Spec.Driver, d)}
			}
			cd.pool = c.nodePools[ptr.Deref(sl.Spec.NodeName, "")]
			cd.sets = nil
			for _, cc := range d.ConsumesCounters {
				cd.sets = append(cd.sets, setKey{sl.Spec.Driver, sl.Spec.Pool.Name, cc.CounterSet})
			}
			c.addDevice(k, cd)
		}
		c.slices[sl.UID] = keys
		c.setSliceNode(sl.UID, ptr.Deref(sl.Spec.NodeName, ""))
	})
}

func (c *classCounter) deleteSlice(sl *resourceapi.ResourceSlice) {
	c.mu.Lock()
	defer c.mu.Unlock()
	old := c.slices[sl.UID]
	c.change(old, nil, func() {
		for _, k := range old {
			c.removeDevice(k, sl.UID)
		}
		delete(c.slices, sl.UID)
		c.setSliceNode(sl.UID, "")
	})
}

func (c *classCounter) addDevice(k devKey, d *countedDevice) {
	c.devices[k] = d
	for _, s := range d.sets {
		c.setMembers[s] = append(c.setMembers[s], k)
		if c.used(k) {
			c.setUsed[s]++
		}
	}
}

// removeDevice forgets a device the given slice published.
func (c *classCounter) removeDevice(k devKey, slice types.UID) {
	d := c.devices[k]
	if d == nil || d.slice != slice {
		return
	}
	for _, s := range d.sets {
		c.setMembers[s] = slices.DeleteFunc(c.setMembers[s], func(m devKey) bool { return m == k })
		if len(c.setMembers[s]) == 0 {
			delete(c.setMembers, s)
		}
		if c.used(k) {
			if c.setUsed[s]--; c.setUsed[s] <= 0 {
				delete(c.setUsed, s)
			}
		}
	}
	delete(c.devices, k)
}

// match lists the classes that select a device.
func (c *classCounter) match(ctx context.Context, driver string, d resourceapi.Device) []string {
	var out []string
	for name, class := range c.classes {
		if matches(ctx, c.cel, class, driver, d) {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}

// upsertClass evaluates a new or changed class on every device (classes
// change rarely; devices and claims often).
func (c *classCounter) upsertClass(ctx context.Context, class *resourceapi.DeviceClass) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if old := c.classes[class.Name]; old != nil && old.ResourceVersion == class.ResourceVersion && old.ResourceVersion != "" {
		return
	}
	c.classes[class.Name] = class
	c.reclass(ctx, class.Name)
}

func (c *classCounter) deleteClass(ctx context.Context, class *resourceapi.DeviceClass) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.classes, class.Name)
	c.reclass(ctx, class.Name)
}

// reclass evaluates one class again on every device and counts it anew.
func (c *classCounter) reclass(ctx context.Context, name string) {
	for key := range c.counts {
		if key.class == name {
			delete(c.counts, key)
		}
	}
	class := c.classes[name]
	for k, d := range c.devices {
		d.classes = slices.DeleteFunc(d.classes, func(n string) bool { return n == name })
		if class == nil || !matches(ctx, c.cel, class, k.driver, d.spec) {
			continue
		}
		d.classes = append(d.classes, name)
		slices.Sort(d.classes)
		key := classPool{name, d.pool}
		cnt := c.counts[key]
		if cnt == nil {
			cnt = &classCount{}
			c.counts[key] = cnt
		}
		switch c.state(k, d) {
		case "held":
			cnt.held++
		case "allocated":
			cnt.allocated++
		default:
			cnt.free++
		}
	}
}

// upsertClaim records which devices an allocated claim holds.
func (c *classCounter) upsertClaim(cl *resourceapi.ResourceClaim) {
	key := cl.Namespace + "/" + cl.Name
	var next countedClaim
	if cl.Status.Allocation != nil {
		for _, r := range cl.Status.Allocation.Devices.Results {
			if r.ShareID == nil {
				next.devices = append(next.devices, devKey{r.Driver, r.Pool, r.Device})
			}
		}
		next.reserved = len(cl.Status.ReservedFor) > 0
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.setClaim(key, next)
}

func (c *classCounter) deleteClaim(cl *resourceapi.ResourceClaim) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.setClaim(cl.Namespace+"/"+cl.Name, countedClaim{})
}

func (c *classCounter) setClaim(key string, next countedClaim) {
	old, had := c.claims[key]
	if !had && len(next.devices) == 0 {
		return
	}
	c.change(append(slices.Clone(old.devices), next.devices...), nil, func() {
		if had {
			c.claimUse(key, old, -1)
		}
		if len(next.devices) == 0 {
			delete(c.claims, key)
			return
		}
		c.claims[key] = next
		c.claimUse(key, next, +1)
	})
}

func (c *classCounter) claimUse(key string, cl countedClaim, sign int) {
	delta := deviceUse{allocated: sign}
	if c.held.Has(key) && !cl.reserved {
		delta = deviceUse{held: sign}
	}
	for _, k := range cl.devices {
		c.setDeviceUse(k, delta)
	}
}

// setHeld records which claims reservations hold (the round knows); only
// the claims whose part changed are counted again.
func (c *classCounter) setHeld(held sets.Set[string]) {
	c.mu.Lock()
	defer c.mu.Unlock()
	changed := held.Difference(c.held).Union(c.held.Difference(held))
	for key := range changed {
		cl, ok := c.claims[key]
		if !ok {
			continue
		}
		c.change(cl.devices, nil, func() {
			c.claimUse(key, cl, -1)
			if held.Has(key) {
				c.held.Insert(key)
			} else {
				c.held.Delete(key)
			}
			c.claimUse(key, cl, +1)
		})
	}
	c.held = held.Clone()
}

// snapshot returns the counts per class, over every pool.
func (c *classCounter) snapshot() map[string]classCount {
	out := map[string]classCount{}
	for key, cnt := range c.snapshotByPool() {
		sum := out[key.class]
		sum.free += cnt.free
		sum.held += cnt.held
		sum.allocated += cnt.allocated
		out[key.class] = sum
	}
	return out
}

// snapshotByPool returns the counts per class and node pool: a class with
// no device is counted (zero) in pool "", a pool whose devices are gone
// is not.
func (c *classCounter) snapshotByPool() map[classPool]classCount {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[classPool]classCount, len(c.counts)+len(c.classes))
	for name := range c.classes {
		out[classPool{name, ""}] = classCount{}
	}
	for key, cnt := range c.counts {
		if _, ok := c.classes[key.class]; ok && (*cnt != classCount{} || key.pool == "") {
			out[key] = *cnt
		}
	}
	return out
}

// handlers feed the counter from the informers.
func (c *classCounter) handlers(ctx context.Context) (slice, class, claim cache.ResourceEventHandler) {
	unwrap := func(obj any) any {
		if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
			return t.Obj
		}
		return obj
	}
	slice = cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { c.upsertSlice(ctx, obj.(*resourceapi.ResourceSlice)) },
		UpdateFunc: func(_, obj any) { c.upsertSlice(ctx, obj.(*resourceapi.ResourceSlice)) },
		DeleteFunc: func(obj any) {
			if sl, ok := unwrap(obj).(*resourceapi.ResourceSlice); ok {
				c.deleteSlice(sl)
			}
		},
	}
	class = cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { c.upsertClass(ctx, obj.(*resourceapi.DeviceClass)) },
		UpdateFunc: func(_, obj any) { c.upsertClass(ctx, obj.(*resourceapi.DeviceClass)) },
		DeleteFunc: func(obj any) {
			if cl, ok := unwrap(obj).(*resourceapi.DeviceClass); ok {
				c.deleteClass(ctx, cl)
			}
		},
	}
	claim = cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { c.upsertClaim(obj.(*resourceapi.ResourceClaim)) },
		UpdateFunc: func(_, obj any) { c.upsertClaim(obj.(*resourceapi.ResourceClaim)) },
		DeleteFunc: func(obj any) {
			if cl, ok := unwrap(obj).(*resourceapi.ResourceClaim); ok {
				c.deleteClaim(cl)
			}
		},
	}
	return slice, class, claim
}

// matches evaluates a class's CEL selectors on a device; an expression
// that does not compile or fails matches nothing.
func matches(ctx context.Context, cache *cel.Cache, class *resourceapi.DeviceClass, driver string, d resourceapi.Device) bool {
	for _, sel := range class.Spec.Selectors {
		if sel.CEL == nil {
			continue
		}
		res := cache.GetOrCompile(sel.CEL.Expression)
		if res.Error != nil {
			return false
		}
		ok, _, err := res.DeviceMatches(ctx, cel.Device{Driver: driver, Attributes: d.Attributes, Capacity: d.Capacity, AllowMultipleAllocations: d.AllowMultipleAllocations})
		if err != nil || !ok {
			return false
		}
	}
	return true
}

// countClasses sets the per-class gauges: the devices by node pool and
// state from the counter, and the demand (demand.go). It runs per round,
// and per tick of an idle controller whose counts are stale: a scrape
// only reads the gauges.
func (c *Controller) countClasses(heldClaims sets.Set[string]) {
	c.counter.setHeld(heldClaims)
	seen := map[[3]string]bool{}
	for key, cnt := range c.counter.snapshotByPool() {
		for state, n := range map[string]int{"free": cnt.free, "held": cnt.held, "allocated": cnt.allocated} {
			labels := [3]string{key.class, key.pool, state}
			seen[labels] = true
			c.metrics.devices.WithLabelValues(labels[:]...).Set(float64(n))
		}
	}
	// A class or pool that is gone leaves no series behind.
	for labels := range c.deviceSeries {
		if !seen[labels] {
			c.metrics.devices.DeleteLabelValues(labels[:]...)
		}
	}
	c.deviceSeries = seen
	c.setDemand()
}
