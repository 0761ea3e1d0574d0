package local

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"sigs.k8s.io/yaml"

	"github.com/gpudra/gpudra/pkg/allocator"
)

// Ask is what the run and allocate flags ask for.
type Ask struct {
	GPUs       int64
	MIGProfile string
	SameNVLink bool
	Memory     string
}

// Devices writes the ask as the devices part of a ResourceClaim spec, the
// claim a cluster user would write for it.
func Devices(a Ask) (resourceapi.DeviceClaim, error) {
	req := resourceapi.ExactDeviceRequest{DeviceClassName: GPUClass, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: a.GPUs}
	if a.GPUs < 1 {
		return resourceapi.DeviceClaim{}, fmt.Errorf("--gpus %d: at least 1", a.GPUs)
	}
	if a.MIGProfile != "" {
		req.DeviceClassName = MIGClass
		req.Selectors = append(req.Selectors, cel(fmt.Sprintf(`device.attributes["gpu.gpudra.dev"].migProfile == %q`, a.MIGProfile)))
	}
	if a.Memory != "" {
		q, err := resource.ParseQuantity(a.Memory)
		if err != nil {
			return resourceapi.DeviceClaim{}, fmt.Errorf("--memory %q: %w", a.Memory, err)
		}
		req.Selectors = append(req.Selectors, cel(fmt.Sprintf(`device.capacity["gpu.gpudra.dev"].memory.compareTo(quantity(%q)) >= 0`, q.String())))
	}
	dc := resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{Name: "gpus", Exactly: &req}}}
	if a.SameNVLink && a.GPUs > 1 {
		attr := resourceapi.FullyQualifiedName(allocator.NVLinkDomainAttribute)
		dc.Constraints = []resourceapi.DeviceConstraint{{Requests: []string{"gpus"}, MatchAttribute: &attr}}
	}
	return dc, nil
}

func cel(expr string) resourceapi.DeviceSelector {
	return resourceapi.DeviceSelector{CEL: &resourceapi.CELDeviceSelector{Expression: expr}}
}

// ParseDevices reads the devices part of a ResourceClaim spec from YAML or
// JSON: a bare DeviceClaim (requests, constraints, config), a
// ResourceClaim spec ({devices: ...}), a ResourceClaim, or a
// ResourceClaimTemplate.
func ParseDevices(data []byte) (resourceapi.DeviceClaim, error) {
	var doc struct {
		Kind string `json:"kind"`
		Spec struct {
			Devices resourceapi.DeviceClaim `json:"devices"`
			Spec    struct {
				Devices resourceapi.DeviceClaim `json:"devices"`
			} `json:"spec"`
		} `json:"spec"`
		Devices resourceapi.DeviceClaim `json:"devices"`
		resourceapi.DeviceClaim
	}
	if err := yaml.UnmarshalStrict(data, &doc); err != nil {
		// Strict parsing names a misspelt field; the mixed shapes above
		// make a valid document of one shape "unknown" in another, so
		// fall back to the lenient parse only for those.
		if err2 := yaml.Unmarshal(data, &doc); err2 != nil {
			return resourceapi.DeviceClaim{}, err2
		}
	}
	var dc resourceapi.DeviceClaim
	switch doc.Kind {
	case "ResourceClaimTemplate":
		dc = doc.Spec.Spec.Devices
	case "ResourceClaim":
		dc = doc.Spec.Devices
	default:
		dc = doc.Devices
		if len(dc.Requests) == 0 {
			dc = doc.DeviceClaim
		}
	}
	if len(dc.Requests) == 0 {
		return dc, errors.New("no device requests found (want devices.requests, as in a ResourceClaim spec)")
	}
	return dc, nil
}

// Env is a process's environment for an allocation: the devices' UUIDs
// (MIG UUIDs for MIG devices) in CUDA_VISIBLE_DEVICES and
// NVIDIA_VISIBLE_DEVICES, the allocation's name, and for MPS the daemon's
// pipe directory and the client's limits.
func Env(a Allocation) []string {
	uuids := make([]string, 0, len(a.Devices))
	for _, d := range a.Devices {
		uuids = append(uuids, d.UUID)
	}
	list := strings.Join(uuids, ",")
	return append([]string{"CUDA_VISIBLE_DEVICES=" + list, "NVIDIA_VISIBLE_DEVICES=" + list, "GPUDRA_LOCAL_ALLOCATION=" + a.Name}, mpsEnv(a)...)
}

// PsRow is one holder or waiter, as gpudra local ps prints it; its JSON
// is the stable output for callers in other languages (docs/local.md).
type PsRow struct {
	Name  string `json:"name"`
	User  string `json:"user"`
	State string `json:"state"` // Allocated, Reserved, Waiting or Failed
	// Error is why a Failed request's grant failed.
	Error string `json:"error,omitempty"`
	// UUIDs are the devices held.
	UUIDs   []string `json:"uuids,omitempty"`
	Devices []string `json:"devices,omitempty"`
	// Asks says what a waiter asks for.
	Asks     string `json:"asks,omitempty"`
	Position int    `json:"position,omitempty"`
	// EstimatedStart is when a waiter should start, from the holders'
	// declared ends (--duration, reserve --for), counting devices only;
	// nil when a holder ahead of it has no declared end.
	EstimatedStart *time.Time `json:"estimatedStart,omitempty"`
	PID            int        `json:"pid,omitempty"`
	Since          time.Time  `json:"since"`
	Age            string     `json:"age"`
	Expires        *time.Time `json:"expires,omitempty"`
}

// Ps lists the holders, then the waiters in queue order, then the failed
// requests that their requesters have not yet seen; capacity is the
// machine's whole devices (for the start estimates; 0: none given).
func Ps(s *State, order []Waiter, now time.Time, capacity int) []PsRow {
	var rows []PsRow
	for _, a := range s.Allocations {
		r := PsRow{Name: a.Name, User: a.User, State: "Allocated", PID: a.Holder.PID, Since: a.Since,
			Age: now.Sub(a.Since).Round(time.Second).String(), Expires: a.Expires}
		if a.Expires != nil {
			r.State = "Reserved"
		}
		for _, d := range a.Devices {
			r.UUIDs = append(r.UUIDs, d.UUID)
			r.Devices = append(r.Devices, d.Name)
		}
		rows = append(rows, r)
	}
	starts := estimateStarts(s, order, now, capacity)
	for i, w := range order {
		rows = append(rows, PsRow{Name: w.Name, User: w.User, State: "Waiting", Asks: fmt.Sprintf("%d device(s)", requestedDevices(w.Request)),
			Position: i + 1, PID: w.Holder.PID, Since: w.QueuedAt, Age: now.Sub(w.QueuedAt).Round(time.Second).String(),
			EstimatedStart: starts[i]})
	}
	for _, w := range s.Waiters {
		if w.Error != "" {
			rows = append(rows, PsRow{Name: w.Name, User: w.User, State: "Failed", Error: w.Error, Asks: fmt.Sprintf("%d device(s)", requestedDevices(w.Request)),
				PID: w.Holder.PID, Since: w.QueuedAt, Age: now.Sub(w.QueuedAt).Round(time.Second).String()})
		}
	}
	return rows
}

// estimateStarts estimates when each waiter (in order) starts: when, by
// the holders' declared ends, enough devices are free for it and every
// waiter before it. It counts devices, not which ones (a request for one
// NVLink domain may wait longer), and assumes a started waiter runs for
// its --duration; nil from the first waiter that depends on an end nobody
// declared.
func estimateStarts(s *State, order []Waiter, now time.Time, capacity int) []*time.Time {
	out := make([]*time.Time, len(order))
	if capacity == 0 {
		return out
	}
	type release struct {
		at      time.Time
		devices int
	}
	var ends []release
	free := capacity
	for _, a := range s.Allocations {
		free -= len(a.Devices)
		switch {
		case a.Expires != nil:
			ends = append(ends, release{*a.Expires, len(a.Devices)})
		case a.Duration != nil:
			ends = append(ends, release{a.Since.Add(*a.Duration), len(a.Devices)})
		}
	}
	at := now
	for i, w := range order {
		need := int(requestedDevices(w.Request))
		for free < need {
			if len(ends) == 0 {
				return out
			}
			slices.SortFunc(ends, func(a, b release) int { return a.at.Compare(b.at) })
			at = maxTime(at, ends[0].at)
			free += ends[0].devices
			ends = ends[1:]
		}
		start := at
		out[i] = &start
		free -= need
		if w.Duration != nil {
			ends = append(ends, release{start.Add(*w.Duration), need})
		}
	}
	return out
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
