package allocator

import (
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/utils/ptr"
)

// state is the scheduler's view of what is in use.
type state struct {
	allocated sets.Set[structured.DeviceID]
	shared    sets.Set[structured.SharedDeviceID]
	capacity  structured.ConsumedCapacityCollection
}

func newState() *state {
	return &state{
		allocated: sets.New[structured.DeviceID](),
		shared:    sets.New[structured.SharedDeviceID](),
		capacity:  structured.NewConsumedCapacityCollection(),
	}
}

// add records an allocation's devices as the scheduler's allocated-devices
// tracker does: exclusive devices by ID, shared ones by share ID plus their
// consumed capacity; admin access uses nothing.
func (s *state) add(res *resourceapi.DeviceAllocationResult) {
	for _, r := range res.Results {
		if ptr.Deref(r.AdminAccess, false) {
			continue
		}
		id := structured.MakeDeviceID(r.Driver, r.Pool, r.Device)
		if r.ShareID != nil {
			s.shared.Insert(structured.MakeSharedDeviceID(id, r.ShareID))
			if r.ConsumedCapacity != nil {
				s.capacity.Insert(structured.NewDeviceConsumedCapacity(id, r.ConsumedCapacity))
			}
			continue
		}
		s.allocated.Insert(id)
	}
}

// snapshot hands the allocator the current state. The allocator only reads
// it during one Allocate, and a fresh allocator is made per attempt (it
// caches available counters), so no copy is needed.
func (s *state) snapshot() structured.AllocatedState {
	return structured.AllocatedState{
		AllocatedDevices:         s.allocated,
		AllocatedSharedDeviceIDs: s.shared,
		AggregatedCapacity:       s.capacity,
	}
}

// classLister is a structured.DeviceClassLister over a fixed list.
type classLister []*resourceapi.DeviceClass

func (l classLister) List() ([]*resourceapi.DeviceClass, error) { return l, nil }

func (l classLister) Get(name string) (*resourceapi.DeviceClass, error) {
	for _, c := range l {
		if c.Name == name {
			return c, nil
		}
	}
	return nil, apierrors.NewNotFound(resourceapi.Resource("deviceclasses"), name)
}
