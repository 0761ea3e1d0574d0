package devcluster

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

// ContainerView is what a container would get from its CDI devices: the
// runtime's view after the CDI library edited the OCI spec.
type ContainerView struct {
	CDIDevices  []string          `json:"cdiDevices,omitempty"`
	Env         map[string]string `json:"env,omitempty"`
	DeviceNodes []string          `json:"deviceNodes,omitempty"`
	// Mounts are the claims' own mounts (sharing directories); the
	// driver's files, from the node's common driver spec, are DriverMounts
	// ("source:destination:options").
	Mounts       []string `json:"mounts,omitempty"`
	DriverMounts []string `json:"driverMounts,omitempty"`
	// GPUs are the UUIDs of the GPUs and MIG devices the container's
	// device nodes give it (what CUDA would enumerate), named through the
	// node's inventory; no environment variable is read for them.
	GPUs []string `json:"gpus,omitempty"`
	// Conflicts are the variables and mount points that two of the
	// container's CDI devices set differently: a runtime applies them in
	// the kubelet's order and the last one wins, so what the container
	// gets would depend on that order.
	Conflicts []string `json:"conflicts,omitempty"`
}

// VisibleGPUs are the GPU and MIG UUIDs the container sees: computed from
// its device nodes.
func (v ContainerView) VisibleGPUs() []string { return v.GPUs }

// DeviceIdentifier names the GPUs and MIG devices that a container's device
// nodes give it.
type DeviceIdentifier func(nodes []oci.LinuxDevice) ([]string, error)

// MachineDevices identifies device nodes through a simulated machine: a GPU
// is seen when its /dev/nvidia<minor> is there; a MIG device when, besides
// its parent's node, both its capability nodes
// (/dev/nvidia-caps/nvidia-cap<N> of its GPU instance and compute instance)
// are. A GPU whose node is there but none of whose MIG devices is (a whole
// GPU, or the monitoring view of one in MIG mode) is seen as the GPU.
// Nodes are matched by type, major and minor, as the kernel does.
func MachineDevices(m *sim.Machine) DeviceIdentifier {
	return func(nodes []oci.LinuxDevice) ([]string, error) {
		host, err := m.Host(context.Background())
		if err != nil {
			return nil, err
		}
		return identify(m.Devices(), host, nodes), nil
	}
}

func identify(gpus []nvdevice.GPU, host nvdevice.Host, nodes []oci.LinuxDevice) []string {
	gpuMinors, capMinors := map[int64]bool{}, map[int64]bool{}
	for _, n := range nodes {
		if n.Type != "c" {
			continue
		}
		switch n.Major {
		case host.Majors.NVIDIA:
			gpuMinors[n.Minor] = true
		case host.Majors.Caps:
			capMinors[n.Minor] = true
		}
	}
	sort.Slice(gpus, func(i, j int) bool { return gpus[i].Index < gpus[j].Index })
	var out []string
	for _, g := range gpus {
		if !gpuMinors[int64(g.Minor)] {
			continue
		}
		migs := append([]nvdevice.MigDevice(nil), g.MIG.Devices...)
		sort.Slice(migs, func(i, j int) bool { return migs[i].Placement.Start < migs[j].Placement.Start })
		var seen []string
		for _, d := range migs {
			gi, ci, err := host.CapMinors(g.Minor, d.GPUInstanceID, d.ComputeInstanceID)
			if err == nil && capMinors[int64(gi)] && capMinors[int64(ci)] {
				seen = append(seen, d.UUID)
			}
		}
		if len(seen) == 0 {
			seen = []string{g.UUID}
		}
		out = append(out, seen...)
	}
	return out
}

// ResolveCDI injects the named CDI devices from the specs in cdiDir into an
// empty OCI spec, exactly as a CDI-enabled container runtime does, and
// names the GPUs its device nodes give (identify may be nil: none named).
func ResolveCDI(cdiDir string, ids []string, identify DeviceIdentifier) (ContainerView, error) {
	view := ContainerView{CDIDevices: ids}
	if len(ids) == 0 {
		return view, nil
	}
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(cdiDir), cdiapi.WithAutoRefresh(false))
	if err != nil {
		return view, fmt.Errorf("CDI cache: %w", err)
	}
	spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
	if unresolved, err := cache.InjectDevices(spec, ids...); err != nil {
		return view, fmt.Errorf("CDI injection (unresolved %v): %w", unresolved, err)
	}
	view.Env = map[string]string{}
	for _, kv := range spec.Process.Env {
		k, v, _ := strings.Cut(kv, "=")
		view.Env[k] = v
	}
	for _, d := range spec.Linux.Devices {
		view.DeviceNodes = append(view.DeviceNodes, d.Path)
	}
	driver, err := driverMounts(cache, ids)
	if err != nil {
		return view, err
	}
	for _, m := range spec.Mounts {
		if driver[m.Source+":"+m.Destination] {
			view.DriverMounts = append(view.DriverMounts, m.Source+":"+m.Destination+":"+strings.Join(m.Options, ","))
			continue
		}
		view.Mounts = append(view.Mounts, m.Source+":"+m.Destination)
	}
	sort.Strings(view.DeviceNodes)
	sort.Strings(view.Mounts)
	sort.Strings(view.DriverMounts)
	if view.Conflicts, err = conflicts(cache, ids); err != nil {
		return view, err
	}
	if identify != nil {
		if view.GPUs, err = identify(spec.Linux.Devices); err != nil {
			return view, fmt.Errorf("name the container's GPUs: %w", err)
		}
	}
	return view, nil
}

// conflicts injects each CDI device alone and lists the variables and
// mount points two of them set to different values.
func conflicts(cache *cdiapi.Cache, ids []string) ([]string, error) {
	env, mounts := map[string]string{}, map[string]string{}
	found := map[string]bool{}
	for _, id := range ids {
		spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
		if _, err := cache.InjectDevices(spec, id); err != nil {
			return nil, fmt.Errorf("CDI injection of %s: %w", id, err)
		}
		for _, kv := range spec.Process.Env {
			k, v, _ := strings.Cut(kv, "=")
			if old, ok := env[k]; ok && old != v {
				found["env "+k] = true
			}
			env[k] = v
		}
		for _, m := range spec.Mounts {
			if old, ok := mounts[m.Destination]; ok && old != m.Source {
				found["mount "+m.Destination] = true
			}
			mounts[m.Destination] = m.Source
		}
	}
	out := make([]string, 0, len(found))
	for k := range found {
		out = append(out, k)
	}
	sort.Strings(out)
	return out, nil
}

// driverMounts are the mounts the node's common driver device gives, when
// the container has it.
func driverMounts(cache *cdiapi.Cache, ids []string) (map[string]bool, error) {
	out := map[string]bool{}
	if !slices.Contains(ids, cdi.DriverDeviceID) {
		return out, nil
	}
	spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
	if _, err := cache.InjectDevices(spec, cdi.DriverDeviceID); err != nil {
		return nil, fmt.Errorf("CDI injection of the driver device: %w", err)
	}
	for _, m := range spec.Mounts {
		out[m.Source+":"+m.Destination] = true
	}
	return out, nil
}
